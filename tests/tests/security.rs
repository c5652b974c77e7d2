//! Refusals at the edge: TLS trust, token, protocol version, model layout,
//! requests before Hello, and malformed frames. The server must answer each
//! with a typed error and keep serving.

use ps_shared::config::{ClusterConfig, CompressionKind};
use ps_shared::protocol::{
    encode_request, ErrorCode, Request, Response, WireGrad, WireValues, PROTOCOL_VERSION,
};
use ps_shared::transport::{self, DevCert};
use ps_tests::{start_loopback_server, test_config};

fn hello(cfg: &ClusterConfig) -> Request {
    Request::Hello {
        protocol_version: PROTOCOL_VERSION,
        token: cfg.cluster.token.clone(),
        worker_rank: 0,
        num_params: cfg.model.num_params() as u64,
        layout_hash: cfg.model.layout_hash(),
    }
}

fn error_code(resp: &Response) -> Option<ErrorCode> {
    match resp {
        Response::Error { code, .. } => Some(*code),
        _ => None,
    }
}

#[test]
fn server_refuses_bad_clients_and_keeps_serving() {
    let cfg = test_config(CompressionKind::Topk, 0.01, 1);
    let cert = DevCert::generate(&["localhost".into()]).unwrap();
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &cert).await;
        let addr = server.local_addr();
        let limit = cfg.server.max_frame_bytes;
        let client = transport::client_endpoint(&cert.cert_pem, false).unwrap();

        // A client that trusts another certificate cannot even finish TLS.
        let stranger = DevCert::generate(&["localhost".into()]).unwrap();
        let other = transport::client_endpoint(&stranger.cert_pem, false).unwrap();
        assert!(transport::connect(&other, addr, "localhost").await.is_err());

        let mut tried = 0;
        // Wrong token, wrong version, wrong layout, unknown rank: refused.
        let mut bad = Vec::new();
        if let Request::Hello {
            protocol_version,
            token,
            worker_rank,
            num_params,
            layout_hash,
        } = hello(&cfg)
        {
            bad.push((
                Request::Hello {
                    protocol_version,
                    token: "wrong-token-123".into(),
                    worker_rank,
                    num_params,
                    layout_hash,
                },
                ErrorCode::Unauthorized,
            ));
            bad.push((
                Request::Hello {
                    protocol_version: protocol_version + 1,
                    token: token.clone(),
                    worker_rank,
                    num_params,
                    layout_hash,
                },
                ErrorCode::VersionMismatch,
            ));
            bad.push((
                Request::Hello {
                    protocol_version,
                    token: token.clone(),
                    worker_rank,
                    num_params: num_params + 1,
                    layout_hash,
                },
                ErrorCode::LayoutMismatch,
            ));
            bad.push((
                Request::Hello {
                    protocol_version,
                    token: token.clone(),
                    worker_rank: 99,
                    num_params,
                    layout_hash,
                },
                ErrorCode::UnknownWorker,
            ));
        }
        // Anything before Hello is refused as unauthenticated.
        bad.push((
            Request::Pull {
                shard: 0,
                have_version: None,
                min_version: 0,
            },
            ErrorCode::Unauthorized,
        ));
        for (req, code) in bad {
            let conn = transport::connect(&client, addr, "localhost")
                .await
                .unwrap();
            let (resp, _) = transport::call(&conn, &req, limit).await.unwrap();
            assert_eq!(error_code(&resp), Some(code), "{req:?} got {resp:?}");
            // The connection is closed after a refusal.
            let next = transport::call(&conn, &hello(&cfg), limit).await;
            assert!(next.is_err(), "connection still open after refusal");
            tried += 1;
        }
        // Garbage instead of a Hello.
        let conn = transport::connect(&client, addr, "localhost")
            .await
            .unwrap();
        let resp = transport::call_raw(&conn, &[5, 0, 0, 0, 1, 2, 3, 4, 5], limit)
            .await
            .unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::BadFrame));
        tried += 1;

        // An authenticated client sending garbage and bad pushes gets typed errors...
        let conn = transport::connect(&client, addr, "localhost")
            .await
            .unwrap();
        let (resp, _) = transport::call(&conn, &hello(&cfg), limit).await.unwrap();
        assert!(matches!(resp, Response::Welcome { .. }), "{resp:?}");
        let resp = transport::call_raw(&conn, &[3, 0, 0, 0, 9, 9, 9], limit)
            .await
            .unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::BadFrame));
        let mut frame = encode_request(&Request::Bye { worker_rank: 0 }).unwrap();
        frame[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        let resp = transport::call_raw(&conn, &frame, limit).await.unwrap();
        assert_eq!(error_code(&resp), Some(ErrorCode::BadFrame));
        let push = |shard, step, worker_rank, grad| Request::Push {
            shard,
            step,
            worker_rank,
            grad,
        };
        let sparse = |i: Vec<u32>, v: Vec<f32>| WireGrad::Sparse {
            indices: i,
            values: WireValues::F32(v),
        };
        let shard_len = (cfg.model.num_params() / 2) as u32;
        let n = cfg.model.num_params() as usize / 2;
        let init = Request::Init {
            shard: 0,
            values: vec![0.5; n],
        };
        let (resp, _) = transport::call(&conn, &init, limit).await.unwrap();
        assert!(
            matches!(resp, Response::InitAck { accepted: true, .. }),
            "{resp:?}"
        );
        for (req, code) in [
            (
                push(7, 0, 0, sparse(vec![1], vec![1.0])),
                ErrorCode::UnknownShard,
            ),
            (
                push(0, 0, 1, sparse(vec![1], vec![1.0])),
                ErrorCode::Unauthorized,
            ),
            (
                push(0, 0, 0, sparse(vec![shard_len + 5], vec![1.0])),
                ErrorCode::OutOfRange,
            ),
            (
                push(0, 0, 0, sparse(vec![1, 2], vec![1.0])),
                ErrorCode::WrongLength,
            ),
            (
                push(0, 0, 0, sparse(vec![1], vec![f32::NAN])),
                ErrorCode::NonFinite,
            ),
            (
                push(0, 3, 0, sparse(vec![1], vec![1.0])),
                ErrorCode::WrongStep,
            ),
            (
                push(0, 0, 0, WireGrad::Dense(WireValues::F32(vec![1.0; 3]))),
                ErrorCode::WrongLength,
            ),
        ] {
            let (resp, _) = transport::call(&conn, &req, limit).await.unwrap();
            assert_eq!(error_code(&resp), Some(code), "{resp:?}");
            tried += 1;
        }
        // ...and the shard is untouched and still serving.
        let status = server.status().await;
        assert_eq!(status[0].version, 0);
        assert!(status[0].params.iter().all(|&p| p == 0.5));
        let (resp, _) = transport::call(&conn, &push(0, 0, 0, sparse(vec![1], vec![1.0])), limit)
            .await
            .unwrap();
        assert!(matches!(resp, Response::PushAck { .. }), "{resp:?}");
        println!("security: bad inputs tried {tried}, all refused with typed errors, state lost 0");
        server.shutdown().await;
    });
}

#[test]
fn request_rate_is_limited_per_connection() {
    let mut cfg = test_config(CompressionKind::Topk, 0.01, 1);
    cfg.server.max_requests_per_sec = 5;
    let cert = DevCert::generate(&["localhost".into()]).unwrap();
    let system = actix::System::new();
    system.block_on(async move {
        let server = start_loopback_server(&cfg, &cert).await;
        let limit = cfg.server.max_frame_bytes;
        let client = transport::client_endpoint(&cert.cert_pem, false).unwrap();
        let conn = transport::connect(&client, server.local_addr(), "localhost")
            .await
            .unwrap();
        let (resp, _) = transport::call(&conn, &hello(&cfg), limit).await.unwrap();
        assert!(matches!(resp, Response::Welcome { .. }));
        let beat = Request::Heartbeat { worker_rank: 0 };
        let (mut ok, mut limited) = (0, 0);
        for _ in 0..30 {
            match transport::call(&conn, &beat, limit).await.unwrap().0 {
                Response::HeartbeatAck => ok += 1,
                r if error_code(&r) == Some(ErrorCode::RateLimited) => limited += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(
            limited >= 20,
            "only {limited} of 30 were limited ({ok} passed)"
        );
        // The budget refills: after a pause the connection works again.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let (resp, _) = transport::call(&conn, &beat, limit).await.unwrap();
        assert_eq!(resp, Response::HeartbeatAck);
        println!("rate limit: {ok} passed, {limited} refused with RateLimited");
        server.shutdown().await;
    });
}
