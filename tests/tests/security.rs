//! Refusals at the edge: TLS trust and client certificates, Hello checks
//! (token, version, layout, rank versus certificate, worker count, a second
//! connection for a live rank), requests before Hello, malformed frames,
//! hostile pushes and the request rate. The server must answer each with a
//! typed error and keep serving, its state untouched.

use std::time::Duration;

use quinn::Connection;

use ps_net::protocol::{
    close, encode_request, ErrorCode, ParamUpdate, Request, Response, WireGrad, WireValues,
};
use ps_net::transport::{self, EndpointLimits};
use ps_shared::config::{ClusterConfig, CompressionKind};
use ps_tests::{hello, start_loopback_server, test_config, TestPki};

const CONNECT: Duration = Duration::from_secs(10);
/// Upper bound on waiting for an event, so a bug cannot hang the suite.
const EVENT_BOUND: Duration = Duration::from_secs(60);

fn error_code(resp: &Response) -> Option<ErrorCode> {
    match resp {
        Response::Error { code, .. } => Some(*code),
        _ => None,
    }
}

/// A connection presenting worker `rank`'s certificate.
async fn connect_as(pki: &TestPki, rank: u32, addr: std::net::SocketAddr) -> Connection {
    let tls = pki.worker(rank);
    let ep = transport::client_endpoint(
        &tls.ca_pem,
        &tls.identity,
        false,
        &EndpointLimits::default(),
    )
    .expect("client endpoint");
    transport::connect(&ep, addr, "localhost", CONNECT)
        .await
        .expect("connect")
}

fn one_worker_config() -> ClusterConfig {
    let mut cfg = test_config(CompressionKind::Topk, 0.01, 1);
    cfg.cluster.workers = 1;
    cfg.validate().expect("valid");
    cfg
}

#[test]
fn server_refuses_bad_clients_and_keeps_serving() {
    let cfg = one_worker_config();
    let pki = TestPki::new(2);
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        let addr = server.local_addr();
        let limit = cfg.server.max_frame_bytes;
        let mut tried = 0u32;
        let mut refused = 0u32;

        // A client that trusts another CA cannot finish TLS, and neither can
        // one whose certificate another CA issued.
        let stranger = TestPki::new(1);
        let other = stranger.worker(0);
        let ep = transport::client_endpoint(&other.ca_pem, &other.identity, false, &EndpointLimits::default()).unwrap();
        tried += 1;
        refused += u32::from(transport::connect(&ep, addr, "localhost", CONNECT).await.is_err());
        let forged = ps_worker::comm::WorkerTls {
            ca_pem: pki.server.ca_pem.clone(),
            identity: stranger.worker(0).identity,
        };
        let ep = transport::client_endpoint(&forged.ca_pem, &forged.identity, false, &EndpointLimits::default()).unwrap();
        tried += 1;
        let forged_conn = transport::connect(&ep, addr, "localhost", CONNECT).await;
        let forged_refused = match forged_conn {
            Err(_) => true,
            Ok(conn) => transport::call(&conn, &hello(&cfg, 0), limit).await.is_err(),
        };
        refused += u32::from(forged_refused);

        // Hellos that must be refused, each on a connection of its own, and
        // the connection closed afterwards.
        let Request::Hello { protocol_version, token, worker_rank, workers, workers_per_node, num_params, layout_hash } = hello(&cfg, 0) else {
            unreachable!()
        };
        let bad = [
            (0, Request::Hello { token: "wrong-token-123".into(), protocol_version, worker_rank, workers, num_params, layout_hash, workers_per_node }, ErrorCode::Unauthorized),
            (0, Request::Hello { protocol_version: protocol_version + 1, token: token.clone(), worker_rank, workers, num_params, layout_hash, workers_per_node }, ErrorCode::VersionMismatch),
            (0, Request::Hello { num_params: num_params + 1, protocol_version, token: token.clone(), worker_rank, workers, layout_hash, workers_per_node }, ErrorCode::LayoutMismatch),
            // Rank 0's certificate speaking for rank 1: impersonation.
            (0, Request::Hello { worker_rank: 1, protocol_version, token: token.clone(), workers, num_params, layout_hash, workers_per_node }, ErrorCode::Unauthorized),
            (0, Request::Hello { workers: 4, protocol_version, token: token.clone(), worker_rank, num_params, layout_hash, workers_per_node }, ErrorCode::WorkerCountMismatch),
            // A certificate for a rank the cluster does not have.
            (1, Request::Hello { worker_rank: 1, protocol_version, token: token.clone(), workers, num_params, layout_hash, workers_per_node }, ErrorCode::UnknownWorker),
            (0, Request::Heartbeat, ErrorCode::Unauthorized),
            (0, Request::Bye { finished: true }, ErrorCode::Unauthorized),
        ];
        for (cert_rank, req, code) in bad {
            let conn = connect_as(&pki, cert_rank, addr).await;
            let (resp, _) = transport::call(&conn, &req, limit).await.unwrap();
            assert_eq!(error_code(&resp), Some(code), "{req:?} got {resp:?}");
            let next = transport::call(&conn, &hello(&cfg, 0), limit).await;
            assert!(next.is_err(), "connection still open after refusal");
            tried += 1;
            refused += 1;
        }
        // Garbage instead of a Hello, and a Hello frame above the pre-auth limit.
        for frame in [vec![5u8, 0, 0, 0, 1, 2, 3, 4, 5], (64u32 << 20).to_le_bytes().to_vec()] {
            let conn = connect_as(&pki, 0, addr).await;
            let resp = transport::call_raw(&conn, &frame, limit).await.unwrap();
            assert_eq!(error_code(&resp), Some(ErrorCode::BadFrame));
            tried += 1;
            refused += 1;
        }

        // The real worker 0 joins; a second connection for the live rank is refused.
        let conn = connect_as(&pki, 0, addr).await;
        let (resp, _) = transport::call(&conn, &hello(&cfg, 0), limit).await.unwrap();
        assert!(matches!(resp, Response::Welcome { .. }), "{resp:?}");
        let twin = connect_as(&pki, 0, addr).await;
        let (resp, _) = transport::call(&twin, &hello(&cfg, 0), limit).await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::RankInUse));
        tried += 1;
        refused += 1;

        // Its offer starts the shard (it is the only worker).
        let n = cfg.model.num_params() / 2;
        let offer = Request::Offer { shard: 0, version: 0, next_step: 0, values: vec![0.5; n] };
        let (resp, _) = transport::call(&conn, &offer, limit).await.unwrap();
        assert!(matches!(resp, Response::Params { version: 0, .. }), "{resp:?}");

        // Garbage and hostile steps on the authenticated connection.
        let resp = transport::call_raw(&conn, &[3, 0, 0, 0, 9, 9, 9], limit).await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::BadFrame));
        tried += 1;
        refused += 1;
        let mut frame = encode_request(&Request::Heartbeat).unwrap();
        frame[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        let resp = transport::call_raw(&conn, &frame, limit).await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::BadFrame));
        tried += 1;
        refused += 1;
        let step = |shard, step, grad| Request::Step { shard, step, have_version: Some(0), rate: 0.0, grad };
        let sparse = |i: Vec<u32>, v: Vec<f32>| WireGrad::Sparse { indices: i, values: WireValues::F32(v) };
        let before = server.status().await;
        for (req, code) in [
            (step(7, 0, sparse(vec![1], vec![1.0])), ErrorCode::UnknownShard),
            (step(0, 0, sparse(vec![n as u32 + 5], vec![1.0])), ErrorCode::OutOfRange),
            (step(0, 0, sparse(vec![2, 1], vec![1.0, 1.0])), ErrorCode::OutOfRange),
            (step(0, 0, sparse(vec![1, 2], vec![1.0])), ErrorCode::WrongLength),
            (step(0, 0, sparse(vec![1], vec![f32::NAN])), ErrorCode::NonFinite),
            (step(0, 3, sparse(vec![1], vec![1.0])), ErrorCode::WrongStep),
            (step(0, 0, WireGrad::Dense(WireValues::F32(vec![1.0; 3]))), ErrorCode::WrongLength),
        ] {
            let (resp, _) = transport::call(&conn, &req, limit).await.unwrap();
            assert_eq!(error_code(&resp), Some(code), "{resp:?}");
            tried += 1;
            refused += 1;
        }
        // ...and the shard is untouched and still serving.
        let after = server.status().await;
        let changed = before
            .iter()
            .zip(&after)
            .filter(|(a, b)| a.version != b.version || a.params != b.params)
            .count();
        assert_eq!(changed, 0);
        let (resp, _) = transport::call(&conn, &step(0, 0, sparse(vec![1], vec![1.0])), limit).await.unwrap();
        match resp {
            Response::Params { version: 1, update: ParamUpdate::Sparse { indices, .. }, .. } => assert_eq!(indices, vec![1]),
            other => panic!("{other:?}"),
        }
        assert_eq!(tried, refused);
        println!("security: bad inputs tried {tried}, refused with typed errors {refused}, shards changed by them {changed}");
        server.abort().await;
    });
}

#[test]
fn request_rate_is_limited_per_connection() {
    let mut cfg = one_worker_config();
    cfg.server.max_requests_per_sec = 5;
    let pki = TestPki::new(1);
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        let limit = cfg.server.max_frame_bytes;
        let conn = connect_as(&pki, 0, server.local_addr()).await;
        let (resp, _) = transport::call(&conn, &hello(&cfg, 0), limit)
            .await
            .unwrap();
        assert!(matches!(resp, Response::Welcome { .. }));
        let (mut ok, mut limited) = (0, 0);
        for _ in 0..30 {
            match transport::call(&conn, &Request::Heartbeat, limit)
                .await
                .unwrap()
                .0
            {
                Response::HeartbeatAck => ok += 1,
                r if error_code(&r) == Some(ErrorCode::RateLimited) => limited += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        // A burst of one second's budget passes; the refill rate is checked
        // on the membership core with a synthetic clock.
        assert!(
            limited >= 20,
            "only {limited} of 30 were limited ({ok} passed)"
        );
        println!("rate limit: {ok} passed, {limited} refused with RateLimited");
        server.abort().await;
    });
}

#[test]
fn unauthenticated_connections_are_capped_and_timed_out() {
    let mut cfg = one_worker_config();
    cfg.server.max_unauthenticated = 3;
    cfg.server.hello_timeout_secs = 3.0;
    let pki = TestPki::new(1);
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        let addr = server.local_addr();
        // Three connections that finish TLS but never say Hello.
        let mut idle = Vec::new();
        for _ in 0..3 {
            idle.push(connect_as(&pki, 0, addr).await);
        }
        let held = tokio::time::timeout(EVENT_BOUND, server.wait_connections(|c| c.1 == 3))
            .await
            .expect("the server counts the three");
        // While they hold every unauthenticated slot, a worker still gets
        // in: the oldest of them makes room.
        let conn = connect_as(&pki, 0, addr).await;
        let (resp, _) = transport::call(&conn, &hello(&cfg, 0), cfg.server.max_frame_bytes).await.unwrap();
        assert!(matches!(resp, Response::Welcome { .. }), "{resp:?}");
        let code = |reason: quinn::ConnectionError| match reason {
            quinn::ConnectionError::ApplicationClosed(c) => Some(u64::from(c.error_code)),
            _ => None,
        };
        let first = tokio::time::timeout(EVENT_BOUND, idle[0].closed()).await.expect("the oldest was closed");
        assert_eq!(code(first), Some(u64::from(close::EVICTED)));
        // The server closes the other silent ones at the Hello deadline (an
        // event: each connection's close; bounded so a bug cannot hang the
        // suite).
        for c in &idle[1..] {
            let reason = tokio::time::timeout(EVENT_BOUND, c.closed()).await;
            assert!(reason.is_ok(), "a connection without Hello stayed open");
        }
        let after = server.wait_connections(|c| c.1 == 0).await;
        assert_eq!(after, (1, 0));
        println!(
            "limits: {} connections held every slot before Hello ({held:?}); a worker was welcomed, the oldest evicted, the other {} closed at the Hello deadline",
            idle.len(),
            idle.len() - 1
        );
        server.abort().await;
    });
}

#[test]
fn a_parked_reply_is_dropped_when_its_connection_closes() {
    // Two ranks, so rank 0's push waits at the barrier for rank 1's.
    let cfg = test_config(CompressionKind::Topk, 0.01, 1);
    let pki = TestPki::new(2);
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        let addr = server.local_addr();
        let limit = cfg.server.max_frame_bytes;
        let mut conns = Vec::new();
        let mut shard0 = None;
        for rank in 0..2 {
            let conn = connect_as(&pki, rank, addr).await;
            let (resp, _) = transport::call(&conn, &hello(&cfg, rank), limit).await.unwrap();
            let Response::Welcome { shards, .. } = resp else {
                panic!("rank {rank} was not welcomed: {resp:?}");
            };
            shard0 = shards.into_iter().find(|s| s.shard == 0);
            conns.push(conn);
        }
        let shard0 = shard0.expect("the server holds shard 0");
        let n = (shard0.hi - shard0.lo) as usize;
        // Both ranks offer their copy, so shard 0 starts serving.
        let offer = Request::Offer { shard: 0, version: 0, next_step: 0, values: vec![0.5; n] };
        let offers = conns.iter().map(|c| transport::call(c, &offer, limit));
        for resp in futures::future::join_all(offers).await {
            let (resp, _) = resp.unwrap();
            assert!(matches!(resp, Response::Params { version: 0, .. }), "{resp:?}");
        }
        let push = |grad_at: u32| Request::Step {
            shard: 0,
            step: 0,
            have_version: Some(0),
            rate: 0.0, grad: WireGrad::Sparse { indices: vec![grad_at], values: WireValues::F32(vec![1.0]) },
        };
        // Rank 0 pushes step 0; its reply waits for rank 1 at the barrier.
        let conn0 = conns[0].clone();
        let first = push(1);
        let pending = tokio::task::spawn_local(async move { transport::call(&conn0, &first, limit).await });
        let waiting = tokio::time::timeout(EVENT_BOUND, server.waiting_replies(0, |n| *n == 1))
            .await
            .expect("the push reached the shard");
        assert_eq!(waiting, Some(1));
        let before = server.status().await.into_iter().find(|s| s.shard == 0).unwrap();
        assert_eq!((before.parked, before.waiting_replies, before.version), (1, 1, 0));

        // Rank 0 goes away with its reply still parked.
        conns[0].close(0u32.into(), b"gone");
        let released = tokio::time::timeout(EVENT_BOUND, server.waiting_replies(0, |n| *n == 0))
            .await
            .expect("the closed connection's reply slot was released");
        assert_eq!(released, Some(0));
        let after = server.status().await.into_iter().find(|s| s.shard == 0).unwrap();
        assert_eq!((after.parked, after.waiting_replies, after.version), (0, 0, 0));
        let answered = pending.await.expect("the client task ran");
        assert!(answered.is_err(), "a closed connection got a reply: {answered:?}");

        // The shard goes on: rank 1's push completes the step (rank 0's push
        // was counted before it left).
        let (resp, _) = transport::call(&conns[1], &push(2), limit).await.unwrap();
        assert!(matches!(resp, Response::Params { version: 1, .. }), "{resp:?}");
        let last = server.status().await.into_iter().find(|s| s.shard == 0).unwrap();
        assert_eq!((last.parked, last.waiting_replies), (0, 0));
        println!(
            "parked reply: shard 0 held {} parked ({} reply slots) before rank 0 closed, {} ({} slots) after; rank 1 then completed version {}",
            before.parked, before.waiting_replies, after.parked, after.waiting_replies, last.version
        );
        server.abort().await;
    });
}

/// The same-host socket (`cluster.local_path`) serves a request only with
/// the key a live connection was handed in its Welcome, as that
/// connection's: a wrong key and the key of a closed connection are cut off
/// unanswered. The socket's directory is private to the server's user and
/// goes with the server; a server with the path off offers none.
#[test]
fn the_same_host_socket_serves_only_with_a_live_connections_key() {
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    use ps_net::local;
    use ps_net::protocol::encode_request_frame;

    let cfg = one_worker_config();
    let pki = TestPki::new(1);
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &pki).await;
        let limit = cfg.server.max_frame_bytes;
        let conn = connect_as(&pki, 0, server.local_addr()).await;
        let (resp, _) = transport::call(&conn, &hello(&cfg, 0), limit).await.unwrap();
        let Response::Welcome { local: Some(offer), .. } = resp else {
            panic!("no same-host path offered on loopback: {resp:?}");
        };
        let path = Path::new(&offer.path).to_path_buf();
        let dir = path.parent().expect("the socket's directory").to_path_buf();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "socket directory mode {mode:o}");

        let frame = |req: &Request| encode_request_frame(req).unwrap();
        let (resp, _) = local::call(&path, &offer.key, &frame(&Request::Heartbeat), limit)
            .await
            .unwrap();
        assert_eq!(resp, Response::HeartbeatAck);
        // The connection's rank trains through the socket: its offer starts
        // the shard and its push completes step 0.
        let n = cfg.model.num_params() / 2;
        let offer_req = Request::Offer { shard: 0, version: 0, next_step: 0, values: vec![0.5; n] };
        let (resp, _) = local::call(&path, &offer.key, &frame(&offer_req), limit).await.unwrap();
        assert!(matches!(resp, Response::Params { version: 0, .. }), "{resp:?}");
        let push = Request::Step {
            shard: 0,
            step: 0,
            have_version: Some(0),
            rate: 0.0,
            grad: WireGrad::Sparse { indices: vec![1], values: WireValues::F32(vec![1.0]) },
        };
        let (resp, _) = local::call(&path, &offer.key, &frame(&push), limit).await.unwrap();
        assert!(matches!(resp, Response::Params { version: 1, .. }), "{resp:?}");
        assert_eq!(server.local_requests(), 3);

        // Another key: cut off without a reply, and not served.
        let mut wrong = offer.key;
        wrong[0] ^= 1;
        let refused = local::call(&path, &wrong, &frame(&Request::Heartbeat), limit).await;
        assert!(refused.is_err(), "a wrong key was answered: {refused:?}");
        // The connection's key dies with it.
        conn.close(close::BYE.into(), b"bye");
        tokio::time::timeout(EVENT_BOUND, server.wait_connections(|c| c.0 == 0))
            .await
            .expect("the server saw the connection close");
        let stale = local::call(&path, &offer.key, &frame(&Request::Heartbeat), limit).await;
        assert!(stale.is_err(), "a closed connection's key was answered: {stale:?}");
        assert_eq!(server.local_requests(), 3);
        server.abort().await;
        assert!(!dir.exists(), "the socket directory outlived the server");

        let mut off = cfg.clone();
        off.cluster.local_path = false;
        let server = start_loopback_server(&off, &pki).await;
        let conn = connect_as(&pki, 0, server.local_addr()).await;
        let (resp, _) = transport::call(&conn, &hello(&off, 0), limit).await.unwrap();
        assert!(matches!(resp, Response::Welcome { local: None, .. }), "{resp:?}");
        server.abort().await;
        println!("same-host socket: 3 requests served with the key, a wrong key and a closed connection's key cut off, directory mode {mode:o}");
    });
}
