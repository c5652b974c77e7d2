//! QUIC transport: mutually authenticated TLS 1.3 endpoints and framed calls.
//!
//! One worker keeps one QUIC connection per server process. Each request is a
//! bidirectional stream carrying one request frame and one response frame (see
//! [`crate::protocol`]), so slow requests (a BSP pull waiting for the barrier)
//! never block fast ones.
//!
//! Both sides authenticate with certificates from the cluster CA (see
//! [`crate::pki`]): the server presents its server certificate, and refuses
//! any client that does not present a worker certificate chaining to the CA.
//! [`peer_rank`] then tells the server which worker rank the CA issued that
//! certificate for. Only TLS 1.3 with the *ring* provider is offered.
//! [`EndpointLimits`] bounds idle connections and concurrent streams, and
//! [`read_frame`] only allocates memory for bytes that actually arrived.
//!
//! A server connection starts small: until the peer has said Hello it may
//! open one stream and have [`PRE_HELLO_RECEIVE_WINDOW`] bytes in flight, so
//! a peer that never says Hello costs a few KiB however much it sends.
//! [`open_after_hello`] then grants the streams and the receive window a
//! step needs ([`EndpointLimits::server_receive_window`]), and
//! [`read_frame_budgeted`] holds the frames being read on one connection to
//! a [`FrameBudget`] of bytes, with a stall deadline on every read.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use ps_net::pki::ClusterCa;
//! use ps_net::transport::{self, EndpointLimits};
//!
//! let ca = ClusterCa::generate("stratus cluster CA")?;
//! let server_id = ca.issue_server(&["localhost".into()])?;
//! let limits = EndpointLimits::default();
//! let server = transport::server_endpoint(
//!     "127.0.0.1:0".parse()?,
//!     &server_id.cert_pem,
//!     &server_id.key_pem,
//!     ca.cert_pem(),
//!     &limits,
//! )?;
//! let client = transport::client_endpoint(ca.cert_pem(), &ca.issue_worker(3)?, false, &limits)?;
//! let addr = server.local_addr()?;
//! let (conn, accepted) = tokio::join!(
//!     transport::connect(&client, addr, "localhost", Duration::from_secs(5)),
//!     async { server.accept().await.expect("endpoint open").await },
//! );
//! assert_eq!(transport::peer_rank(&accepted?)?, 3);
//! # let _ = conn?; Ok(()) }
//! ```

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, RecvStream, SendStream};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::pki::{self, CertPair, PkiError};
use crate::protocol::{
    decode_response, encode_request_frame, frame_len, AlignedVec, EncodedFrame, ProtocolError,
    Request, Response, FRAME_HEADER_BYTES,
};

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("TLS setup failed: {0}")]
    Tls(String),
    #[error("invalid endpoint limits: {0}")]
    Limits(String),
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("socket error: {0}")]
    Socket(#[from] std::io::Error),
    #[error("cannot connect to {addr}: {message}")]
    Connect { addr: String, message: String },
    #[error("cannot connect to {addr}: the handshake did not finish within {timeout:?}")]
    ConnectTimeout { addr: String, timeout: Duration },
    #[error("connection lost: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("stream write failed: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("stream read failed: {0}")]
    Read(String),
    #[error("frame stalled: no byte for {stall:?} after {received} of {expected} bytes")]
    Stalled {
        stall: Duration,
        received: usize,
        expected: usize,
    },
    #[error("peer presented no certificate chain")]
    NoPeerIdentity,
    #[error("peer certificate does not identify a worker: {0}")]
    PeerIdentity(#[source] PkiError),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
}

/// Limits applied to every connection of an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointLimits {
    /// A connection with no traffic for this long is dropped (the smaller of
    /// the two sides' values applies). Must be non-zero.
    pub idle_timeout: Duration,
    /// Send a keep-alive after this much silence; must be shorter than
    /// `idle_timeout`. Zero disables keep-alives.
    pub keep_alive: Duration,
    /// Bidirectional streams the peer may have open at once (one per
    /// in-flight request).
    pub max_bidi_streams: u32,
    /// Largest UDP payload path MTU discovery probes up to (at least 1200,
    /// QUIC's floor). Fewer, larger packets on paths that carry them: the
    /// per-packet work (headers, encryption set-up, acknowledgements) is
    /// what bounds a dense exchange on a fast link.
    pub max_udp_payload: u16,
}

impl Default for EndpointLimits {
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(5),
            keep_alive: Duration::from_secs(1),
            max_bidi_streams: 64,
            max_udp_payload: DEFAULT_MAX_UDP_PAYLOAD,
        }
    }
}

impl EndpointLimits {
    /// The limits both ends of a cluster's connections use, from its config:
    /// `server.idle_timeout_secs`, `server.heartbeat_secs` (keep-alives),
    /// four streams per shard of a server and 16 more, and
    /// `server.max_udp_payload`.
    pub fn of_cluster(cfg: &ps_shared::config::ClusterConfig) -> Self {
        Self {
            idle_timeout: ps_shared::config::secs(cfg.server.idle_timeout_secs),
            keep_alive: ps_shared::config::secs(cfg.server.heartbeat_secs),
            max_bidi_streams: (4 * cfg.cluster.shards_per_server + 16) as u32,
            max_udp_payload: cfg.server.udp_payload(),
        }
    }
}

/// The largest UDP payload probed by default: what any Ethernet path
/// carries (quinn's own default bound).
pub const DEFAULT_MAX_UDP_PAYLOAD: u16 = 1452;

/// Bytes a server connection may have in flight towards the server before
/// its peer has said Hello: room for one Hello frame
/// ([`crate::protocol::MAX_HELLO_BYTES`] and its header) and little more.
pub const PRE_HELLO_RECEIVE_WINDOW: u32 = 16 << 10;

/// The connection receive windows of a server are sized so that every
/// stream's window together stays near this (see
/// [`EndpointLimits::server_stream_window`]).
const SERVER_WINDOWS_TARGET: u64 = 32 << 20;

impl EndpointLimits {
    /// Receive window of each stream on a server connection: 1 MiB, less
    /// when many streams are allowed so that all of them together stay near
    /// 32 MiB, never under 64 KiB.
    pub fn server_stream_window(&self) -> u64 {
        let streams = u64::from(self.max_bidi_streams) + 1;
        (SERVER_WINDOWS_TARGET / streams).clamp(64 << 10, 1 << 20)
    }

    /// Receive window of a server connection after Hello: every stream's
    /// window and one more. Streams that wait for their turn to be read
    /// (see [`FrameBudget`]) can fill their own windows but never the whole
    /// connection's, so the stream being read always has room to progress.
    /// This bounds what the transport buffers for one connection.
    pub fn server_receive_window(&self) -> u64 {
        (u64::from(self.max_bidi_streams) + 1) * self.server_stream_window()
    }

    /// The server's transport: one stream and [`PRE_HELLO_RECEIVE_WINDOW`]
    /// bytes until [`open_after_hello`] raises them.
    fn server_transport_config(&self) -> Result<Arc<quinn::TransportConfig>, TransportError> {
        let mut t = self.base_transport_config()?;
        t.max_concurrent_bidi_streams(1u32.into());
        t.stream_receive_window(
            quinn::VarInt::from_u64(self.server_stream_window())
                .map_err(|_| TransportError::Limits("server stream window out of range".into()))?,
        );
        t.receive_window(PRE_HELLO_RECEIVE_WINDOW.into());
        t.send_window(256 << 20);
        Ok(Arc::new(t))
    }

    fn transport_config(&self) -> Result<Arc<quinn::TransportConfig>, TransportError> {
        let mut t = self.base_transport_config()?;
        t.max_concurrent_bidi_streams(self.max_bidi_streams.into());
        // Large dense shards come back in one stream: open the windows wide.
        t.stream_receive_window((64u32 << 20).into());
        t.receive_window((256u32 << 20).into());
        t.send_window(256 << 20);
        Ok(Arc::new(t))
    }

    fn base_transport_config(&self) -> Result<quinn::TransportConfig, TransportError> {
        if self.idle_timeout.is_zero() {
            return Err(TransportError::Limits(
                "idle_timeout must be non-zero".into(),
            ));
        }
        if !self.keep_alive.is_zero() && self.keep_alive >= self.idle_timeout {
            return Err(TransportError::Limits(format!(
                "keep_alive ({:?}) must be shorter than idle_timeout ({:?})",
                self.keep_alive, self.idle_timeout
            )));
        }
        let idle = quinn::IdleTimeout::try_from(self.idle_timeout).map_err(|_| {
            TransportError::Limits(format!("idle_timeout {:?} is too large", self.idle_timeout))
        })?;
        if self.max_udp_payload < 1200 {
            return Err(TransportError::Limits(format!(
                "max_udp_payload {} is below QUIC's 1200",
                self.max_udp_payload
            )));
        }
        let mut t = quinn::TransportConfig::default();
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(self.max_udp_payload);
        t.mtu_discovery_config(Some(mtu));
        t.max_concurrent_uni_streams(0u32.into());
        t.max_idle_timeout(Some(idle));
        t.keep_alive_interval((!self.keep_alive.is_zero()).then_some(self.keep_alive));
        Ok(t)
    }
}

/// Open a server connection whose peer has said Hello: `limits`' streams
/// and the receive window of [`EndpointLimits::server_receive_window`].
pub fn open_after_hello(conn: &Connection, limits: &EndpointLimits) {
    let window =
        quinn::VarInt::from_u64(limits.server_receive_window()).unwrap_or(quinn::VarInt::MAX);
    conn.set_receive_window(window);
    conn.set_max_concurrent_bi_streams(limits.max_bidi_streams.into());
}

/// Read a PEM file with a message that names it.
pub fn read_pem(path: &Path) -> Result<String, TransportError> {
    std::fs::read_to_string(path).map_err(|source| TransportError::Io {
        path: path.display().to_string(),
        source,
    })
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(context: &str) -> impl FnOnce(rustls::Error) -> TransportError + '_ {
    move |e| TransportError::Tls(format!("{context}: {e}"))
}

fn certs_from_pem(pem: &str) -> Result<Vec<CertificateDer<'static>>, TransportError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TransportError::Tls(format!("bad certificate PEM: {e}")))?;
    if certs.is_empty() {
        return Err(TransportError::Tls("no certificate in PEM".into()));
    }
    Ok(certs)
}

fn key_from_pem(pem: &str) -> Result<PrivateKeyDer<'static>, TransportError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| TransportError::Tls(format!("bad private key PEM: {e}")))
}

fn roots_from_pem(ca_pem: &str) -> Result<Arc<RootCertStore>, TransportError> {
    let mut roots = RootCertStore::empty();
    for cert in certs_from_pem(ca_pem)? {
        roots
            .add(cert)
            .map_err(tls_err("unusable CA certificate"))?;
    }
    Ok(Arc::new(roots))
}

/// A QUIC server endpoint bound to `addr`: TLS 1.3 with the given certificate,
/// and every client must present a certificate chaining to `client_ca_pem`.
pub fn server_endpoint(
    addr: SocketAddr,
    cert_pem: &str,
    key_pem: &str,
    client_ca_pem: &str,
    limits: &EndpointLimits,
) -> Result<Endpoint, TransportError> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(
        roots_from_pem(client_ca_pem)?,
        provider.clone(),
    )
    .build()
    .map_err(|e| TransportError::Tls(format!("client certificate verifier: {e}")))?;
    let tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err("TLS 1.3"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs_from_pem(cert_pem)?, key_from_pem(key_pem)?)
        .map_err(tls_err("server certificate"))?;
    let crypto = QuicServerConfig::try_from(tls)
        .map_err(|e| TransportError::Tls(format!("QUIC server TLS: {e}")))?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(limits.server_transport_config()?);
    Ok(Endpoint::server(cfg, addr)?)
}

/// A QUIC client endpoint that trusts only the certificates in `ca_pem` and
/// presents `identity` (a worker certificate) to servers. Binds an ephemeral
/// port on the IPv6 or IPv4 wildcard address.
pub fn client_endpoint(
    ca_pem: &str,
    identity: &CertPair,
    ipv6: bool,
    limits: &EndpointLimits,
) -> Result<Endpoint, TransportError> {
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err("TLS 1.3"))?
        .with_root_certificates(roots_from_pem(ca_pem)?)
        .with_client_auth_cert(
            certs_from_pem(&identity.cert_pem)?,
            key_from_pem(&identity.key_pem)?,
        )
        .map_err(tls_err("client certificate"))?;
    let crypto = QuicClientConfig::try_from(tls)
        .map_err(|e| TransportError::Tls(format!("QUIC client TLS: {e}")))?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(limits.transport_config()?);
    let bind: SocketAddr = if ipv6 {
        "[::]:0".parse().expect("literal address")
    } else {
        "0.0.0.0:0".parse().expect("literal address")
    };
    let mut ep = Endpoint::client(bind)?;
    ep.set_default_client_config(cfg);
    Ok(ep)
}

/// The worker rank of the peer's client certificate (server side): the
/// certificate already chained to the cluster CA during the handshake; this
/// reads the rank it carries (see [`pki::rank_from_cert_der`]).
pub fn peer_rank(conn: &Connection) -> Result<u32, TransportError> {
    let identity = conn.peer_identity().ok_or(TransportError::NoPeerIdentity)?;
    let chain = identity
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| TransportError::NoPeerIdentity)?;
    let leaf = chain.first().ok_or(TransportError::NoPeerIdentity)?;
    pki::rank_from_cert_der(leaf).map_err(TransportError::PeerIdentity)
}

/// Connect and finish the TLS handshake within `timeout`.
///
/// In TLS 1.3 the client finishes its side of the handshake before the server
/// has checked the client certificate: a server that refuses our certificate
/// closes the connection right after, so the first call on it fails with the
/// server's reason.
pub async fn connect(
    endpoint: &Endpoint,
    addr: SocketAddr,
    server_name: &str,
    timeout: Duration,
) -> Result<Connection, TransportError> {
    let connect_err = |message: String| TransportError::Connect {
        addr: addr.to_string(),
        message,
    };
    let connecting = endpoint
        .connect(addr, server_name)
        .map_err(|e| connect_err(e.to_string()))?;
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(connect_err(e.to_string())),
        Err(_) => Err(TransportError::ConnectTimeout {
            addr: addr.to_string(),
            timeout,
        }),
    }
}

/// Resolve `host:port` (names allowed) to a socket address.
pub async fn resolve(host_port: &str) -> Result<SocketAddr, TransportError> {
    tokio::net::lookup_host(host_port)
        .await
        .map_err(|e| TransportError::Connect {
            addr: host_port.to_string(),
            message: e.to_string(),
        })?
        .next()
        .ok_or_else(|| TransportError::Connect {
            addr: host_port.to_string(),
            message: "name resolved to no address".into(),
        })
}

/// Read one frame's payload, refusing frames larger than `limit`.
///
/// Memory follows the bytes that actually arrive, not the length the header
/// declares: a peer that announces a huge frame and sends little costs little.
/// The transport's chunks are kept as they arrive and copied once, at the
/// end, into a 16-byte aligned buffer of the frame's length, where the
/// protocol validates the archive in place (see
/// [`crate::protocol::decode_response`]): one copy of the payload.
pub async fn read_frame(recv: &mut RecvStream, limit: usize) -> Result<AlignedVec, TransportError> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    recv.read_exact(&mut header)
        .await
        .map_err(|e| TransportError::Read(format!("frame header: {e}")))?;
    let len = frame_len(header, limit)?;
    read_payload(recv, len, None, false).await
}

/// Bytes of request frames one connection may hold at once while they are
/// read and decoded. A frame reserves its whole declared length before its
/// payload is read, so it always finishes once its bytes arrive; frames
/// that do not fit wait their turn, first come first served, without
/// reading (their bytes stay in the transport's bounded stream windows).
#[derive(Debug, Clone)]
pub struct FrameBudget {
    bytes: usize,
    free: Arc<Semaphore>,
}

impl FrameBudget {
    /// A budget of `bytes`; frames up to this size can be read.
    pub fn new(bytes: usize) -> Self {
        let bytes = bytes.min(Semaphore::MAX_PERMITS);
        Self {
            bytes,
            free: Arc::new(Semaphore::new(bytes)),
        }
    }

    /// The budget's size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes not reserved by a frame now.
    pub fn available(&self) -> usize {
        self.free.available_permits()
    }

    /// The payload length a frame's `header` declares, refused above
    /// `limit` or the budget, and its reservation, waited for first come
    /// first served.
    pub(crate) async fn reserve_frame(
        &self,
        header: [u8; FRAME_HEADER_BYTES],
        limit: usize,
    ) -> Result<(usize, OwnedSemaphorePermit), TransportError> {
        let len = frame_len(header, limit.min(self.bytes))?;
        let wanted = u32::try_from(len).map_err(|_| ProtocolError::FrameTooLarge {
            size: len,
            limit: u32::MAX as usize,
        })?;
        let reserved = self
            .free
            .clone()
            .acquire_many_owned(wanted)
            .await
            .map_err(|_| TransportError::Read("the connection's frame budget is closed".into()))?;
        Ok((len, reserved))
    }
}

/// A frame's payload and its share of a [`FrameBudget`], given back when
/// this is dropped.
#[derive(Debug)]
pub struct Frame {
    /// 16-byte aligned: the archive is validated where it lies.
    pub payload: AlignedVec,
    _reserved: Option<OwnedSemaphorePermit>,
}

impl Frame {
    /// `payload`, holding `reserved` of its budget until dropped.
    pub(crate) fn reserved(payload: AlignedVec, reserved: OwnedSemaphorePermit) -> Self {
        Self {
            payload,
            _reserved: Some(reserved),
        }
    }
}

/// [`read_frame`] for a server: the frame's declared length is reserved in
/// `budget` before its payload is read, and every read (the header's, each
/// chunk of the payload) must bring a byte within `stall`, so a peer that
/// starts a frame and stops holds its reservation for `stall` at most.
/// Frames larger than `limit` or than the budget are refused.
pub async fn read_frame_budgeted(
    recv: &mut RecvStream,
    limit: usize,
    stall: Duration,
    budget: &FrameBudget,
) -> Result<Frame, TransportError> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    let stalled = |received: usize, expected: usize| TransportError::Stalled {
        stall,
        received,
        expected,
    };
    tokio::time::timeout(stall, recv.read_exact(&mut header))
        .await
        .map_err(|_| stalled(0, FRAME_HEADER_BYTES))?
        .map_err(|e| TransportError::Read(format!("frame header: {e}")))?;
    let (len, reserved) = budget.reserve_frame(header, limit).await?;
    // The reservation already holds the frame's length: its buffer is
    // allocated whole, and the payload read straight into it.
    let payload = read_payload(recv, len, Some(stall), true).await?;
    Ok(Frame::reserved(payload, reserved))
}

/// Read `len` payload bytes into an aligned buffer, copying each byte once.
/// With `whole`, the buffer is allocated at its full length first and the
/// chunks copied in as they arrive; without, the chunks (the transport's
/// own buffers) are held until the last one and then copied, so memory
/// follows the bytes that arrive. With `stall`, each read must bring a byte
/// within it.
async fn read_payload(
    recv: &mut RecvStream,
    len: usize,
    stall: Option<Duration>,
    whole: bool,
) -> Result<AlignedVec, TransportError> {
    let mut payload = AlignedVec::with_capacity(if whole { len } else { 0 });
    let mut chunks: Vec<bytes::Bytes> = Vec::new();
    let mut received = 0;
    while received < len {
        let read = recv.read_chunk(len - received, true);
        let chunk =
            match stall {
                Some(stall) => tokio::time::timeout(stall, read).await.map_err(|_| {
                    TransportError::Stalled {
                        stall,
                        received,
                        expected: len,
                    }
                })?,
                None => read.await,
            };
        let chunk = chunk
            .map_err(|e| TransportError::Read(e.to_string()))?
            .ok_or_else(|| {
                TransportError::Read(format!(
                    "stream ended after {received} of {len} frame bytes"
                ))
            })?;
        received += chunk.bytes.len();
        if whole {
            payload.extend_from_slice(&chunk.bytes);
        } else {
            chunks.push(chunk.bytes);
        }
    }
    if !whole {
        payload.reserve_exact(len);
        for chunk in chunks {
            payload.extend_from_slice(&chunk);
        }
    }
    Ok(payload)
}

/// Write a whole frame and close the sending side.
pub async fn write_frame(send: &mut SendStream, frame: &[u8]) -> Result<(), TransportError> {
    send.write_all(frame).await?;
    let _ = send.finish();
    Ok(())
}

/// Write an encoded frame and close the sending side. The archive is
/// handed to the transport by reference, not copied: the same frame can be
/// written again (a retry) or to several streams.
pub async fn write_encoded(
    send: &mut SendStream,
    frame: &EncodedFrame,
) -> Result<(), TransportError> {
    send.write_all(&frame.header()).await?;
    send.write_chunk(frame.payload().clone()).await?;
    let _ = send.finish();
    Ok(())
}

/// One request/response exchange on a fresh stream. Returns the response and
/// the bytes sent (frame size) for accounting.
pub async fn call(
    conn: &Connection,
    req: &Request,
    limit: usize,
) -> Result<(Response, usize), TransportError> {
    let frame = encode_request_frame(req)?;
    call_frame(conn, &frame, limit)
        .await
        .map(|(r, _)| (r, frame.len()))
}

/// Send an encoded request and read the response. Returns it with the
/// bytes of its payload, which were copied once from the transport into
/// the aligned buffer it was validated in.
pub async fn call_frame(
    conn: &Connection,
    frame: &EncodedFrame,
    limit: usize,
) -> Result<(Response, usize), TransportError> {
    let (mut send, mut recv) = conn.open_bi().await?;
    write_encoded(&mut send, frame).await?;
    let payload = read_frame(&mut recv, limit).await?;
    Ok((decode_response(&payload)?, payload.len()))
}

/// Send pre-encoded bytes (possibly malformed, for tests) and read the response.
pub async fn call_raw(
    conn: &Connection,
    frame: &[u8],
    limit: usize,
) -> Result<Response, TransportError> {
    let (mut send, mut recv) = conn.open_bi().await?;
    write_frame(&mut send, frame).await?;
    let payload = read_frame(&mut recv, limit).await?;
    Ok(decode_response(&payload)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::ClusterCa;
    use crate::protocol::{decode_request, encode_response};

    const WAIT: Duration = Duration::from_secs(10);

    struct Cluster {
        ca: ClusterCa,
        server: Endpoint,
        addr: SocketAddr,
    }

    fn cluster() -> Cluster {
        cluster_with(&EndpointLimits::default())
    }

    /// A CA and a server endpoint under `limits`.
    fn cluster_with(limits: &EndpointLimits) -> Cluster {
        let ca = ClusterCa::generate("test cluster CA").unwrap();
        let id = ca
            .issue_server(&["localhost".into(), "127.0.0.1".into()])
            .unwrap();
        let server = server_endpoint(
            "127.0.0.1:0".parse().unwrap(),
            &id.cert_pem,
            &id.key_pem,
            ca.cert_pem(),
            limits,
        )
        .unwrap();
        let addr = server.local_addr().unwrap();
        Cluster { ca, server, addr }
    }

    fn client(trusted_ca_pem: &str, identity: &CertPair) -> Endpoint {
        client_endpoint(trusted_ca_pem, identity, false, &EndpointLimits::default()).unwrap()
    }

    /// Connect `client` while the server accepts: (client side, server side).
    async fn handshake(
        cluster: &Cluster,
        client: &Endpoint,
    ) -> (
        Result<Connection, TransportError>,
        Result<Connection, quinn::ConnectionError>,
    ) {
        tokio::join!(connect(client, cluster.addr, "localhost", WAIT), async {
            cluster.server.accept().await.expect("endpoint open").await
        })
    }

    /// The server refused the client: it never got a connection, and the
    /// client either failed to connect or saw the server close it.
    async fn assert_refused(
        client_side: Result<Connection, TransportError>,
        server_side: Result<Connection, quinn::ConnectionError>,
    ) {
        assert!(server_side.is_err(), "server accepted the client");
        if let Ok(conn) = client_side {
            let reason = conn.closed().await;
            assert!(
                !matches!(reason, quinn::ConnectionError::TimedOut),
                "{reason}"
            );
        }
    }

    #[tokio::test]
    async fn worker_cert_from_cluster_ca_names_its_rank() {
        let cluster = cluster();
        let worker = cluster.ca.issue_worker(5).unwrap();
        let ep = client(cluster.ca.cert_pem(), &worker);
        let (client_side, server_side) = handshake(&cluster, &ep).await;
        let _conn = client_side.unwrap();
        assert_eq!(peer_rank(&server_side.unwrap()).unwrap(), 5);
    }

    #[tokio::test]
    async fn client_cert_from_another_ca_is_refused() {
        let cluster = cluster();
        let stranger = ClusterCa::generate("test cluster CA").unwrap();
        let ep = client(cluster.ca.cert_pem(), &stranger.issue_worker(1).unwrap());
        let (client_side, server_side) = handshake(&cluster, &ep).await;
        assert_refused(client_side, server_side).await;
    }

    #[tokio::test]
    async fn client_without_certificate_is_refused() {
        let cluster = cluster();
        let roots = roots_from_pem(cluster.ca.cert_pem()).unwrap();
        let tls = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let crypto = QuicClientConfig::try_from(tls).unwrap();
        let mut ep = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
        let (client_side, server_side) = handshake(&cluster, &ep).await;
        assert_refused(client_side, server_side).await;
    }

    #[tokio::test]
    async fn client_trusting_another_ca_cannot_connect() {
        let cluster = cluster();
        let other = ClusterCa::generate("test cluster CA").unwrap();
        let ep = client(other.cert_pem(), &cluster.ca.issue_worker(0).unwrap());
        let (client_side, server_side) = handshake(&cluster, &ep).await;
        let err = client_side.unwrap_err();
        assert!(matches!(err, TransportError::Connect { .. }), "{err}");
        assert!(server_side.is_err());
    }

    #[tokio::test]
    async fn server_cert_is_not_a_client_identity() {
        let cluster = cluster();
        let server_id = cluster.ca.issue_server(&["localhost".into()]).unwrap();
        let ep = client(cluster.ca.cert_pem(), &server_id);
        let (client_side, server_side) = handshake(&cluster, &ep).await;
        // Its serverAuth-only usage fails the client verifier; were it ever
        // accepted, it still names no rank.
        match &server_side {
            Ok(conn) => assert!(peer_rank(conn).is_err()),
            Err(_) => assert_refused(client_side, server_side).await,
        }
    }

    #[tokio::test]
    async fn connect_gives_up_after_the_timeout() {
        // A socket that never answers.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let cluster = cluster();
        let ep = client(cluster.ca.cert_pem(), &cluster.ca.issue_worker(0).unwrap());
        let addr = silent.local_addr().unwrap();
        let err = connect(&ep, addr, "localhost", Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(
            matches!(err, TransportError::ConnectTimeout { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("did not finish within"), "{err}");
    }

    /// A connected pair on a fresh cluster, with the endpoints that keep it
    /// alive: (cluster, client endpoint, client side, server side).
    async fn connected() -> (Cluster, Endpoint, Connection, Connection) {
        let cluster = cluster();
        let ep = client(cluster.ca.cert_pem(), &cluster.ca.issue_worker(2).unwrap());
        let (client_side, server_side) = handshake(&cluster, &ep).await;
        let (c, s) = (client_side.unwrap(), server_side.unwrap());
        (cluster, ep, c, s)
    }

    /// Send raw bytes on a new stream from the client, read one frame on the
    /// server.
    async fn send_and_read(bytes: Vec<u8>, limit: usize) -> Result<AlignedVec, TransportError> {
        let (_cluster, _ep, client, server) = connected().await;
        write_and_read(&client, &server, &bytes, limit).await
    }

    /// Write `bytes` on a new stream of `client` while `server` reads one
    /// frame from it.
    async fn write_and_read(
        client: &Connection,
        server: &Connection,
        bytes: &[u8],
        limit: usize,
    ) -> Result<AlignedVec, TransportError> {
        let writer = async {
            let (mut send, _recv) = client.open_bi().await.unwrap();
            write_frame(&mut send, bytes).await.unwrap();
            send
        };
        let reader = async {
            let (_send, mut recv) = server.accept_bi().await.unwrap();
            read_frame(&mut recv, limit).await
        };
        let (_send, read) = tokio::join!(writer, reader);
        read
    }

    #[tokio::test]
    async fn read_frame_refuses_a_short_stream_claiming_a_huge_frame() {
        let mut bytes = (256u32 << 20).to_le_bytes().to_vec();
        bytes.extend_from_slice(&[7u8; 10]);
        let err = send_and_read(bytes, 512 << 20).await.unwrap_err();
        assert!(matches!(err, TransportError::Read(_)), "{err}");
        assert!(err.to_string().contains("after 10 of 268435456"), "{err}");
    }

    #[tokio::test]
    async fn read_frame_enforces_the_limit() {
        let mut bytes = 1000u32.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[1u8; 1000]);
        let err = send_and_read(bytes, 999).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Protocol(ProtocolError::FrameTooLarge { .. })
            ),
            "{err}"
        );
    }

    #[tokio::test]
    async fn read_frame_reads_a_large_frame_whole() {
        let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut bytes = (payload.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&payload);
        let read = send_and_read(bytes, 4 << 20).await.unwrap();
        assert_eq!(&read[..], &payload[..]);
        assert!((read.as_ptr() as usize).is_multiple_of(16));
    }

    #[tokio::test]
    async fn call_round_trips_over_mutual_tls() {
        let (_cluster, _ep, client, server) = connected().await;
        let serve = async {
            let (mut send, mut recv) = server.accept_bi().await.unwrap();
            let req = decode_request(&read_frame(&mut recv, 1 << 20).await.unwrap()).unwrap();
            assert_eq!(req, Request::Bye { finished: true });
            let frame = encode_response(&Response::ByeAck).unwrap();
            write_frame(&mut send, &frame).await.unwrap();
            send
        };
        let (_send, reply) = tokio::join!(
            serve,
            call(&client, &Request::Bye { finished: true }, 1 << 20)
        );
        assert_eq!(reply.unwrap().0, Response::ByeAck);
    }

    /// Write `bytes` as far as flow control lets the stream go without
    /// waiting for the peer; returns how many were taken.
    fn write_until_blocked(send: &mut SendStream, bytes: &[u8]) -> usize {
        use futures::FutureExt;
        let mut taken = 0;
        while taken < bytes.len() {
            match send.write(&bytes[taken..]).now_or_never() {
                Some(Ok(n)) => taken += n,
                _ => break,
            }
        }
        taken
    }

    #[tokio::test]
    async fn before_hello_a_peer_gets_one_stream_and_a_small_window() {
        let (_cluster, _ep, client, server) = connected().await;
        let (mut send, _recv) = client.open_bi().await.unwrap();
        let flood = vec![0u8; 4 << 20];
        let taken = write_until_blocked(&mut send, &flood);
        assert!(
            taken <= PRE_HELLO_RECEIVE_WINDOW as usize,
            "{taken} bytes taken"
        );
        {
            use futures::FutureExt;
            assert!(
                client.open_bi().now_or_never().is_none(),
                "a second stream opened before Hello"
            );
        }
        // After Hello the streams and the window open.
        let limits = EndpointLimits::default();
        open_after_hello(&server, &limits);
        let (_s, mut r) = server.accept_bi().await.unwrap();
        let drain = async {
            let mut got = 0usize;
            while got < 1 << 20 {
                match r.read_chunk(usize::MAX, true).await {
                    Ok(Some(c)) => got += c.bytes.len(),
                    _ => break,
                }
            }
            got
        };
        let more = async {
            send.write_all(&flood[..1 << 20]).await.unwrap();
            tokio::time::timeout(WAIT, client.open_bi()).await
        };
        let (got, second) = tokio::join!(drain, more);
        assert!(got >= 1 << 20, "{got}");
        assert!(matches!(second, Ok(Ok(_))), "no second stream after Hello");
        assert!(limits.server_receive_window() >= 2 * limits.server_stream_window());
        println!(
            "before Hello: {taken} of {} bytes taken; after: streams {}, windows {} per stream, {} per connection",
            flood.len(),
            limits.max_bidi_streams,
            limits.server_stream_window(),
            limits.server_receive_window()
        );
    }

    #[tokio::test]
    async fn budgeted_frames_reserve_their_length_and_stalls_end_them() {
        let (_cluster, _ep, client, server) = connected().await;
        open_after_hello(&server, &EndpointLimits::default());
        let budget = FrameBudget::new(1000);
        let frame = |len: u32, sent: usize| {
            let mut b = len.to_le_bytes().to_vec();
            b.extend(std::iter::repeat_n(9u8, sent));
            b
        };
        let stall = Duration::from_millis(200);
        // Two frames of 600: the second is read once the first is given back.
        let mut sends = Vec::new();
        for _ in 0..2 {
            let (mut send, _r) = client.open_bi().await.unwrap();
            write_frame(&mut send, &frame(600, 600)).await.unwrap();
            sends.push(send);
        }
        let (_s1, mut r1) = server.accept_bi().await.unwrap();
        let first = read_frame_budgeted(&mut r1, 1 << 20, stall, &budget)
            .await
            .unwrap();
        assert_eq!((first.payload.len(), budget.available()), (600, 400));
        let (_s2, mut r2) = server.accept_bi().await.unwrap();
        let second = async { read_frame_budgeted(&mut r2, 1 << 20, stall, &budget).await };
        let release = async { drop(first) };
        let (second, ()) = tokio::join!(second, release);
        assert_eq!(second.unwrap().payload.len(), 600);
        assert_eq!(budget.available(), 1000);
        // Larger than the budget: refused before any payload is read.
        let (mut send, _r) = client.open_bi().await.unwrap();
        write_frame(&mut send, &frame(1001, 10)).await.unwrap();
        let (_s3, mut r3) = server.accept_bi().await.unwrap();
        let err = read_frame_budgeted(&mut r3, 1 << 20, stall, &budget)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Protocol(ProtocolError::FrameTooLarge { .. })
            ),
            "{err}"
        );
        // A frame that stops half-way gives its reservation back at the
        // stall deadline.
        let (mut send, _r) = client.open_bi().await.unwrap();
        send.write_all(&frame(900, 100)).await.unwrap();
        let (_s4, mut r4) = server.accept_bi().await.unwrap();
        let err = read_frame_budgeted(&mut r4, 1 << 20, stall, &budget)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Stalled {
                    received: 100,
                    expected: 900,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(budget.available(), 1000);
    }

    /// Traffic over loopback until path MTU discovery has settled above
    /// 1452 or 200 frames went by: the client side's MTU at the end.
    async fn mtu_after_traffic(limits: &EndpointLimits) -> u16 {
        let cluster = cluster_with(limits);
        let worker = cluster.ca.issue_worker(0).unwrap();
        let ep = client_endpoint(cluster.ca.cert_pem(), &worker, false, limits).unwrap();
        let (c, s) = handshake(&cluster, &ep).await;
        let (client, server) = (c.unwrap(), s.unwrap());
        let mut frame = (60_000u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&[5u8; 60_000]);
        for _ in 0..200 {
            if client.stats().path.current_mtu > DEFAULT_MAX_UDP_PAYLOAD {
                break;
            }
            let read = write_and_read(&client, &server, &frame, 1 << 20).await;
            assert_eq!(read.unwrap().len(), 60_000);
        }
        client.stats().path.current_mtu
    }

    #[tokio::test]
    async fn jumbo_payloads_are_discovered_where_the_path_carries_them() {
        // Loopback carries 64 KiB datagrams: with a bound of 8952 the
        // connection moves past Ethernet's 1452; with the default it never
        // probes beyond it.
        let jumbo = EndpointLimits {
            max_udp_payload: 8952,
            ..Default::default()
        };
        let mtu = mtu_after_traffic(&jumbo).await;
        assert!(mtu > DEFAULT_MAX_UDP_PAYLOAD && mtu <= 8952, "{mtu}");
        let plain = mtu_after_traffic(&EndpointLimits::default()).await;
        assert!(plain <= DEFAULT_MAX_UDP_PAYLOAD, "{plain}");
    }

    #[test]
    fn limits_are_checked() {
        assert!(EndpointLimits::default().transport_config().is_ok());
        let tiny_payload = EndpointLimits {
            max_udp_payload: 1199,
            ..Default::default()
        };
        assert!(tiny_payload.transport_config().is_err());
        let zero_idle = EndpointLimits {
            idle_timeout: Duration::ZERO,
            ..Default::default()
        };
        assert!(zero_idle.transport_config().is_err());
        let slow_keep_alive = EndpointLimits {
            keep_alive: Duration::from_secs(10),
            ..Default::default()
        };
        assert!(slow_keep_alive.transport_config().is_err());
        let no_keep_alive = EndpointLimits {
            keep_alive: Duration::ZERO,
            ..Default::default()
        };
        assert!(no_keep_alive.transport_config().is_ok());
    }
}
