//! Admission under attack: QUIC address validation, a flood of handshakes
//! that never finish, and the memory one connection can make a server hold
//! before and after Hello.
//!
//! The flood and spoofing tests run a server in this process and watch it
//! through its connection counts and the packets it sends. The memory test
//! runs a real `ps-server` child process and reads its peak resident size
//! (`VmHWM` in `/proc/<pid>/status`) after each attack has been ended by
//! the server's own deadlines. Everything runs on loopback, in bounded
//! loops.

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use quinn::Connection;
use tokio::net::UdpSocket;
use tokio::sync::watch;

use ps_net::protocol::{ErrorCode, Response};
use ps_net::transport::{self, EndpointLimits};
use ps_shared::config::{ClusterConfig, CompressionKind};
use ps_tests::{hello, server_binary, start_loopback_server, test_config, TestPki};

const CONNECT: Duration = Duration::from_secs(10);
/// Upper bound on every wait, so a bug cannot hang the suite.
const EVENT_BOUND: Duration = Duration::from_secs(60);

fn one_worker_config() -> ClusterConfig {
    let mut cfg = test_config(CompressionKind::Topk, 0.01, 1);
    cfg.cluster.workers = 1;
    cfg.validate().expect("valid");
    cfg
}

/// Whether a QUIC v1 datagram starts with a Retry packet (long header,
/// type 3).
fn is_retry(datagram: &[u8]) -> bool {
    datagram
        .first()
        .is_some_and(|b| b & 0x80 != 0 && (b >> 4) & 0x3 == 0x3)
}

/// What one [`silent_proxy`] saw.
#[derive(Default)]
struct ProxySeen {
    /// The client's first datagram (its Initial with the ClientHello).
    first_initial: Option<Vec<u8>>,
    /// The server's first reply was a Retry.
    retried: bool,
    /// The server answered with handshake packets: it admitted the
    /// connection.
    admitted: bool,
}

/// A UDP relay on `bind` between one client and `server` that passes the
/// client's datagrams only until the server answers with something other
/// than a Retry: the server then holds a connection whose client sent a
/// ClientHello (and echoed a Retry token) and never another byte, no
/// certificate, no Finished. Returns the relay's address and what it saw.
async fn silent_proxy(
    bind: &str,
    server: SocketAddr,
) -> (SocketAddr, watch::Receiver<Rc<RefCell<ProxySeen>>>) {
    let socket = UdpSocket::bind(bind).await.expect("bind the relay");
    let addr = socket.local_addr().expect("relay address");
    let seen = Rc::new(RefCell::new(ProxySeen::default()));
    let (tx, rx) = watch::channel(seen.clone());
    tokio::task::spawn_local(async move {
        let mut client = None;
        let mut buf = vec![0u8; 65536];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                return;
            };
            let datagram = &buf[..n];
            if from == server {
                {
                    let mut s = seen.borrow_mut();
                    if is_retry(datagram) {
                        s.retried |= !s.admitted;
                    } else {
                        s.admitted = true;
                    }
                }
                tx.send_modify(|_| {});
                if let Some(c) = client {
                    let _ = socket.send_to(datagram, c).await;
                }
            } else {
                client = Some(from);
                let pass = {
                    let mut s = seen.borrow_mut();
                    s.first_initial.get_or_insert_with(|| datagram.to_vec());
                    !s.admitted
                };
                tx.send_modify(|_| {});
                if pass {
                    let _ = socket.send_to(datagram, server).await;
                }
            }
        }
    });
    (addr, rx)
}

/// A client endpoint that presents no certificate (it never gets to).
fn certless_client(pki: &TestPki) -> quinn::Endpoint {
    let tls = pki.worker(0);
    transport::client_endpoint(
        &tls.ca_pem,
        &tls.identity,
        false,
        &EndpointLimits::default(),
    )
    .expect("client endpoint")
}

/// One handshake that never finishes, from `bind` through a silent relay;
/// resolves once the server has admitted it. Returns what keeps it alive
/// and what the relay saw.
async fn unfinished_handshake(
    pki: &TestPki,
    bind: &str,
    server: SocketAddr,
) -> (quinn::Endpoint, quinn::Connecting, Rc<RefCell<ProxySeen>>) {
    let (relay, mut seen) = silent_proxy(bind, server).await;
    let ep = certless_client(pki);
    let connecting = ep.connect(relay, "localhost").expect("connect");
    let seen = tokio::time::timeout(EVENT_BOUND, seen.wait_for(|s| s.borrow().admitted))
        .await
        .expect("the server answered the handshake")
        .expect("relay running")
        .clone();
    (ep, connecting, seen)
}

#[test]
fn a_flood_of_unfinished_handshakes_cannot_keep_a_worker_out() {
    let mut cfg = one_worker_config();
    cfg.server.max_unauthenticated = 4;
    cfg.server.max_unauthenticated_per_source = 2;
    // The flood's connections would stay for the whole test.
    cfg.server.hello_timeout_secs = 60.0;
    cfg.server.idle_timeout_secs = 60.0;
    cfg.validate().expect("valid");
    let pki = TestPki::new(1);
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        let addr = server.local_addr();
        let limit = cfg.server.max_frame_bytes;
        // The flood comes from 127.0.0.2, the worker from 127.0.0.1.
        const FLOOD: usize = 12;
        let mut alive = Vec::new();
        for _ in 0..FLOOD {
            alive.push(unfinished_handshake(&pki, "127.0.0.2:0", addr).await);
        }
        let (open, pre_hello) = server.connections();
        assert!(pre_hello <= 2, "{pre_hello} connections from one address before Hello");
        let retried = alive.iter().filter(|(_, _, s)| s.borrow().retried).count();
        assert_eq!(retried, FLOOD, "every first Initial is answered with a Retry");

        // A worker connects while the flood keeps coming (one more
        // unfinished handshake between its connect and its Hello).
        let tls = pki.worker(0);
        let ep = transport::client_endpoint(&tls.ca_pem, &tls.identity, false, &EndpointLimits::default()).unwrap();
        let conn = transport::connect(&ep, addr, "localhost", CONNECT).await.expect("worker connects");
        alive.push(unfinished_handshake(&pki, "127.0.0.2:0", addr).await);
        let (resp, _) = transport::call(&conn, &hello(&cfg, 0), limit).await.expect("Hello answered");
        assert!(matches!(resp, Response::Welcome { .. }), "{resp:?}");
        let after = server.wait_connections(|c| c.0 - c.1 == 1).await;
        assert!(after.1 <= 2, "{after:?}");
        println!(
            "flood: {} handshakes from 127.0.0.2 that never finish, every first Initial answered with a Retry; server held {open} connections ({pre_hello} before Hello) at most 2 from that address; then a worker from 127.0.0.1 was welcomed (connections {}, {} before Hello)",
            alive.len(),
            after.0,
            after.1
        );
        drop(alive);
        server.abort().await;
    });
}

#[test]
fn a_spoofed_source_gets_a_retry_and_leaves_no_state() {
    let cfg = one_worker_config();
    let pki = TestPki::new(1);
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        let addr = server.local_addr();
        // A real client's first Initial, captured by a relay.
        let (_ep, _connecting, seen) = unfinished_handshake(&pki, "127.0.0.1:0", addr).await;
        let initial = seen.borrow().first_initial.clone().expect("an Initial");
        let _ = server.wait_connections(|c| c.1 == 1).await;
        // Replayed from addresses that never answer: each gets a Retry and
        // the server keeps nothing.
        const SPOOFED: usize = 32;
        let mut retries = 0;
        for _ in 0..SPOOFED {
            let socket = UdpSocket::bind("127.0.0.3:0").await.expect("bind");
            socket.send_to(&initial, addr).await.expect("send");
            let mut buf = vec![0u8; 2048];
            let (n, _) = tokio::time::timeout(EVENT_BOUND, socket.recv_from(&mut buf))
                .await
                .expect("the server answers")
                .expect("recv");
            retries += usize::from(is_retry(&buf[..n]));
        }
        assert_eq!(retries, SPOOFED);
        assert_eq!(server.connections(), (1, 1), "only the real client's connection");
        assert_eq!(server.quic_connections(), 1);
        println!(
            "spoofing: {SPOOFED} replayed Initials from 127.0.0.3 answered with {retries} Retries; the server holds {} QUIC connection (the real client's)",
            server.quic_connections()
        );
        server.abort().await;
    });
}

#[cfg(target_os = "linux")]
mod memory {
    //! The memory one connection can make a `ps-server` process hold.

    use super::*;
    use std::io::{BufRead, BufReader};
    use std::path::Path;
    use std::process::Child;

    use ps_net::transport::PRE_HELLO_RECEIVE_WINDOW;
    use ps_tests::{
        config_file_with_certs, free_udp_port, server_run_command, tls_files_under,
        worker_tls_from_files,
    };
    use ps_worker::comm::WorkerTls;

    const MIB: u64 = 1 << 20;
    /// Connections of the attack before Hello.
    const PRE_HELLO_CONNS: usize = 8;
    /// Streams each of them tries beyond the Hello stream, and what it
    /// tries to send on each.
    const PRE_HELLO_STREAMS: usize = 3;
    const PRE_HELLO_STREAM_BYTES: usize = 32 << 20;
    /// The largest frame the server accepts, and the frames the attack
    /// after Hello starts on every stream it may open.
    const MAX_FRAME: usize = 40_000_000;
    const PARTIAL_FRAME_BYTES: usize = 16 << 20;
    /// What one connection may cost before Hello beyond its receive
    /// window: QUIC and TLS state, and task memory.
    const PRE_HELLO_STATE: u64 = 512 << 10;
    /// Slack of a connection after Hello beyond its receive window and
    /// frame budget: the packet buffers the received bytes sit in (a
    /// buffer is freed only once every stream's bytes in it are read), the
    /// connection's state and the allocator. Measured growth in eight runs:
    /// 48 to 71 MiB in all (a 25 MiB window, one 16 MiB partial frame read
    /// at a time, against 95 MiB allowed; the unbounded server grew 370 MiB).
    const POST_HELLO_SLACK: u64 = 32 * MIB;

    /// `VmHWM` (peak) and `VmRSS` (now) of `pid`, in bytes.
    fn memory_of(pid: u32) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kb| kb * 1024)
                .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
        };
        (field("VmHWM:"), field("VmRSS:"))
    }

    fn mib(b: u64) -> f64 {
        b as f64 / MIB as f64
    }

    struct Server {
        child: Child,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Start `ps-server run` and wait for its "listening" line.
    fn start(bin: &Path, config: &Path, token: &str) -> Server {
        let mut child = server_run_command(bin, config, token)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut told = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if !told && line.contains("ps-server listening") {
                    told = tx.send(()).is_ok();
                }
            }
        });
        let server = Server { child };
        rx.recv_timeout(EVENT_BOUND)
            .expect("ps-server logged that it listens");
        server
    }

    /// Write `data` to a new stream of `conn` until the connection ends;
    /// returns the bytes the transport took (the server's flow credit).
    async fn push_stream(conn: &Connection, data: &[u8], taken: &Cell<u64>) {
        let Ok((mut send, _recv)) = conn.open_bi().await else {
            return;
        };
        let mut at = 0;
        while at < data.len() {
            match send.write(&data[at..]).await {
                Ok(n) => {
                    at += n;
                    taken.set(taken.get() + n as u64);
                }
                Err(_) => return,
            }
        }
        // Never finish: the server must end it.
        let _ = conn.closed().await;
    }

    /// Before Hello: a certificate holder opens streams and sends as much
    /// as it can, starting a Hello it never finishes; ends when the server
    /// closes the connection at its Hello deadline.
    async fn pre_hello_attack(conn: Connection, data: Arc<Vec<u8>>, taken: Rc<Cell<u64>>) {
        let attack = async {
            let Ok((mut s0, _r0)) = conn.open_bi().await else {
                return;
            };
            // A Hello header of 4000 bytes and 100 of them.
            let mut partial = 4000u32.to_le_bytes().to_vec();
            partial.extend_from_slice(&[1u8; 100]);
            if s0.write_all(&partial).await.is_err() {
                return;
            }
            taken.set(taken.get() + partial.len() as u64);
            let streams = (0..PRE_HELLO_STREAMS).map(|_| push_stream(&conn, &data, &taken));
            futures::future::join_all(streams).await;
        };
        tokio::select! {
            _ = attack => {}
            _ = conn.closed() => {}
        }
        let _ = tokio::time::timeout(EVENT_BOUND, conn.closed()).await;
    }

    /// After Hello: every stream the server allows starts a frame of
    /// nearly `MAX_FRAME` bytes and sends `PARTIAL_FRAME_BYTES` of it;
    /// ends when the server has answered every stream. Returns the
    /// answers' error codes.
    async fn post_hello_attack(
        conn: &Connection,
        streams: usize,
        data: &[u8],
        taken: &Cell<u64>,
    ) -> Vec<Option<ErrorCode>> {
        let one = || async {
            let Ok((mut send, mut recv)) = conn.open_bi().await else {
                return None;
            };
            // Never finishes: a refused stream's writes fail, and then it
            // only waits for the answer.
            let push = async {
                let declared = (MAX_FRAME as u32 - 1000).to_le_bytes();
                if send.write_all(&declared).await.is_ok() {
                    let mut at = 0;
                    while at < data.len() {
                        let Ok(n) = send.write(&data[at..]).await else {
                            break;
                        };
                        at += n;
                        taken.set(taken.get() + n as u64);
                    }
                }
                std::future::pending::<()>().await
            };
            let answer = async {
                transport::read_frame(&mut recv, 1 << 20)
                    .await
                    .ok()
                    .and_then(|p| ps_net::protocol::decode_response(&p).ok())
            };
            let resp = tokio::select! {
                _ = push => None,
                r = answer => r,
            };
            match resp {
                Some(Response::Error { code, .. }) => Some(code),
                _ => None,
            }
        };
        let all = (0..streams).map(|_| one());
        tokio::time::timeout(EVENT_BOUND, futures::future::join_all(all))
            .await
            .expect("the server answered every stream")
    }

    #[test]
    fn server_memory_stays_within_the_connection_budget() {
        let bin = server_binary();
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_udp_port();
        let mut cfg = one_worker_config();
        cfg.cluster.servers = vec![format!("127.0.0.1:{port}")];
        cfg.server.max_frame_bytes = MAX_FRAME;
        cfg.server.max_unauthenticated_per_source = PRE_HELLO_CONNS;
        cfg.server.hello_timeout_secs = 2.0;
        cfg.server.heartbeat_secs = 0.5;
        cfg.server.idle_timeout_secs = 1.0;
        cfg.server.request_timeout_secs = 4.0;
        cfg.server.worker_timeout_secs = 30.0;
        tls_files_under(&mut cfg, &dir.path().join("certs"));
        cfg.validate().expect("valid config");
        let config_path = config_file_with_certs(&cfg, dir.path());
        let token = cfg.cluster.token.clone();
        let WorkerTls { ca_pem, identity } = worker_tls_from_files(&cfg, 0);
        let limits = ps_server::net::endpoint_limits(&cfg);
        let frame_budget = ps_server::net::frame_budget_bytes(&cfg) as u64;
        let window = limits.server_receive_window();

        // Each attack on a fresh process, so that neither's peak hides the
        // other's.
        let server = start(&bin, &config_path, &token);
        let pid = server.child.id();
        let system = actix::System::new();
        system.block_on(async move {
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            let client = || transport::client_endpoint(&ca_pem, &identity, false, &EndpointLimits::default()).expect("client endpoint");
            let (_, base) = memory_of(pid);

            // (a) Before Hello.
            let data = Arc::new(vec![7u8; PRE_HELLO_STREAM_BYTES]);
            let taken_a = Rc::new(Cell::new(0u64));
            let mut attacks = Vec::new();
            let mut endpoints = Vec::new();
            for _ in 0..PRE_HELLO_CONNS {
                let ep = client();
                let conn = transport::connect(&ep, addr, "localhost", CONNECT).await.expect("connect");
                endpoints.push(ep);
                attacks.push(pre_hello_attack(conn, data.clone(), taken_a.clone()));
            }
            futures::future::join_all(attacks).await;
            let (peak_a, _) = memory_of(pid);
            let grew_a = peak_a.saturating_sub(base);
            let budget_a = PRE_HELLO_CONNS as u64 * (u64::from(PRE_HELLO_RECEIVE_WINDOW) + PRE_HELLO_STATE);
            println!(
                "memory before Hello: {PRE_HELLO_CONNS} connections tried {:.0} MiB, the server's flow control let {:.1} KiB through; peak RSS {:.1} MiB over a {:.1} MiB baseline (+{:.2} MiB; budget {:.2} MiB = {PRE_HELLO_CONNS} x ({} KiB window + {} KiB state))",
                mib((PRE_HELLO_CONNS * PRE_HELLO_STREAMS * PRE_HELLO_STREAM_BYTES) as u64),
                taken_a.get() as f64 / 1024.0,
                mib(peak_a),
                mib(base),
                mib(grew_a),
                mib(budget_a),
                PRE_HELLO_RECEIVE_WINDOW >> 10,
                PRE_HELLO_STATE >> 10
            );

            drop(endpoints);
            drop(server);

            // (b) After Hello: every stream a connection may open.
            let server = start(&bin, &config_path, &token);
            let pid = server.child.id();
            let (_, base) = memory_of(pid);
            let ep = client();
            let conn = transport::connect(&ep, addr, "localhost", CONNECT).await.expect("connect");
            let (resp, _) = transport::call(&conn, &hello(&cfg, 0), cfg.server.max_frame_bytes).await.expect("Hello");
            assert!(matches!(resp, Response::Welcome { .. }), "{resp:?}");
            let (_, base_b) = memory_of(pid);
            let base_b = base_b.max(base);
            let partial = vec![3u8; PARTIAL_FRAME_BYTES];
            let taken_b = Cell::new(0u64);
            let streams = limits.max_bidi_streams as usize;
            let codes = post_hello_attack(&conn, streams, &partial, &taken_b).await;
            let (peak_b, _) = memory_of(pid);
            let grew_b = peak_b.saturating_sub(base_b);
            let budget_b = window + frame_budget + POST_HELLO_SLACK;
            let answered = codes.iter().filter(|c| c.is_some()).count();
            println!(
                "memory after Hello: {streams} streams each started a {:.0} MB frame and sent {:.0} MiB of it ({:.0} MiB tried), the server took {:.1} MiB; answers {:?}; peak RSS {:.1} MiB (+{:.1} MiB over {:.1} MiB; budget {:.1} MiB = receive window {:.1} MiB + frame budget {:.1} MiB + {:.0} MiB slack)",
                (MAX_FRAME - 1000) as f64 / 1e6,
                mib(PARTIAL_FRAME_BYTES as u64),
                mib((streams * PARTIAL_FRAME_BYTES) as u64),
                mib(taken_b.get()),
                codes,
                mib(peak_b),
                mib(grew_b),
                mib(base_b),
                mib(budget_b),
                mib(window),
                mib(frame_budget),
                mib(POST_HELLO_SLACK)
            );
            assert_eq!(answered, streams, "every stream was answered: {codes:?}");
            assert!(grew_a <= budget_a, "before Hello the server grew {grew_a} bytes, over {budget_a}");
            assert!(grew_b <= budget_b, "after Hello the server grew {grew_b} bytes, over {budget_b}");
            drop(server);
        });
    }
}
