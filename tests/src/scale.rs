//! The in-process cluster behind `bench-scale`: shard actors with trivial
//! workers that push synthetic gradients, so what is measured is the server's
//! cost and the traffic, not a model.
//!
//! Each server process is one [`ShardActor`] on its own arbiter (thread), as
//! `ps_server::net::start` runs them. Its I/O side is replaced by a function
//! that does what the connection task does with a frame: it counts the bytes,
//! decodes the request, hands it to the shard, waits for the reply and encodes
//! it. Workers are tasks on the system thread. Each step, every worker encodes
//! one `Step` request per server and waits for the replies (BSP), then decodes
//! them and checks that they carry the next version.
//!
//! Workers hold no copy of the model, so memory stays bounded whatever the
//! worker count:
//!
//! * top-k: a worker generates its `k` shard-local indices directly, one in
//!   each of `k` equal strides at an offset drawn from its own generator, with
//!   small values; no dense buffer exists;
//! * dense: one immutable synthetic gradient per shard is shared by every
//!   worker through an `Arc`; a push copies it only into its own frame.
//!
//! The shards start from zeros offered by rank 0 alone (a zero recovery
//! window), so no worker but one ever sends a full copy.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use anyhow::{anyhow, bail, Context as _};
use serde::Serialize;
use tokio::sync::watch;

use ps_net::protocol::{
    decode_request, decode_response, encode_request, EncodedFrame, ParamUpdate, Request, Response,
    WireGrad, WireValues, FRAME_HEADER_BYTES,
};
use ps_server::actor::{
    Deliver, GetCounters, MemberNews, ShardActor, ShardCounters, ShardRequest, Shutdown,
};
use ps_server::core::{CoreSettings, ShardCore, ShardSetup};
use ps_shared::config::{OptimizerSection, SyncMode};
use ps_shared::shard::ShardMap;

/// Bytes per entry of the changed-index history a shard keeps per version.
const HISTORY_VERSIONS: f64 = 64.0;

/// One point of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ScaleCase {
    pub params: usize,
    /// Share of each shard a worker pushes; `None` = dense.
    pub density: Option<f64>,
    pub servers: usize,
    pub workers: usize,
    /// Measured steps (one warm-up step runs before them).
    pub steps: u64,
    /// The servers apply a global top-k of each sparse update
    /// (`compression.global_topk`), so replies carry at most k entries.
    pub global_topk: bool,
}

impl ScaleCase {
    /// Entries one worker pushes to a shard of `len` per step.
    pub fn k_for(&self, len: usize) -> usize {
        match self.density {
            None => len,
            Some(d) => ((len as f64 * d).round() as usize).clamp(1, len),
        }
    }

    /// Distinct entries the pushes of one step touch, in expectation (the
    /// strides are independent across workers).
    pub fn expected_union(&self) -> f64 {
        match self.density {
            None => self.params as f64,
            Some(d) => self.params as f64 * (1.0 - (1.0 - d).powi(self.workers as i32)),
        }
    }

    /// Entries of one worker's reply from all shards together, in
    /// expectation: the union of the pushes, or k with global top-k.
    pub fn expected_reply(&self) -> f64 {
        match self.density {
            Some(d) if self.global_topk => self.params as f64 * d,
            _ => self.expected_union(),
        }
    }

    /// Peak bytes this case needs, estimated from the buffers it allocates:
    /// the servers' parameter, optimizer (dense runs use momentum),
    /// aggregation and history buffers, every worker's push waiting in a
    /// mailbox, every worker's reply built at once, and one frame of each.
    pub fn estimated_bytes(&self) -> f64 {
        let p = self.params as f64;
        let w = self.workers as f64;
        let u = self.expected_reply();
        match self.density {
            None => {
                let server = p * (4.0 + 4.0 + 4.0 + 1.0);
                // Pushes queued, replies built, and the frames of one request
                // in flight per worker (encoded, then decoded).
                server + w * 4.0 * p + w * 4.0 * p + 2.0 * 4.0 * p
            }
            Some(_) => {
                let k = p * self.density.unwrap_or(1.0);
                let history = HISTORY_VERSIONS.min((p / (u * 2.0)).max(1.0)) * u * 4.0;
                // With global top-k: the residual and its index list.
                let residual = if self.global_topk {
                    p * 4.0 + self.expected_union() * 4.0
                } else {
                    0.0
                };
                let server = p * (4.0 + 4.0 + 1.0) + u * 4.0 + history + residual;
                server + w * k * 8.0 * 2.0 + w * u * 8.0 * 2.0
            }
        }
    }

    /// Entries moved per run (pushed and replied, over every step): the
    /// estimate the time budget is checked against.
    pub fn estimated_entries(&self) -> f64 {
        let w = self.workers as f64;
        let pushed = match self.density {
            None => self.params as f64,
            Some(d) => self.params as f64 * d,
        };
        (self.steps + 1) as f64 * w * (pushed + self.expected_reply())
    }
}

/// Counters of one server process over the measured steps.
#[derive(Debug, Clone, Serialize)]
pub struct ServerResult {
    pub index: usize,
    pub shard_len: usize,
    /// Request frame bytes the server received (its I/O side counted them).
    pub bytes_in: u64,
    /// Reply frame bytes it sent.
    pub bytes_out: u64,
    pub cpu_ns: u64,
    pub updates: u64,
    pub sparse_updates: u64,
    pub pushes: u64,
    pub refused: u64,
    /// Entries carried by the pushes it received.
    pub entries_pushed: u64,
    /// Buffer bytes at the end of the run, by kind.
    pub mem_params: usize,
    pub mem_optimizer: usize,
    pub mem_aggregation: usize,
    pub mem_history: usize,
    /// Version at the end of the run (warm-up included).
    pub final_version: u64,
}

impl ServerResult {
    pub fn mem_total(&self) -> usize {
        self.mem_params + self.mem_optimizer + self.mem_aggregation + self.mem_history
    }
}

/// What one case measured.
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    pub case: ScaleCase,
    /// Mean wall time of a measured step.
    pub step_ms: f64,
    pub servers: Vec<ServerResult>,
    /// Request frame bytes the workers sent, per worker (measured steps).
    pub worker_sent: Vec<u64>,
    /// Reply frame bytes the workers received, per worker.
    pub worker_received: Vec<u64>,
    /// Entries the workers pushed, all of them together.
    pub entries_pushed: u64,
}

impl CaseResult {
    /// Server CPU (all servers) per update applied to the whole model, in ms.
    pub fn cpu_per_update_ms(&self) -> f64 {
        let cpu: u64 = self.servers.iter().map(|s| s.cpu_ns).sum();
        cpu as f64 / 1e6 / self.case.steps as f64
    }

    /// Server CPU per pushed entry, in ns: flat when the server's cost grows
    /// with the entries pushed.
    pub fn cpu_per_entry_ns(&self) -> f64 {
        let cpu: u64 = self.servers.iter().map(|s| s.cpu_ns).sum();
        cpu as f64 / self.entries_pushed.max(1) as f64
    }

    /// Bytes in and out per step through the server that moved the most.
    pub fn busiest_bytes_per_step(&self) -> f64 {
        let max = self
            .servers
            .iter()
            .map(|s| s.bytes_in + s.bytes_out)
            .max()
            .unwrap_or(0);
        max as f64 / self.case.steps as f64
    }

    /// Reply frame bytes one worker received per step from all servers
    /// together, the mean over workers.
    pub fn reply_bytes_per_worker_step(&self) -> f64 {
        let received: u64 = self.worker_received.iter().sum();
        received as f64 / self.worker_received.len().max(1) as f64 / self.case.steps as f64
    }

    /// Buffer bytes of the server that holds the most.
    pub fn max_server_memory(&self) -> usize {
        self.servers
            .iter()
            .map(|s| s.mem_total())
            .max()
            .unwrap_or(0)
    }
}

/// A small, fast generator (SplitMix64) for the synthetic gradients.
struct Gen(u64);

impl Gen {
    fn new(seed: u64) -> Self {
        Self(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn small(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2e-3 - 1e-3
    }
}

/// `k` ascending distinct indices below `len`, one per stride, and values.
fn sparse_push(len: usize, k: usize, gen: &mut Gen) -> (Vec<u32>, Vec<f32>) {
    let mut indices = Vec::with_capacity(k);
    let mut values = Vec::with_capacity(k);
    for j in 0..k {
        let lo = j * len / k;
        let hi = (j + 1) * len / k;
        indices.push((lo as u64 + gen.below((hi - lo) as u64)) as u32);
        values.push(gen.small());
    }
    (indices, values)
}

/// The I/O side of one server process: frames in, frames out, counted.
struct ServerIo {
    shard: u32,
    addr: Addr<ShardActor>,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    entries_in: AtomicU64,
}

impl ServerIo {
    /// Handle one request frame from `rank` as a connection task does.
    async fn exchange(&self, rank: u32, frame: Vec<u8>) -> anyhow::Result<EncodedFrame> {
        self.bytes_in
            .fetch_add(frame.len() as u64, Ordering::Relaxed);
        let request = decode_request(&frame[FRAME_HEADER_BYTES..])?;
        drop(frame);
        let request = match request {
            Request::Step {
                shard,
                step,
                have_version,
                rate,
                grad,
            } if shard == self.shard => {
                self.entries_in
                    .fetch_add(grad.len() as u64, Ordering::Relaxed);
                ShardRequest::Step {
                    step,
                    have_version,
                    rate,
                    grad,
                }
            }
            Request::Offer {
                shard,
                version,
                next_step,
                values,
            } if shard == self.shard => ShardRequest::Offer {
                version,
                next_step,
                values,
            },
            other => bail!("server {} cannot take {other:?}", self.shard),
        };
        let rx = self
            .addr
            .send(Deliver {
                conn: u64::from(rank),
                rank,
                request,
            })
            .await
            .context("the shard actor stopped")?;
        // The shard encodes each distinct reply once and every connection
        // writes the same frame: its bytes count once per worker here.
        let reply = rx.await.context("the shard dropped the reply")?;
        self.bytes_out
            .fetch_add(reply.frame.len() as u64, Ordering::Relaxed);
        Ok(reply.frame)
    }

    fn reset(&self) {
        self.bytes_in.store(0, Ordering::Relaxed);
        self.bytes_out.store(0, Ordering::Relaxed);
        self.entries_in.store(0, Ordering::Relaxed);
    }
}

/// What one worker moved in the measured steps.
#[derive(Default, Clone, Copy)]
struct WorkerBytes {
    sent: u64,
    received: u64,
    entries: u64,
}

/// One worker's step: a push to every server, then every reply decoded and
/// checked.
async fn worker_step(
    case: ScaleCase,
    rank: u32,
    step: u64,
    io: &[Arc<ServerIo>],
    lens: &[usize],
    dense: &[Arc<Vec<f32>>],
) -> anyhow::Result<WorkerBytes> {
    let mut gen = Gen::new((u64::from(rank) << 32) ^ step.wrapping_mul(0x5851_f42d));
    let mut pending = Vec::with_capacity(io.len());
    let mut bytes = WorkerBytes::default();
    for (s, server) in io.iter().enumerate() {
        let grad = match case.density {
            None => WireGrad::Dense(WireValues::F32(dense[s].as_ref().clone())),
            Some(_) => {
                let (indices, values) = sparse_push(lens[s], case.k_for(lens[s]), &mut gen);
                WireGrad::Sparse {
                    indices,
                    values: WireValues::F32(values),
                }
            }
        };
        bytes.entries += grad.len() as u64;
        let frame = encode_request(&Request::Step {
            shard: s as u32,
            step,
            have_version: Some(step),
            rate: 0.0,
            grad,
        })?;
        bytes.sent += frame.len() as u64;
        let server = server.clone();
        pending.push(async move { server.exchange(rank, frame).await });
    }
    for (s, reply) in futures::future::join_all(pending)
        .await
        .into_iter()
        .enumerate()
    {
        let reply = reply?;
        bytes.received += reply.len() as u64;
        match decode_response(reply.payload())? {
            Response::Params { version, .. } if version == step + 1 => {}
            other => bail!(
                "worker {rank}, step {step}, server {s}: expected version {}, got {}",
                step + 1,
                describe(&other)
            ),
        }
    }
    Ok(bytes)
}

fn describe(response: &Response) -> String {
    match response {
        Response::Params {
            version, update, ..
        } => {
            let kind = match update {
                ParamUpdate::Dense(_) => "dense",
                ParamUpdate::Sparse { .. } => "sparse",
                ParamUpdate::DenseDelta16 { .. } => "dense f16 change",
                ParamUpdate::SparseDelta16 { .. } => "sparse f16 change",
            };
            format!("{kind} params at version {version}")
        }
        Response::Error { code, message } => format!("error {code:?}: {message}"),
        other => format!("{other:?}"),
    }
}

/// Run one case in its own actix system; returns what it measured.
pub fn run_case(case: ScaleCase) -> anyhow::Result<CaseResult> {
    if case.workers == 0 || case.servers == 0 || case.steps == 0 {
        bail!("a case needs at least one worker, one server and one step: {case:?}");
    }
    if case.params < case.servers {
        bail!(
            "{} parameters cannot be split over {} servers",
            case.params,
            case.servers
        );
    }
    let system = actix::System::new();
    system.block_on(run_case_in_system(case))
}

async fn run_case_in_system(case: ScaleCase) -> anyhow::Result<CaseResult> {
    let map = ShardMap::balanced(case.params, case.servers).map_err(|e| anyhow!("{e}"))?;
    let rule = OptimizerSection {
        lr: 0.1,
        // Dense runs keep momentum on the server (its optimizer state); top-k
        // runs use plain SGD, so the sparse update path applies.
        momentum: if case.density.is_none() { 0.9 } else { 0.0 },
        nesterov: false,
        ..OptimizerSection::default()
    };
    let settings = CoreSettings {
        recovery_window: Duration::ZERO,
        request_timeout: Duration::from_secs(600),
        ..CoreSettings::default()
    };
    let mut arbiters = Vec::new();
    let mut io = Vec::new();
    let mut lens = Vec::new();
    for (s, range) in map.ranges().iter().enumerate() {
        let len = range.end - range.start;
        let setup = ShardSetup {
            shard: s as u32,
            lo: range.start,
            hi: range.end,
            segments: std::iter::once(0..len).collect(),
            rule: rule.clone(),
            workers: case.workers as u32,
            mode: SyncMode::Bsp,
            staleness: 0,
            global_topk: case.global_topk,
            decay: Vec::new(),
            backup: 0,
            f16_replies: false,
            shared_norm: false,
        };
        let core = ShardCore::new(setup, settings.clone(), None);
        let (version_tx, _) = watch::channel(0);
        let (waiting_tx, _) = watch::channel(0);
        let arbiter = Arbiter::new();
        let addr = ShardActor::start_in_arbiter(&arbiter.handle(), move |_| {
            ShardActor::new(
                core,
                None,
                Duration::from_millis(500),
                version_tx,
                waiting_tx,
            )
        });
        for rank in 0..case.workers as u32 {
            addr.send(MemberNews::Joined {
                rank,
                conn: u64::from(rank),
            })
            .await?;
        }
        arbiters.push(arbiter);
        lens.push(len);
        io.push(Arc::new(ServerIo {
            shard: s as u32,
            addr,
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            entries_in: AtomicU64::new(0),
        }));
    }
    let result = drive(case, &io, &lens).await;
    for server in &io {
        let _ = server.addr.send(Shutdown).await;
    }
    for arbiter in arbiters {
        arbiter.stop();
    }
    result
}

async fn counters(io: &[Arc<ServerIo>]) -> anyhow::Result<Vec<ShardCounters>> {
    let mut out = Vec::with_capacity(io.len());
    for server in io {
        out.push(server.addr.send(GetCounters).await?);
    }
    Ok(out)
}

async fn drive(
    case: ScaleCase,
    io: &[Arc<ServerIo>],
    lens: &[usize],
) -> anyhow::Result<CaseResult> {
    // Rank 0 offers zeros; with no recovery window each shard starts at once.
    for (s, server) in io.iter().enumerate() {
        let frame = encode_request(&Request::Offer {
            shard: s as u32,
            version: 0,
            next_step: 0,
            values: vec![0.0; lens[s]],
        })?;
        let reply = server.exchange(0, frame).await?;
        match decode_response(reply.payload())? {
            Response::Params { version: 0, .. } => {}
            other => bail!("server {s} did not start: {}", describe(&other)),
        }
    }
    let dense: Vec<Arc<Vec<f32>>> = match case.density {
        None => lens
            .iter()
            .enumerate()
            .map(|(s, &len)| {
                let mut gen = Gen::new(s as u64);
                Arc::new((0..len).map(|_| gen.small()).collect())
            })
            .collect(),
        Some(_) => Vec::new(),
    };
    let mut totals = vec![WorkerBytes::default(); case.workers];
    let mut before = Vec::new();
    let mut started = Instant::now();
    for step in 0..=case.steps {
        if step == 1 {
            // Step 0 is the warm-up: counting starts after it.
            for server in io {
                server.reset();
            }
            totals.fill(WorkerBytes::default());
            before = counters(io).await?;
            started = Instant::now();
        }
        let dense = &dense;
        let steps =
            (0..case.workers as u32).map(|rank| worker_step(case, rank, step, io, lens, dense));
        for (rank, bytes) in futures::future::join_all(steps)
            .await
            .into_iter()
            .enumerate()
        {
            let bytes = bytes?;
            let t = &mut totals[rank];
            t.sent += bytes.sent;
            t.received += bytes.received;
            t.entries += bytes.entries;
        }
    }
    let elapsed = started.elapsed();
    let after = counters(io).await?;
    let servers = io
        .iter()
        .zip(before.iter().zip(&after))
        .enumerate()
        .map(|(index, (server, (b, a)))| ServerResult {
            index,
            shard_len: lens[index],
            bytes_in: server.bytes_in.load(Ordering::Relaxed),
            bytes_out: server.bytes_out.load(Ordering::Relaxed),
            cpu_ns: u64::try_from(a.cpu.saturating_sub(b.cpu).as_nanos()).unwrap_or(u64::MAX),
            updates: a.stats.updates - b.stats.updates,
            sparse_updates: a.stats.sparse_updates - b.stats.sparse_updates,
            pushes: a.stats.pushes - b.stats.pushes,
            refused: a.stats.refused - b.stats.refused,
            entries_pushed: server.entries_in.load(Ordering::Relaxed),
            mem_params: a.memory.params,
            mem_optimizer: a.memory.optimizer,
            mem_aggregation: a.memory.aggregation,
            mem_history: a.memory.history,
            final_version: a.version,
        })
        .collect();
    Ok(CaseResult {
        case,
        step_ms: elapsed.as_secs_f64() * 1e3 / case.steps as f64,
        servers,
        worker_sent: totals.iter().map(|t| t.sent).collect(),
        worker_received: totals.iter().map(|t| t.received).collect(),
        entries_pushed: totals.iter().map(|t| t.entries).sum(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_pushes_are_ascending_distinct_and_in_range() {
        let mut gen = Gen::new(3);
        for (len, k) in [(10, 10), (1000, 1), (1000, 7), (12345, 12)] {
            let (idx, vals) = sparse_push(len, k, &mut gen);
            assert_eq!((idx.len(), vals.len()), (k, k));
            assert!(idx.windows(2).all(|w| w[0] < w[1]), "{idx:?}");
            assert!((*idx.last().unwrap() as usize) < len);
        }
    }
}
