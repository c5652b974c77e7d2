//! The same-host path: a worker on a server's own host sends its requests
//! through the server's Unix socket instead of QUIC.
//!
//! Colocated, each worker's push to its own host's server would otherwise
//! cross the encrypted QUIC stack twice (the worker's and the server's) for
//! bytes that never leave the machine. Over loopback that per-byte work is
//! most of a dense step's exchange (docs/benchmarks.md, "Where the dense MLP
//! exchange spends its time").
//!
//! Trust comes from the QUIC session, not from the socket:
//! - a server offers the path (its socket and a fresh random 128-bit key)
//!   in the Welcome of a connection that finished mutual TLS and Hello, and
//!   only to a peer on its own host ([`same_host`]);
//! - every request on the socket starts with that key, and the server
//!   serves it as if it came on that connection: the same rank, the same
//!   frame budget, rate limit and refusals;
//! - the key dies with the connection, and the server also refuses peers
//!   of another user (`SO_PEERCRED`) and keeps its socket in a directory
//!   only its user can enter.
//!
//! A request on the socket is the key, then one frame as on a QUIC stream
//! (4-byte little-endian length and the archive); the reply is one frame.
//! One request per socket connection, as one request per QUIC stream.

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::protocol::{
    decode_response, frame_len, AlignedVec, EncodedFrame, Response, FRAME_HEADER_BYTES,
};
use crate::transport::{Frame, FrameBudget, TransportError};

/// Bytes of the key in front of every request on the socket.
pub const KEY_BYTES: usize = 16;

/// Whether a connection from `peer` to a server whose address on that
/// connection is `local` comes from the server's own host: a loopback
/// peer, or one whose address is the server's own (the same network
/// namespace). IPv4 addresses mapped into IPv6 count as IPv4.
pub fn same_host(peer: IpAddr, local: Option<IpAddr>) -> bool {
    let peer = peer.to_canonical();
    if peer.is_loopback() {
        return true;
    }
    match local.map(|l| l.to_canonical()) {
        Some(local) => !local.is_unspecified() && local == peer,
        None => false,
    }
}

/// Send `frame` to the server's socket at `path` with `key`, and read its
/// reply (at most `limit` bytes). Returns the reply and its payload's
/// bytes, copied once into the aligned buffer they were validated in.
pub async fn call(
    path: &Path,
    key: &[u8; KEY_BYTES],
    frame: &EncodedFrame,
    limit: usize,
) -> Result<(Response, usize), TransportError> {
    let mut stream = UnixStream::connect(path).await?;
    let mut head = [0u8; KEY_BYTES + FRAME_HEADER_BYTES];
    head[..KEY_BYTES].copy_from_slice(key);
    head[KEY_BYTES..].copy_from_slice(&frame.header());
    stream.write_all(&head).await?;
    stream.write_all(frame.payload()).await?;
    let mut header = [0u8; FRAME_HEADER_BYTES];
    stream
        .read_exact(&mut header)
        .await
        .map_err(|e| TransportError::Read(format!("frame header: {e}")))?;
    let len = frame_len(header, limit)?;
    let mut payload = zeroed(len);
    stream
        .read_exact(&mut payload[..])
        .await
        .map_err(|e| TransportError::Read(format!("frame payload: {e}")))?;
    Ok((decode_response(&payload)?, len))
}

/// Read the key in front of a request, each byte within `stall`.
pub async fn read_key<R: AsyncRead + Unpin>(
    r: &mut R,
    stall: Duration,
) -> Result<[u8; KEY_BYTES], TransportError> {
    let mut key = [0u8; KEY_BYTES];
    read_within(r, &mut key, stall).await?;
    Ok(key)
}

/// Read one request frame from `r` as [`crate::transport::read_frame_budgeted`]
/// does from a QUIC stream: the declared length is reserved in `budget`
/// before the payload is read, and every read must bring a byte within
/// `stall`.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limit: usize,
    stall: Duration,
    budget: &FrameBudget,
) -> Result<Frame, TransportError> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    read_within(r, &mut header, stall).await?;
    let (len, reserved) = budget.reserve_frame(header, limit).await?;
    let mut payload = zeroed(len);
    read_within(r, &mut payload[..], stall).await?;
    Ok(Frame::reserved(payload, reserved))
}

/// Write a reply frame and close the writing side.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    frame: &EncodedFrame,
) -> Result<(), TransportError> {
    w.write_all(&frame.header()).await?;
    w.write_all(frame.payload()).await?;
    w.shutdown().await?;
    Ok(())
}

/// An aligned buffer of `len` zero bytes, to read a payload into.
fn zeroed(len: usize) -> AlignedVec {
    let mut v = AlignedVec::with_capacity(len);
    v.resize(len, 0);
    v
}

/// Fill `buf` from `r`, each read bringing a byte within `stall`.
async fn read_within<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut [u8],
    stall: Duration,
) -> Result<(), TransportError> {
    let mut got = 0;
    while got < buf.len() {
        let n = tokio::time::timeout(stall, r.read(&mut buf[got..]))
            .await
            .map_err(|_| TransportError::Stalled {
                stall,
                received: got,
                expected: buf.len(),
            })?
            .map_err(|e| TransportError::Read(e.to_string()))?;
        if n == 0 {
            return Err(TransportError::Read(format!(
                "stream ended after {got} of {} bytes",
                buf.len()
            )));
        }
        got += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{
        decode_request, encode_request_frame, encode_response_frame, ProtocolError, Request,
    };
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn only_loopback_and_the_servers_own_address_are_the_same_host() {
        let a = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
        let b = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
        let mapped = IpAddr::V6(Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped());
        assert!(same_host(Ipv4Addr::LOCALHOST.into(), None));
        assert!(same_host(Ipv6Addr::LOCALHOST.into(), Some(a)));
        assert!(same_host(a, Some(a)));
        assert!(same_host(mapped, Some(a)));
        assert!(same_host(a, Some(mapped)));
        assert!(!same_host(b, Some(a)));
        assert!(!same_host(a, None));
        assert!(!same_host(
            Ipv4Addr::UNSPECIFIED.into(),
            Some(Ipv4Addr::UNSPECIFIED.into())
        ));
    }

    #[tokio::test]
    async fn a_request_crosses_the_socket_with_its_key_and_gets_its_reply() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ps.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let key = [9u8; KEY_BYTES];
        let budget = FrameBudget::new(1 << 20);
        let server = {
            let budget = budget.clone();
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                let stall = Duration::from_secs(10);
                let got = read_key(&mut s, stall).await.unwrap();
                let frame = read_frame(&mut s, 1 << 20, stall, &budget).await.unwrap();
                // The frame holds its share of the budget while it lives.
                assert_eq!(budget.available(), budget.bytes() - frame.payload.len());
                let req = decode_request(&frame.payload).unwrap();
                let reply = encode_response_frame(&Response::HeartbeatAck).unwrap();
                write_frame(&mut s, &reply).await.unwrap();
                (got, req)
            })
        };
        let frame = encode_request_frame(&Request::Heartbeat).unwrap();
        let (resp, _) = call(&path, &key, &frame, 1 << 20).await.unwrap();
        assert_eq!(resp, Response::HeartbeatAck);
        let (got, req) = server.await.unwrap();
        assert_eq!(got, key);
        assert_eq!(req, Request::Heartbeat);
        assert_eq!(budget.available(), budget.bytes());
    }

    #[tokio::test]
    async fn a_frame_over_the_limit_or_cut_short_is_an_error() {
        let budget = FrameBudget::new(64);
        let stall = Duration::from_secs(10);
        let mut big: &[u8] = &[65, 0, 0, 0];
        assert!(matches!(
            read_frame(&mut big, 1 << 20, stall, &budget).await,
            Err(TransportError::Protocol(
                ProtocolError::FrameTooLarge { .. }
            ))
        ));
        let mut short: &[u8] = &[8, 0, 0, 0, 1, 2];
        assert!(matches!(
            read_frame(&mut short, 1 << 20, stall, &budget).await,
            Err(TransportError::Read(_))
        ));
        assert_eq!(budget.available(), 64);
        // A server that closes without a reply.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ps.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            drop(s);
        });
        let frame = encode_request_frame(&Request::Heartbeat).unwrap();
        assert!(call(&path, &[0; KEY_BYTES], &frame, 1 << 20).await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_stops_mid_key_is_cut_off_after_the_stall() {
        let (mut client, mut server) = tokio::io::duplex(64);
        client.write_all(&[1, 2, 3]).await.unwrap();
        let err = read_key(&mut server, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Stalled {
                    received: 3,
                    expected: KEY_BYTES,
                    ..
                }
            ),
            "{err}"
        );
    }
}
