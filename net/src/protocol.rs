//! The wire protocol between workers and parameter servers.
//!
//! Every exchange is one request and one response on its own QUIC
//! bidirectional stream (or, for a worker on a server's own host, its own
//! Unix socket connection: [`crate::local`]). A message travels as a frame: a 4-byte little-endian
//! length followed by an rkyv archive of [`Request`] or [`Response`]. Receivers
//! copy the payload into an aligned buffer and validate it with bytecheck before
//! anything reads it, so a malformed frame is a typed [`ProtocolError`], never a
//! panic or undefined behaviour.
//!
//! ```
//! use ps_net::protocol::{decode_request, encode_request, Request};
//! let req = Request::Heartbeat;
//! let frame = encode_request(&req).unwrap();
//! assert_eq!(decode_request(&frame[4..]).unwrap(), req);
//! assert!(decode_request(&[1, 2, 3]).is_err());
//! ```

use rkyv::rancor;
pub use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};

use ps_shared::sparse::{f16_to_f32, values_from_f16, values_to_f16, SparseGrad};

/// Bumped on every incompatible change; a mismatching Hello is refused.
pub const PROTOCOL_VERSION: u32 = 10;

/// Bytes of the length prefix in front of each frame.
pub const FRAME_HEADER_BYTES: usize = 4;

/// Largest Hello frame a server reads before the client is authenticated.
pub const MAX_HELLO_BYTES: usize = 4096;

/// QUIC application close codes.
pub mod close {
    /// The worker said goodbye.
    pub const BYE: u32 = 0;
    /// The Hello was refused.
    pub const REFUSED: u32 = 1;
    /// The server is shutting down (a restart may follow): reconnect.
    pub const SHUTTING_DOWN: u32 = 2;
    /// The server dropped the worker (silent too long).
    pub const EVICTED: u32 = 3;
    /// The worker stopped without a goodbye.
    pub const ABORTED: u32 = 4;
}

/// Values of a sparse or dense payload, optionally as f16 bits.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum WireValues {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

impl WireValues {
    pub fn encode(values: Vec<f32>, f16: bool) -> Self {
        if f16 {
            WireValues::F16(values_to_f16(&values))
        } else {
            WireValues::F32(values)
        }
    }

    pub fn len(&self) -> usize {
        match self {
            WireValues::F32(v) => v.len(),
            WireValues::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn into_f32(self) -> Vec<f32> {
        match self {
            WireValues::F32(v) => v,
            WireValues::F16(v) => values_from_f16(&v),
        }
    }
}

/// Wire encoding of an index list: each index as the zigzag-encoded
/// difference from the previous one (the first from 0) in LEB128 varint
/// bytes. Sorted indices at density 0.1% take about 2 bytes each instead of
/// 4, at 1% about 1; any order round-trips.
pub struct DeltaVarint;

/// Malformed varint index bytes.
#[derive(Debug, thiserror::Error)]
#[error("malformed delta-encoded indices at byte {0}")]
pub struct BadIndices(usize);

fn zigzag(d: i64) -> u64 {
    ((d << 1) ^ (d >> 63)) as u64
}

/// Encode `indices` as zigzag deltas in LEB128 bytes.
pub fn encode_indices(indices: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(indices.len() * 2);
    let mut prev = 0i64;
    for &i in indices {
        let mut z = zigzag(i64::from(i) - prev);
        prev = i64::from(i);
        loop {
            let byte = (z & 0x7f) as u8;
            z >>= 7;
            if z == 0 {
                out.push(byte);
                break;
            }
            out.push(byte | 0x80);
        }
    }
    out
}

/// Decode [`encode_indices`]' bytes; an index outside `u32`, a varint longer
/// than 5 bytes or a truncated one is an error.
pub fn decode_indices(bytes: &[u8]) -> Result<Vec<u32>, BadIndices> {
    let mut out = Vec::with_capacity(bytes.len() / 2 + 1);
    let mut prev = 0i64;
    let mut pos = 0;
    while pos < bytes.len() {
        let start = pos;
        let mut z = 0u64;
        let mut shift = 0;
        loop {
            let byte = *bytes.get(pos).ok_or(BadIndices(start))?;
            pos += 1;
            z |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 35 {
                return Err(BadIndices(start));
            }
        }
        let delta = (z >> 1) as i64 ^ -((z & 1) as i64);
        let index = prev + delta;
        let index = u32::try_from(index).map_err(|_| BadIndices(start))?;
        out.push(index);
        prev = i64::from(index);
    }
    Ok(out)
}

impl rkyv::with::ArchiveWith<Vec<u32>> for DeltaVarint {
    type Archived = rkyv::vec::ArchivedVec<u8>;
    /// Where the encoded bytes went, and how many there are.
    type Resolver = (rkyv::vec::VecResolver, usize);

    fn resolve_with(
        _: &Vec<u32>,
        (resolver, len): Self::Resolver,
        out: rkyv::Place<Self::Archived>,
    ) {
        rkyv::vec::ArchivedVec::<u8>::resolve_from_len(len, resolver, out);
    }
}

/// Length of [`encode_indices`]' output, without building it.
pub fn encoded_indices_len(indices: &[u32]) -> usize {
    let mut prev = 0i64;
    indices
        .iter()
        .map(|&i| {
            let z = zigzag(i64::from(i) - prev);
            prev = i64::from(i);
            (64 - z.leading_zeros() as usize).div_ceil(7).max(1)
        })
        .sum()
}

impl<S> rkyv::with::SerializeWith<Vec<u32>, S> for DeltaVarint
where
    S: rancor::Fallible + rkyv::ser::Allocator + rkyv::ser::Writer + ?Sized,
{
    fn serialize_with(field: &Vec<u32>, serializer: &mut S) -> Result<Self::Resolver, S::Error> {
        let bytes = encode_indices(field);
        let resolver = rkyv::vec::ArchivedVec::<u8>::serialize_from_slice(&bytes, serializer)?;
        Ok((resolver, bytes.len()))
    }
}

impl<D> rkyv::with::DeserializeWith<rkyv::vec::ArchivedVec<u8>, Vec<u32>, D> for DeltaVarint
where
    D: rancor::Fallible + ?Sized,
    D::Error: rancor::Source,
{
    fn deserialize_with(
        field: &rkyv::vec::ArchivedVec<u8>,
        _: &mut D,
    ) -> Result<Vec<u32>, D::Error> {
        decode_indices(field.as_slice()).map_err(<D::Error as rancor::Source>::new)
    }
}

/// A gradient for one shard, indices local to the shard.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum WireGrad {
    /// Every entry of the shard, in order.
    Dense(WireValues),
    /// Strictly ascending local indices with their values.
    Sparse {
        #[rkyv(with = DeltaVarint)]
        indices: Vec<u32>,
        values: WireValues,
    },
}

impl WireGrad {
    /// Encode a shard-local sparse gradient.
    pub fn from_sparse(grad: SparseGrad, f16: bool) -> Self {
        WireGrad::Sparse {
            indices: grad.indices,
            values: WireValues::encode(grad.values, f16),
        }
    }

    /// Entries carried.
    pub fn len(&self) -> usize {
        match self {
            WireGrad::Dense(v) => v.len(),
            WireGrad::Sparse { indices, .. } => indices.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// New parameter values for one shard after a pull.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum ParamUpdate {
    /// The whole shard.
    Dense(Vec<f32>),
    /// Only the entries that changed since the version the worker holds.
    Sparse {
        #[rkyv(with = DeltaVarint)]
        indices: Vec<u32>,
        values: Vec<f32>,
    },
    /// `compression.f16_replies`: the change of every entry of the shard
    /// from version `base` (the version before the reply's), as f16 bits, to
    /// be added to the worker's copy at `base`. The server rounds each change
    /// on write, so the sum is bit for bit the server's own copy.
    DenseDelta16 { base: u64, values: Vec<u16> },
    /// As [`ParamUpdate::DenseDelta16`], for the entries that changed only.
    SparseDelta16 {
        base: u64,
        #[rkyv(with = DeltaVarint)]
        indices: Vec<u32>,
        values: Vec<u16>,
    },
}

/// Why an update could not be applied to a copy of a shard.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("update of {got} values for a shard of {want}")]
    Length { got: usize, want: usize },
    #[error("update index {index} outside a shard of {len}")]
    Index { index: u32, len: usize },
    #[error("update has {indices} indices but {values} values")]
    Ragged { indices: usize, values: usize },
}

impl ParamUpdate {
    /// The version a delta applies to; `None` for absolute values.
    pub fn base(&self) -> Option<u64> {
        match self {
            ParamUpdate::Dense(_) | ParamUpdate::Sparse { .. } => None,
            ParamUpdate::DenseDelta16 { base, .. } | ParamUpdate::SparseDelta16 { base, .. } => {
                Some(*base)
            }
        }
    }

    /// Bytes of the update's vectors on the wire (indices as encoded).
    pub fn wire_bytes(&self) -> usize {
        match self {
            ParamUpdate::Dense(v) => 4 * v.len(),
            ParamUpdate::Sparse { indices, values } => {
                encoded_indices_len(indices) + 4 * values.len()
            }
            ParamUpdate::DenseDelta16 { values, .. } => 2 * values.len() + 8,
            ParamUpdate::SparseDelta16 {
                indices, values, ..
            } => encoded_indices_len(indices) + 2 * values.len() + 8,
        }
    }

    /// Applies the update to `copy`, a whole shard (a delta to the copy at
    /// its base). Checked whole before anything is written.
    pub fn apply_to(&self, copy: &mut [f32]) -> Result<(), ApplyError> {
        let check = |indices: &[u32], values: usize| {
            if indices.len() != values {
                return Err(ApplyError::Ragged {
                    indices: indices.len(),
                    values,
                });
            }
            match indices.iter().find(|&&i| i as usize >= copy.len()) {
                Some(&index) => Err(ApplyError::Index {
                    index,
                    len: copy.len(),
                }),
                None => Ok(()),
            }
        };
        let whole = |got: usize| {
            if got == copy.len() {
                Ok(())
            } else {
                Err(ApplyError::Length {
                    got,
                    want: copy.len(),
                })
            }
        };
        match self {
            ParamUpdate::Dense(values) => {
                whole(values.len())?;
                copy.copy_from_slice(values);
            }
            ParamUpdate::Sparse { indices, values } => {
                check(indices, values.len())?;
                for (&i, &v) in indices.iter().zip(values) {
                    copy[i as usize] = v;
                }
            }
            ParamUpdate::DenseDelta16 { values, .. } => {
                whole(values.len())?;
                for (c, &b) in copy.iter_mut().zip(values) {
                    *c += f16_to_f32(b);
                }
            }
            ParamUpdate::SparseDelta16 {
                indices, values, ..
            } => {
                check(indices, values.len())?;
                for (&i, &b) in indices.iter().zip(values) {
                    copy[i as usize] += f16_to_f32(b);
                }
            }
        }
        Ok(())
    }
}

/// A worker's request. The rank is never a field: the server takes it from
/// the connection's client certificate.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Request {
    /// First message on a connection.
    Hello {
        protocol_version: u32,
        token: String,
        /// Must equal the rank in the client certificate.
        worker_rank: u32,
        /// The worker count this worker was configured with.
        workers: u32,
        /// `cluster.workers_per_node` of the worker's config: above 1 the
        /// client is a node aggregator speaking for ranks
        /// `worker_rank .. worker_rank + workers_per_node`.
        workers_per_node: u32,
        num_params: u64,
        layout_hash: u64,
    },
    /// The worker's copy of a shard at `version`; the reply is the shard's
    /// parameters (once a starting shard has decided where it starts from).
    Offer {
        shard: u32,
        version: u64,
        /// The step this worker pushes next to this shard.
        next_step: u64,
        values: Vec<f32>,
    },
    /// The gradient of `step` for `shard`; the worker holds `have_version`.
    /// The reply is the parameters for the next step (a sparse delta from
    /// `have_version` when that is cheaper).
    Step {
        shard: u32,
        step: u64,
        have_version: Option<u64>,
        /// The worker's measured compute throughput in samples per second
        /// over its recent steps (`data.balance = "throughput"`), 0 when
        /// not measured.
        rate: f32,
        grad: WireGrad,
    },
    /// The worker leaves the barrier: `finished` when its work is done (it
    /// may not rejoin the run), not when it was told to stop (a signal: a
    /// replacement may take its rank).
    Bye { finished: bool },
    /// Liveness signal, sent periodically while the worker runs.
    Heartbeat,
    /// The worker cannot go on and the whole job must stop (a sample it
    /// cannot decode under `data.on_bad_sample = "stop"`): the servers
    /// refuse every later step and offer with [`ErrorCode::JobStopped`],
    /// naming the rank and `reason`, so every rank ends with the message.
    Abort { reason: String },
    /// Global-norm clipping across shards (`optimizer.clip_grad_norm` with
    /// several shards): the squared L2 norm of the whole mean gradient of
    /// `step`, the sum of every shard's [`Response::NormShare`]. The shard
    /// applies its update of `step` scaled by `min(1, c / (norm + 1e-6))`
    /// on the first total it gets; the reply is the parameters, as a
    /// `Step`'s would be. `None`: this worker cannot sum the shares (a shard
    /// applied the step without it); the reply waits for another worker's
    /// total.
    NormTotal {
        shard: u32,
        step: u64,
        have_version: Option<u64>,
        total_sum_sq: Option<f64>,
    },
    /// Backup workers (`server.backup_workers`): this worker's sample
    /// stream is done; `skipped` are the steps of its plan whose batch was
    /// never applied (steps the cluster made without it, and a push
    /// refused as fenced), ascending, and `trained` the batches it trained.
    /// The reply ([`Response::MakeUp`]) comes once every live rank asked,
    /// and from then on the shard's steps wait for every live rank.
    MakeUp {
        shard: u32,
        skipped: Vec<u64>,
        trained: u64,
    },
    /// The run is done for every rank: this one reached the run's target
    /// (`training.target_accuracy` or `target_loss`), which ends the job.
    /// The servers answer every later step and offer, from any rank, with
    /// [`ErrorCode::JobDone`] naming this rank and `reason`, and those
    /// ranks stop cleanly; the reply is [`Response::ByeAck`]. A rank whose
    /// own evaluation differs (batch norm calibrated on its own batches)
    /// thus stops at the same step instead of training on alone.
    Finish { reason: String },
}

/// A batch of one rank's plan that was never applied: made up after the
/// last regular step ([`Request::MakeUp`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct WireOrphan {
    pub step: u64,
    pub rank: u32,
}

/// A split of the global batch across the ranks from global step `from`
/// on: rank `r` takes `sizes[r]` samples ([`ps_shared::sampler::Split`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct WireSplit {
    pub from: u64,
    pub sizes: Vec<u64>,
}

/// One contiguous shard a server owns.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardRange {
    pub shard: u32,
    pub lo: u64,
    pub hi: u64,
}

/// A server's Unix socket and the key that admits one connection's
/// requests through it, handed out in that connection's Welcome.
#[derive(Archive, Serialize, Deserialize, Clone, PartialEq, Eq)]
pub struct LocalPath {
    pub path: String,
    pub key: [u8; crate::local::KEY_BYTES],
}

impl std::fmt::Debug for LocalPath {
    // The key is a credential: never logged.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalPath")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Kinds of refusal, so clients can react without parsing text.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    Unauthorized,
    VersionMismatch,
    LayoutMismatch,
    BadFrame,
    UnknownShard,
    UnknownWorker,
    OutOfRange,
    WrongLength,
    NonFinite,
    WrongStep,
    NotInitialized,
    ShuttingDown,
    RateLimited,
    Internal,
    /// A parked reply waited past its deadline.
    Timeout,
    /// Too many requests waiting on one shard from one connection.
    TooManyPending,
    /// A push whose norm exceeds `server.max_grad_norm` (refuse policy).
    GradientTooLarge,
    /// Another live connection already speaks for this rank.
    RankInUse,
    /// The worker's `cluster.workers` differs from the server's.
    WorkerCountMismatch,
    /// A push for a step the shard applied without this worker (it was
    /// declared dead for that step): offer your copy and go on at the step
    /// the reply names.
    Fenced,
    /// The rank already said goodbye (finished) in this run.
    RankFinished,
    /// A rank stopped the job (`Request::Abort`); the message says which
    /// and why.
    JobStopped,
    /// A rank reached the run's target (`Request::Finish`): the job is
    /// done, and the rank told this stops cleanly.
    JobDone,
}

/// A server's response.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Response {
    Welcome {
        server_index: u32,
        shards: Vec<ShardRange>,
        workers: u32,
        /// Where the sample stream stands: global step `data_step` starts
        /// after `data_samples` samples of the run's stream, and every step
        /// from there consumes `workers × data_batch` samples.
        data_step: u64,
        data_samples: u64,
        data_batch: u64,
        /// The same-host path the server offers a worker on its own host
        /// (see [`crate::local`]); `None` for every other worker.
        local: Option<LocalPath>,
    },
    Params {
        shard: u32,
        version: u64,
        /// The step this worker pushes next to this shard.
        next_step: u64,
        /// Workers connected to this shard's barrier when the reply left.
        live_workers: u32,
        update: ParamUpdate,
        /// `data.balance = "throughput"`, shard 0 only: the latest splits
        /// of the global batch it decided (at most two, ascending by
        /// `from`; the earlier one is in effect at the reply's version).
        /// Empty: no split decided (equal sizes).
        splits: Vec<WireSplit>,
    },
    ByeAck,
    HeartbeatAck,
    Error {
        code: ErrorCode,
        message: String,
    },
    /// Global-norm clipping across shards: the answer to a `Step` once the
    /// barrier of `step` is complete, before the update. `sum_sq` is the
    /// squared L2 norm of this shard's part of the step's mean gradient;
    /// the worker sums the shares of every shard and sends the total back
    /// ([`Request::NormTotal`]). `total_sum_sq` is set when the shard
    /// already applied the step (a retry): the total it applied.
    NormShare {
        shard: u32,
        step: u64,
        sum_sq: f64,
        total_sum_sq: Option<f64>,
    },
    /// The answer to [`Request::MakeUp`] once every live rank asked: every
    /// rank's batches never applied, ascending by step then rank, the
    /// batches each rank trained (by rank; 0 for a rank that did not ask),
    /// and the step this shard expects next.
    MakeUp {
        shard: u32,
        next_step: u64,
        orphans: Vec<WireOrphan>,
        trained: Vec<u64>,
    },
}

impl Response {
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Response::Error {
            code,
            message: message.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("frame of {size} bytes exceeds the limit of {limit} bytes")]
    FrameTooLarge { size: usize, limit: usize },
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("cannot encode message: {0}")]
    Encode(String),
}

/// Bytes of messages copied by one side of an exchange, by stage, so that
/// the cost of the data path is counted, not guessed: `encoded`, the
/// archives written (each vector copied once, straight from the caller's
/// buffer, once per step and shard however many times the frame is sent);
/// `read`, the payloads copied from the transport into the aligned buffers
/// they are validated in; `decoded`, the vectors copied out of the
/// archives into the messages handed on (values and indices).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copied {
    pub encoded: u64,
    pub read: u64,
    pub decoded: u64,
}

impl Copied {
    /// Every byte copied.
    pub fn total(&self) -> u64 {
        self.encoded + self.read + self.decoded
    }

    pub fn add(&mut self, other: Copied) {
        self.encoded += other.encoded;
        self.read += other.read;
        self.decoded += other.decoded;
    }
}

/// An encoded message: the length prefix and the rkyv archive, the archive
/// in its own 16-byte aligned buffer shared by reference count. The archive
/// is written once, straight from the message's values; sending it again (a
/// retry, or one reply to several workers) shares the same bytes.
#[derive(Clone, Debug)]
pub struct EncodedFrame {
    header: [u8; FRAME_HEADER_BYTES],
    payload: bytes::Bytes,
}

impl EncodedFrame {
    /// The length prefix.
    pub fn header(&self) -> [u8; FRAME_HEADER_BYTES] {
        self.header
    }

    /// The archive (the bytes after the length prefix).
    pub fn payload(&self) -> &bytes::Bytes {
        &self.payload
    }

    /// Bytes of the whole frame on the wire.
    pub fn len(&self) -> usize {
        FRAME_HEADER_BYTES + self.payload.len()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The whole frame in one new buffer (a copy: for tests and tools).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut frame = Vec::with_capacity(self.len());
        frame.extend_from_slice(&self.header);
        frame.extend_from_slice(&self.payload);
        frame
    }
}

/// Bytes the archive of a message takes besides its vectors' contents
/// (fields, enum tags, the root, alignment padding); with the vectors'
/// bytes it sizes the encoding buffer so that it is never grown (a grown
/// buffer is one more copy of everything written so far).
const ARCHIVE_OVERHEAD: usize = 256;

pub(crate) fn encode_with<T>(msg: &T, vectors: usize) -> Result<EncodedFrame, ProtocolError>
where
    T: for<'a> Serialize<
        rkyv::api::high::HighSerializer<
            AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rancor::Error,
        >,
    >,
{
    let buf = AlignedVec::with_capacity(vectors + ARCHIVE_OVERHEAD);
    let payload = rkyv::api::high::to_bytes_in::<_, rancor::Error>(msg, buf)
        .map_err(|e| ProtocolError::Encode(e.to_string()))?;
    let len = u32::try_from(payload.len()).map_err(|_| {
        ProtocolError::Encode(format!("{} bytes do not fit a frame", payload.len()))
    })?;
    Ok(EncodedFrame {
        header: len.to_le_bytes(),
        payload: bytes::Bytes::from_owner(payload),
    })
}

fn values_bytes(v: &WireValues) -> usize {
    match v {
        WireValues::F32(v) => 4 * v.len(),
        WireValues::F16(v) => 2 * v.len(),
    }
}

fn grad_bytes(g: &WireGrad) -> usize {
    match g {
        WireGrad::Dense(v) => values_bytes(v),
        WireGrad::Sparse { indices, values } => encoded_indices_len(indices) + values_bytes(values),
    }
}

/// Bytes of the vectors (values and encoded indices) a request carries:
/// what encoding or decoding it copies, besides a few hundred bytes of
/// fields.
pub fn request_vector_bytes(req: &Request) -> usize {
    match req {
        Request::Hello { token, .. } => token.len(),
        Request::Offer { values, .. } => 4 * values.len(),
        Request::Step { grad, .. } => grad_bytes(grad),
        Request::Abort { reason } | Request::Finish { reason } => reason.len(),
        Request::MakeUp { skipped, .. } => 8 * skipped.len(),
        Request::Bye { .. } | Request::Heartbeat | Request::NormTotal { .. } => 0,
    }
}

/// Bytes of the vectors a response carries (see [`request_vector_bytes`]).
pub fn response_vector_bytes(resp: &Response) -> usize {
    match resp {
        Response::Welcome { shards, local, .. } => {
            24 * shards.len()
                + local
                    .as_ref()
                    .map_or(0, |l| l.path.len() + crate::local::KEY_BYTES)
        }
        Response::Params { update, .. } => update.wire_bytes(),
        Response::Error { message, .. } => message.len(),
        Response::MakeUp {
            orphans, trained, ..
        } => 16 * orphans.len() + 8 * trained.len(),
        Response::ByeAck | Response::HeartbeatAck | Response::NormShare { .. } => 0,
    }
}

/// Values borrowed from the caller, archived exactly as [`WireValues`].
#[derive(Archive, Serialize)]
enum ValuesRef<'a> {
    F32(#[rkyv(with = SliceAsVec)] &'a [f32]),
    F16(#[rkyv(with = SliceAsVec)] &'a [u16]),
}

/// A gradient borrowed from the caller, archived exactly as [`WireGrad`].
#[derive(Archive, Serialize)]
enum GradRef<'a> {
    Dense(ValuesRef<'a>),
    Sparse {
        #[rkyv(with = DeltaVarintRef)]
        indices: &'a [u32],
        values: ValuesRef<'a>,
    },
}

/// [`Request`] with its vectors borrowed: archived to the same bytes (the
/// variants, their order and their fields' archived types are the same;
/// a test compares the encodings), so a push or an offer is encoded
/// straight from the caller's buffers without building an owned message.
/// Only `Offer` and `Step` are ever built; the other variants hold the
/// layout.
#[derive(Archive, Serialize)]
#[allow(dead_code)]
enum RequestRef<'a> {
    Hello {
        protocol_version: u32,
        token: String,
        worker_rank: u32,
        workers: u32,
        workers_per_node: u32,
        num_params: u64,
        layout_hash: u64,
    },
    Offer {
        shard: u32,
        version: u64,
        next_step: u64,
        #[rkyv(with = SliceAsVec)]
        values: &'a [f32],
    },
    Step {
        shard: u32,
        step: u64,
        have_version: Option<u64>,
        rate: f32,
        grad: GradRef<'a>,
    },
    Bye {
        finished: bool,
    },
    Heartbeat,
    Abort {
        reason: String,
    },
    NormTotal {
        shard: u32,
        step: u64,
        have_version: Option<u64>,
        total_sum_sq: Option<f64>,
    },
}

/// Archives a borrowed slice as an `ArchivedVec`, like an owned `Vec`.
pub struct SliceAsVec;

impl<'a, T: Archive> rkyv::with::ArchiveWith<&'a [T]> for SliceAsVec {
    type Archived = rkyv::vec::ArchivedVec<T::Archived>;
    type Resolver = rkyv::vec::VecResolver;

    fn resolve_with(field: &&'a [T], resolver: Self::Resolver, out: rkyv::Place<Self::Archived>) {
        rkyv::vec::ArchivedVec::resolve_from_len(field.len(), resolver, out);
    }
}

impl<'a, T, S> rkyv::with::SerializeWith<&'a [T], S> for SliceAsVec
where
    T: Serialize<S>,
    S: rancor::Fallible + rkyv::ser::Allocator + rkyv::ser::Writer + ?Sized,
{
    fn serialize_with(field: &&'a [T], serializer: &mut S) -> Result<Self::Resolver, S::Error> {
        rkyv::vec::ArchivedVec::<T::Archived>::serialize_from_slice(field, serializer)
    }
}

/// [`DeltaVarint`] for a borrowed index slice.
pub struct DeltaVarintRef;

impl<'a> rkyv::with::ArchiveWith<&'a [u32]> for DeltaVarintRef {
    type Archived = rkyv::vec::ArchivedVec<u8>;
    type Resolver = (rkyv::vec::VecResolver, usize);

    fn resolve_with(
        _: &&'a [u32],
        (resolver, len): Self::Resolver,
        out: rkyv::Place<Self::Archived>,
    ) {
        rkyv::vec::ArchivedVec::<u8>::resolve_from_len(len, resolver, out);
    }
}

impl<'a, S> rkyv::with::SerializeWith<&'a [u32], S> for DeltaVarintRef
where
    S: rancor::Fallible + rkyv::ser::Allocator + rkyv::ser::Writer + ?Sized,
{
    fn serialize_with(field: &&'a [u32], serializer: &mut S) -> Result<Self::Resolver, S::Error> {
        let bytes = encode_indices(field);
        let resolver = rkyv::vec::ArchivedVec::<u8>::serialize_from_slice(&bytes, serializer)?;
        Ok((resolver, bytes.len()))
    }
}

/// Values of a push, borrowed.
#[derive(Debug, Clone, Copy)]
pub enum ValuesView<'a> {
    F32(&'a [f32]),
    /// f16 bits.
    F16(&'a [u16]),
}

impl<'a> ValuesView<'a> {
    fn as_ref(self) -> ValuesRef<'a> {
        match self {
            ValuesView::F32(v) => ValuesRef::F32(v),
            ValuesView::F16(v) => ValuesRef::F16(v),
        }
    }

    fn bytes(self) -> usize {
        match self {
            ValuesView::F32(v) => 4 * v.len(),
            ValuesView::F16(v) => 2 * v.len(),
        }
    }
}

impl<'a> From<&'a WireValues> for ValuesView<'a> {
    fn from(v: &'a WireValues) -> Self {
        match v {
            WireValues::F32(v) => ValuesView::F32(v),
            WireValues::F16(v) => ValuesView::F16(v),
        }
    }
}

/// A shard's gradient, borrowed: the same archive as [`WireGrad`].
#[derive(Debug, Clone, Copy)]
pub enum GradView<'a> {
    Dense(ValuesView<'a>),
    Sparse {
        indices: &'a [u32],
        values: ValuesView<'a>,
    },
}

impl<'a> From<&'a WireGrad> for GradView<'a> {
    fn from(g: &'a WireGrad) -> Self {
        match g {
            WireGrad::Dense(v) => GradView::Dense(v.into()),
            WireGrad::Sparse { indices, values } => GradView::Sparse {
                indices,
                values: values.into(),
            },
        }
    }
}

/// The frame of `Request::Step` whose gradient is borrowed from the
/// caller (a slice of the whole model's gradient, say): its values are
/// copied once, into the archive.
pub fn encode_step(
    shard: u32,
    step: u64,
    have_version: Option<u64>,
    rate: f32,
    grad: GradView<'_>,
) -> Result<EncodedFrame, ProtocolError> {
    let (grad, vectors) = match grad {
        GradView::Dense(v) => (GradRef::Dense(v.as_ref()), v.bytes()),
        GradView::Sparse { indices, values } => (
            GradRef::Sparse {
                indices,
                values: values.as_ref(),
            },
            encoded_indices_len(indices) + values.bytes(),
        ),
    };
    let req = RequestRef::Step {
        shard,
        step,
        have_version,
        rate,
        grad,
    };
    encode_with(&req, vectors)
}

/// The frame of `Request::Offer` with the values borrowed from the caller.
pub fn encode_offer(
    shard: u32,
    version: u64,
    next_step: u64,
    values: &[f32],
) -> Result<EncodedFrame, ProtocolError> {
    let req = RequestRef::Offer {
        shard,
        version,
        next_step,
        values,
    };
    encode_with(&req, 4 * values.len())
}

/// The frame of a request.
pub fn encode_request_frame(req: &Request) -> Result<EncodedFrame, ProtocolError> {
    encode_with(req, request_vector_bytes(req))
}

/// The frame of a response.
pub fn encode_response_frame(resp: &Response) -> Result<EncodedFrame, ProtocolError> {
    encode_with(resp, response_vector_bytes(resp))
}

/// A whole frame (length prefix + archive) for a request, in one buffer.
pub fn encode_request(req: &Request) -> Result<Vec<u8>, ProtocolError> {
    encode_request_frame(req).map(|f| f.to_vec())
}

/// A whole frame (length prefix + archive) for a response, in one buffer.
pub fn encode_response(resp: &Response) -> Result<Vec<u8>, ProtocolError> {
    encode_response_frame(resp).map(|f| f.to_vec())
}

/// Alignment rkyv's validation needs (that of [`AlignedVec`]).
const ARCHIVE_ALIGN: usize = 16;

/// Validate and decode an archive. Bytes already on a 16-byte boundary (a
/// buffer [`crate::transport::read_frame`] filled, any [`AlignedVec`]) are
/// validated in place; others are first copied into an aligned buffer.
pub(crate) fn decode<T>(payload: &[u8]) -> Result<T, ProtocolError>
where
    T: Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rancor::Error>>,
{
    let copied;
    let bytes = if (payload.as_ptr() as usize).is_multiple_of(ARCHIVE_ALIGN) {
        payload
    } else {
        copied = aligned(payload);
        &copied[..]
    };
    rkyv::from_bytes::<T, rancor::Error>(bytes).map_err(|e| ProtocolError::Malformed(e.to_string()))
}

/// Copy into a 16-byte aligned buffer: rkyv validation needs aligned input.
fn aligned(payload: &[u8]) -> AlignedVec {
    let mut buf = AlignedVec::with_capacity(payload.len());
    buf.extend_from_slice(payload);
    buf
}

/// Validate and decode a request payload (the bytes after the length
/// prefix). The archive is checked where it lies when it is aligned (see
/// [`crate::transport::read_frame`]); decoding copies each vector once,
/// into the message's own.
pub fn decode_request(payload: &[u8]) -> Result<Request, ProtocolError> {
    decode(payload)
}

/// Validate and decode a response payload (the bytes after the length
/// prefix); see [`decode_request`].
pub fn decode_response(payload: &[u8]) -> Result<Response, ProtocolError> {
    decode(payload)
}

/// Parse the length prefix and check it against `limit`.
pub fn frame_len(header: [u8; FRAME_HEADER_BYTES], limit: usize) -> Result<usize, ProtocolError> {
    let size = u32::from_le_bytes(header) as usize;
    if size > limit {
        return Err(ProtocolError::FrameTooLarge { size, limit });
    }
    Ok(size)
}

/// Encoded size of a request frame (for byte accounting).
pub fn request_wire_bytes(req: &Request) -> usize {
    encode_request_frame(req).map(|f| f.len()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_shared::sparse::f32_to_f16;

    fn round_trip_req(req: Request) {
        let frame = encode_request(&req).unwrap();
        let len = frame_len(frame[..4].try_into().unwrap(), 1 << 20).unwrap();
        assert_eq!(len, frame.len() - 4);
        assert_eq!(decode_request(&frame[4..]).unwrap(), req);
    }

    #[test]
    fn requests_round_trip() {
        round_trip_req(Request::Hello {
            protocol_version: PROTOCOL_VERSION,
            token: "secret-token".into(),
            worker_rank: 1,
            workers: 2,
            workers_per_node: 1,
            num_params: 1234,
            layout_hash: 99,
        });
        round_trip_req(Request::Offer {
            shard: 0,
            version: 3,
            next_step: 3,
            values: vec![1.0, -2.0, 3.5],
        });
        round_trip_req(Request::Step {
            shard: 1,
            step: 7,
            have_version: Some(7),
            rate: 0.0,
            grad: WireGrad::Sparse {
                indices: vec![0, 5, 9],
                values: WireValues::F32(vec![0.5, -0.25, 1.0]),
            },
        });
        round_trip_req(Request::Step {
            shard: 1,
            step: 7,
            have_version: None,
            rate: 0.0,
            grad: WireGrad::Dense(WireValues::F16(vec![0x3c00, 0xbc00])),
        });
        round_trip_req(Request::Bye { finished: true });
        round_trip_req(Request::Heartbeat);
        round_trip_req(Request::Finish {
            reason: "training.target_accuracy = 0.97 reached".into(),
        });
        round_trip_req(Request::NormTotal {
            shard: 3,
            step: 12,
            have_version: Some(12),
            total_sum_sq: Some(2.5),
        });
        round_trip_req(Request::NormTotal {
            shard: 0,
            step: 0,
            have_version: None,
            total_sum_sq: None,
        });
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Arbitrary bytes never panic the decoders.
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = decode_request(&bytes);
            let _ = decode_response(&bytes);
        }

        /// Valid frames with bytes flipped either decode to some message or
        /// are refused; never a panic.
        #[test]
        fn mutated_frames_never_panic(
            values in proptest::collection::vec(-1e3f32..1e3, 0..64),
            flips in proptest::collection::vec((proptest::prelude::any::<usize>(), proptest::prelude::any::<u8>()), 1..8),
        ) {
            let req = Request::Step {
                shard: 1,
                step: 9,
                have_version: Some(9),
                rate: 0.0, grad: WireGrad::Sparse {
                    indices: (0..values.len() as u32).collect(),
                    values: WireValues::F32(values),
                },
            };
            let mut payload = encode_request(&req).unwrap()[4..].to_vec();
            for (at, x) in flips {
                let n = payload.len();
                payload[at % n] ^= x;
            }
            let _ = decode_request(&payload);
        }
    }

    /// The norm exchange of global-norm clipping adds small fixed-size
    /// frames, whatever the shard's size.
    #[test]
    fn norm_exchange_frames_are_small() {
        let total = encode_request(&Request::NormTotal {
            shard: 3,
            step: 12,
            have_version: Some(12),
            total_sum_sq: Some(2.5),
        })
        .unwrap();
        let share = encode_response(&Response::NormShare {
            shard: 3,
            step: 12,
            sum_sq: 0.5,
            total_sum_sq: Some(2.5),
        })
        .unwrap();
        println!(
            "NormTotal frame {} bytes, NormShare frame {} bytes",
            total.len(),
            share.len()
        );
        assert!(total.len() <= 128 && share.len() <= 128);
    }

    #[test]
    fn responses_round_trip() {
        for resp in [
            Response::Welcome {
                server_index: 0,
                shards: vec![ShardRange {
                    shard: 0,
                    lo: 0,
                    hi: 10,
                }],
                workers: 2,
                data_step: 7,
                data_samples: 900,
                data_batch: 32,
                local: Some(LocalPath {
                    path: "/tmp/stratus-ps-0-ab/ps.sock".into(),
                    key: [7; 16],
                }),
            },
            Response::Params {
                shard: 0,
                version: 3,
                next_step: 3,
                live_workers: 2,
                splits: Vec::new(),
                update: ParamUpdate::Sparse {
                    indices: vec![1, 2],
                    values: vec![0.1, 0.2],
                },
            },
            Response::Params {
                shard: 0,
                version: 3,
                next_step: 2,
                live_workers: 1,
                splits: Vec::new(),
                update: ParamUpdate::Dense(vec![0.0; 17]),
            },
            Response::Params {
                shard: 1,
                version: 4,
                next_step: 4,
                live_workers: 2,
                splits: Vec::new(),
                update: ParamUpdate::DenseDelta16 {
                    base: 3,
                    values: vec![0x3c00, 0xbc00, 0],
                },
            },
            Response::Params {
                shard: 1,
                version: 4,
                next_step: 4,
                live_workers: 2,
                splits: Vec::new(),
                update: ParamUpdate::SparseDelta16 {
                    base: 3,
                    indices: vec![0, 7, 300],
                    values: vec![0x3c00, 0xbc00, 0x3800],
                },
            },
            Response::HeartbeatAck,
            Response::NormShare {
                shard: 1,
                step: 4,
                sum_sq: 0.125,
                total_sum_sq: None,
            },
            Response::NormShare {
                shard: 0,
                step: 9,
                sum_sq: 1e-30,
                total_sum_sq: Some(7.0),
            },
            Response::error(ErrorCode::WrongStep, "push for step 3, shard is at step 4"),
            Response::ByeAck,
        ] {
            let frame = encode_response(&resp).unwrap();
            assert_eq!(decode_response(&frame[4..]).unwrap(), resp);
        }
    }

    #[test]
    fn malformed_frames_are_rejected() {
        let frame = encode_request(&Request::Offer {
            shard: 0,
            version: 0,
            next_step: 0,
            values: vec![1.0; 64],
        })
        .unwrap();
        let payload = &frame[4..];
        // Truncated archives.
        for cut in [0, 1, 7, payload.len() / 2, payload.len() - 1] {
            assert!(decode_request(&payload[..cut]).is_err(), "cut at {cut}");
        }
        // A response is not a request (and vice versa) unless bytes happen to agree;
        // garbage must never panic.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for len in 0..300 {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = decode_request(&junk);
            let _ = decode_response(&junk);
        }
        // Corrupting the vector length to point outside the buffer is caught.
        // (the archived length 64 is the only [64, 0, 0, 0] in the buffer:
        // every value is 1.0 = [0, 0, 128, 63]).
        let mut bad = payload.to_vec();
        let at = bad
            .windows(4)
            .rposition(|w| w == [64, 0, 0, 0])
            .expect("archived vector length");
        bad[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_request(&bad).is_err());
    }

    /// The borrowed encodings give the very bytes of the owned messages,
    /// so either side may use either.
    #[test]
    fn borrowed_encodings_match_the_owned_ones() {
        let values: Vec<f32> = (0..1001).map(|i| i as f32 * 0.25 - 7.0).collect();
        let bits: Vec<u16> = (0..333).map(|i| i * 7).collect();
        let indices: Vec<u32> = (0..333).map(|i| i * 31 + 2).collect();
        let grads = [
            WireGrad::Dense(WireValues::F32(values.clone())),
            WireGrad::Dense(WireValues::F16(bits.clone())),
            WireGrad::Sparse {
                indices: indices.clone(),
                values: WireValues::F32(values[..333].to_vec()),
            },
            WireGrad::Sparse {
                indices: indices.clone(),
                values: WireValues::F16(bits.clone()),
            },
            WireGrad::Dense(WireValues::F32(Vec::new())),
        ];
        for (i, grad) in grads.into_iter().enumerate() {
            for have_version in [None, Some(41)] {
                let borrowed = encode_step(3, 42, have_version, 12.5, (&grad).into()).unwrap();
                let owned = encode_request(&Request::Step {
                    shard: 3,
                    step: 42,
                    have_version,
                    rate: 12.5,
                    grad: grad.clone(),
                })
                .unwrap();
                assert_eq!(borrowed.to_vec(), owned, "gradient {i}");
                assert_eq!(borrowed.len(), owned.len());
            }
        }
        let offer = encode_offer(1, 5, 6, &values).unwrap();
        let owned = encode_request(&Request::Offer {
            shard: 1,
            version: 5,
            next_step: 6,
            values: values.clone(),
        })
        .unwrap();
        assert_eq!(offer.to_vec(), owned);
    }

    /// Encoding writes the archive once into a buffer of the right size:
    /// the archive is a few hundred bytes more than the values at most,
    /// and aligned payloads are validated where they lie.
    #[test]
    fn frames_are_sized_up_front_and_aligned_payloads_decode_in_place() {
        let values = vec![0.5f32; 300_000];
        let frame = encode_step(
            0,
            1,
            Some(1),
            0.0,
            GradView::Dense(ValuesView::F32(&values)),
        )
        .unwrap();
        assert!(frame.payload().len() >= 4 * values.len());
        assert!(frame.payload().len() <= 4 * values.len() + ARCHIVE_OVERHEAD);
        let payload = aligned(frame.payload());
        assert!((payload.as_ptr() as usize).is_multiple_of(ARCHIVE_ALIGN));
        let Request::Step { grad, .. } = decode_request(&payload).unwrap() else {
            panic!("not a step");
        };
        assert_eq!(grad, WireGrad::Dense(WireValues::F32(values)));
        // Unaligned bytes still decode (through a copy).
        let mut shifted = aligned(&[0]);
        shifted.extend_from_slice(&payload);
        assert!(decode_request(&shifted[1..]).is_ok());
    }

    #[test]
    fn oversized_frames_are_rejected() {
        assert!(matches!(
            frame_len(1000u32.to_le_bytes(), 999),
            Err(ProtocolError::FrameTooLarge {
                size: 1000,
                limit: 999
            })
        ));
    }

    #[test]
    fn delta_varint_indices_round_trip_in_any_order() {
        for indices in [
            vec![],
            vec![0],
            vec![u32::MAX],
            vec![3, 1000, 1001, 70_000, u32::MAX],
            vec![9, 2, 2, 500_000, 0],
        ] {
            let bytes = encode_indices(&indices);
            assert_eq!(bytes.len(), encoded_indices_len(&indices), "{indices:?}");
            assert_eq!(decode_indices(&bytes).unwrap(), indices);
        }
        // Ascending gaps of about 1000 (density 0.1%) take 2 bytes an index.
        let sorted: Vec<u32> = (0..1000).map(|i| i * 997).collect();
        assert_eq!(encode_indices(&sorted).len(), 2 * 1000 - 1);
    }

    #[test]
    fn malformed_index_bytes_are_errors() {
        assert!(decode_indices(&[0x80]).is_err(), "truncated");
        assert!(decode_indices(&[0xff; 6]).is_err(), "too long");
        // -1 from 0: zigzag 1.
        assert!(decode_indices(&[1]).is_err(), "negative index");
        let resp = Response::Params {
            shard: 0,
            version: 1,
            next_step: 1,
            live_workers: 1,
            splits: Vec::new(),
            update: ParamUpdate::Sparse {
                indices: vec![5, 6],
                values: vec![1.0, 2.0],
            },
        };
        let frame = encode_response(&resp).unwrap();
        assert_eq!(decode_response(&frame[4..]).unwrap(), resp);
    }

    #[test]
    fn updates_apply_to_a_copy_and_bad_ones_change_nothing() {
        let one = f32_to_f16(1.0);
        let half_bits = f32_to_f16(-0.5);
        let mut copy = vec![1.0f32, 2.0, 3.0];
        ParamUpdate::DenseDelta16 {
            base: 0,
            values: vec![one, half_bits, 0],
        }
        .apply_to(&mut copy)
        .unwrap();
        assert_eq!(copy, [2.0, 1.5, 3.0]);
        ParamUpdate::SparseDelta16 {
            base: 1,
            indices: vec![2],
            values: vec![one],
        }
        .apply_to(&mut copy)
        .unwrap();
        assert_eq!(copy, [2.0, 1.5, 4.0]);
        ParamUpdate::Sparse {
            indices: vec![0],
            values: vec![9.0],
        }
        .apply_to(&mut copy)
        .unwrap();
        assert_eq!(copy, [9.0, 1.5, 4.0]);
        for (bad, err) in [
            (
                ParamUpdate::DenseDelta16 {
                    base: 0,
                    values: vec![one; 2],
                },
                ApplyError::Length { got: 2, want: 3 },
            ),
            (
                ParamUpdate::SparseDelta16 {
                    base: 0,
                    indices: vec![0, 3],
                    values: vec![one; 2],
                },
                ApplyError::Index { index: 3, len: 3 },
            ),
            (
                ParamUpdate::Sparse {
                    indices: vec![0, 1],
                    values: vec![1.0],
                },
                ApplyError::Ragged {
                    indices: 2,
                    values: 1,
                },
            ),
        ] {
            assert_eq!(bad.apply_to(&mut copy), Err(err));
            assert_eq!(copy, [9.0, 1.5, 4.0]);
        }
        assert_eq!(
            ParamUpdate::DenseDelta16 {
                base: 0,
                values: vec![0; 1000]
            }
            .wire_bytes()
                * 2
                - 16,
            ParamUpdate::Dense(vec![0.0; 1000]).wire_bytes()
        );
    }

    #[test]
    fn sparse_frames_carry_about_six_bytes_an_entry() {
        let indices: Vec<u32> = (0..2000).map(|i| i * 661).collect();
        let values = vec![0.5f32; indices.len()];
        let resp = Response::Params {
            shard: 1,
            version: 1,
            next_step: 1,
            live_workers: 2,
            splits: Vec::new(),
            update: ParamUpdate::Sparse { indices, values },
        };
        let frame = encode_response(&resp).unwrap();
        let per_entry = frame.len() as f64 / 2000.0;
        assert!(per_entry < 6.2, "{per_entry} bytes an entry");
    }
}
