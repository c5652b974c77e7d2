//! QUIC transport: TLS 1.3 endpoints, dev certificates, and framed calls.
//!
//! One worker keeps one QUIC connection per server process. Each request is a
//! bidirectional stream carrying one request frame and one response frame (see
//! [`crate::protocol`]), so slow requests (a BSP pull waiting for the barrier)
//! never block fast ones.
//!
//! ```no_run
//! # async fn demo() -> Result<(), ps_shared::transport::TransportError> {
//! use ps_shared::transport::{self, DevCert};
//! let cert = DevCert::generate(&["localhost".into()])?;
//! let server = transport::server_endpoint("127.0.0.1:0".parse().unwrap(), &cert.cert_pem, &cert.key_pem)?;
//! let client = transport::client_endpoint(&cert.cert_pem, false)?;
//! let conn = transport::connect(&client, server.local_addr()?, "localhost").await?;
//! # let _ = conn; Ok(()) }
//! ```

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use quinn::{Connection, Endpoint, RecvStream, SendStream};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::protocol::{
    decode_response, encode_request, frame_len, ProtocolError, Request, Response,
    FRAME_HEADER_BYTES,
};

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("TLS setup failed: {0}")]
    Tls(String),
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("socket error: {0}")]
    Socket(#[from] std::io::Error),
    #[error("cannot connect to {addr}: {message}")]
    Connect { addr: String, message: String },
    #[error("connection lost: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("stream write failed: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("stream read failed: {0}")]
    Read(String),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
}

/// A self-signed certificate and its key, PEM encoded.
pub struct DevCert {
    pub cert_pem: String,
    pub key_pem: String,
}

impl DevCert {
    /// A self-signed certificate valid for the given DNS names / IP addresses.
    pub fn generate(names: &[String]) -> Result<Self, TransportError> {
        let ck = rcgen::generate_simple_self_signed(names.to_vec())
            .map_err(|e| TransportError::Tls(e.to_string()))?;
        Ok(Self {
            cert_pem: ck.cert.pem(),
            key_pem: ck.signing_key.serialize_pem(),
        })
    }

    /// Write the pair, creating parent directories; the key is made
    /// owner-readable only.
    pub fn write(&self, cert: &Path, key: &Path) -> Result<(), TransportError> {
        for (path, text) in [(cert, &self.cert_pem), (key, &self.key_pem)] {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(|source| TransportError::Io {
                    path: dir.display().to_string(),
                    source,
                })?;
            }
            std::fs::write(path, text).map_err(|source| TransportError::Io {
                path: path.display().to_string(),
                source,
            })?;
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(key, std::fs::Permissions::from_mode(0o600));
        }
        Ok(())
    }
}

/// Read a PEM file with a message that names it.
pub fn read_pem(path: &Path) -> Result<String, TransportError> {
    std::fs::read_to_string(path).map_err(|source| TransportError::Io {
        path: path.display().to_string(),
        source,
    })
}

fn transport_config() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(1024u32.into());
    t.max_concurrent_uni_streams(0u32.into());
    t.keep_alive_interval(Some(Duration::from_secs(2)));
    if let Ok(idle) = Duration::from_secs(60).try_into() {
        t.max_idle_timeout(Some(idle));
    }
    // Large dense shards travel in one stream: open the windows wide.
    t.stream_receive_window((64u32 << 20).into());
    t.receive_window((256u32 << 20).into());
    t.send_window(256 << 20);
    Arc::new(t)
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

/// A QUIC server endpoint bound to `addr` (TLS 1.3 with the given certificate).
pub fn server_endpoint(
    addr: SocketAddr,
    cert_pem: &str,
    key_pem: &str,
) -> Result<Endpoint, TransportError> {
    let certs = certs_from_pem(cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| TransportError::Tls(format!("bad private key PEM: {e}")))?;
    let mut cfg = quinn::ServerConfig::with_single_cert(certs, key)
        .map_err(|e| TransportError::Tls(e.to_string()))?;
    cfg.transport_config(transport_config());
    Ok(Endpoint::server(cfg, addr)?)
}

/// A QUIC client endpoint that trusts only the certificates in `ca_pem`.
pub fn client_endpoint(ca_pem: &str, ipv6: bool) -> Result<Endpoint, TransportError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs_from_pem(ca_pem)? {
        roots
            .add(cert)
            .map_err(|e| TransportError::Tls(format!("unusable CA certificate: {e}")))?;
    }
    let mut cfg = quinn::ClientConfig::with_root_certificates(Arc::new(roots))
        .map_err(|e| TransportError::Tls(e.to_string()))?;
    cfg.transport_config(transport_config());
    let bind: SocketAddr = if ipv6 {
        "[::]:0".parse().expect("literal address")
    } else {
        "0.0.0.0:0".parse().expect("literal address")
    };
    let mut ep = Endpoint::client(bind)?;
    ep.set_default_client_config(cfg);
    Ok(ep)
}

/// Connect and finish the TLS handshake.
pub async fn connect(
    endpoint: &Endpoint,
    addr: SocketAddr,
    server_name: &str,
) -> Result<Connection, TransportError> {
    let connecting = endpoint
        .connect(addr, server_name)
        .map_err(|e| TransportError::Connect {
            addr: addr.to_string(),
            message: e.to_string(),
        })?;
    connecting.await.map_err(|e| TransportError::Connect {
        addr: addr.to_string(),
        message: e.to_string(),
    })
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
pub async fn read_frame(recv: &mut RecvStream, limit: usize) -> Result<Vec<u8>, TransportError> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    recv.read_exact(&mut header)
        .await
        .map_err(|e| TransportError::Read(e.to_string()))?;
    let len = frame_len(header, limit)?;
    let mut payload = vec![0u8; len];
    recv.read_exact(&mut payload)
        .await
        .map_err(|e| TransportError::Read(e.to_string()))?;
    Ok(payload)
}

/// Write a whole frame and close the sending side.
pub async fn write_frame(send: &mut SendStream, frame: &[u8]) -> Result<(), TransportError> {
    send.write_all(frame).await?;
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
    let frame = encode_request(req)?;
    call_raw(conn, &frame, limit)
        .await
        .map(|r| (r, frame.len()))
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
