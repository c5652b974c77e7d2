//! A whole cluster in one process: 1 server process with 2 shards, 2 workers,
//! trained on the synthetic set, dense and top-k.

use ps_dataset::SyntheticSpec;
use ps_shared::config::{CompressionKind, SyncMode};
use ps_tests::{run_cluster, synthetic_bucket_blocking, test_config};
use ps_worker::run::StopReason;

/// Test accuracy both runs must exceed. Chance is 10%; a linear model on this
/// set stays well below it.
const ACCURACY_BAR: f32 = 0.90;

fn spec() -> SyntheticSpec {
    SyntheticSpec {
        train: 4096,
        test: 1024,
        ..SyntheticSpec::default()
    }
}

fn train(kind: CompressionKind, density: f64) -> Vec<ps_worker::run::WorkerReport> {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let cfg = test_config(kind, density, 6);
    run_cluster(cfg, store, prefix).expect("cluster run")
}

fn summarize(name: &str, reports: &[ps_worker::run::WorkerReport]) {
    for r in reports {
        println!(
            "{name}: worker {} steps {} accuracy {:.2}% pushed {:.0} B/step pulled {:.0} B/step (P = {})",
            r.rank,
            r.steps,
            100.0 * r.final_accuracy,
            r.bytes_pushed_per_step,
            r.bytes_pulled_per_step,
            r.num_params
        );
    }
}

#[test]
fn dense_and_topk_clusters_learn() {
    let dense = train(CompressionKind::None, 1.0);
    let topk = train(CompressionKind::Topk, 0.01);
    summarize("dense", &dense);
    summarize("topk 1%", &topk);
    for (name, reports) in [("dense", &dense), ("topk", &topk)] {
        assert_eq!(reports.len(), 2);
        // BSP: both workers ran the same number of steps.
        assert_eq!(reports[0].steps, reports[1].steps, "{name}");
        assert!(reports[0].steps > 0);
        for r in reports.iter() {
            assert!(
                r.final_accuracy > ACCURACY_BAR,
                "{name} worker {} reached only {:.3}",
                r.rank,
                r.final_accuracy
            );
        }
        // Workers hold the same parameters after every pull, so they agree on accuracy.
        assert!(
            (reports[0].final_accuracy - reports[1].final_accuracy).abs() < 1e-6,
            "{name}"
        );
    }
    // Top-k at 1% pushes a small fraction of the dense bytes (index + value per entry).
    let ratio = topk[0].bytes_pushed_per_step / dense[0].bytes_pushed_per_step;
    println!("push bytes top-k / dense = {ratio:.4}");
    assert!(ratio < 0.05, "top-k pushed {ratio:.3} of the dense bytes");
    // With server momentum off, pulls are sparse too.
    assert!(topk[0].bytes_pulled_per_step < dense[0].bytes_pulled_per_step);
}

/// A dense step copies each message about once per stage: the worker
/// encodes its push once (straight from its gradient) and the server its
/// reply once; each side copies a received payload once from the
/// transport into the aligned buffer it is validated in, and decodes its
/// vectors once. Counted bytes, not time.
#[test]
fn a_dense_step_copies_each_payload_about_once_per_stage() {
    let (store, prefix) = synthetic_bucket_blocking(&SyntheticSpec {
        train: 1024,
        test: 256,
        ..SyntheticSpec::default()
    });
    let cfg = test_config(CompressionKind::None, 1.0, 1);
    let shards = cfg.total_shards() as f64;
    let (reports, _, servers) = ps_tests::run_cluster_counted(
        cfg,
        &|_| ps_worker::simulate::Simulation::default(),
        store,
        prefix,
        None,
    )
    .expect("cluster run");
    // Fields, tags and the root of one message, per shard.
    let slack = 256.0 * shards;
    let mut pushed = 0.0;
    let mut steps = 0.0;
    for r in &reports {
        let payload = 4.0 * r.num_params as f64;
        println!(
            "worker {}: per step pushed {:.0} B, pulled {:.0} B; copied: encoded {:.0} B, read {:.0} B, decoded {:.0} B ({:.2}x, {:.2}x, {:.2}x the dense payload)",
            r.rank,
            r.bytes_pushed_per_step,
            r.bytes_pulled_per_step,
            r.bytes_encoded_per_step,
            r.bytes_read_per_step,
            r.bytes_decoded_per_step,
            r.bytes_encoded_per_step / payload,
            r.bytes_read_per_step / payload,
            r.bytes_decoded_per_step / payload,
        );
        // Pushes count their frames, replies their values.
        assert!(r.bytes_pushed_per_step >= payload, "dense pushes");
        assert_eq!(r.bytes_pulled_per_step, payload, "dense replies");
        // The push direction, worker side: one encoding.
        assert!(r.bytes_encoded_per_step >= payload);
        assert!(r.bytes_encoded_per_step <= payload + slack);
        // The reply direction, worker side: one read, one decode.
        assert!(r.bytes_read_per_step >= payload);
        assert!(r.bytes_read_per_step <= payload + slack);
        assert!(r.bytes_decoded_per_step <= payload);
        pushed += payload * r.steps as f64;
        steps += r.steps as f64;
    }
    // The server, per push it received: one read, one decode; its replies
    // encoded once per shard and step for every worker (BSP: one reply).
    let server = servers[0].copied;
    let workers = reports.len() as f64;
    let payload = 4.0 * reports[0].num_params as f64;
    let per_worker_step = |b: u64| b as f64 / steps;
    println!(
        "server: per worker and step read {:.0} B, decoded {:.0} B; encoded {:.0} B per step",
        per_worker_step(server.read),
        per_worker_step(server.decoded),
        server.encoded as f64 * workers / steps,
    );
    // Offers at the start add one dense payload per worker.
    let offers = payload * workers;
    assert!(server.read as f64 >= pushed);
    assert!((server.read as f64) <= pushed + offers + slack * (steps + workers));
    assert!((server.decoded as f64) <= pushed + offers);
    // One encoding of each step's reply, shared by the workers.
    let step_count = steps / workers;
    assert!((server.encoded as f64) <= (step_count + workers) * (payload + slack));
}

/// `compression.f16_replies`: a dense pull carries each update's change in
/// 2 bytes an entry instead of the values in 4, the servers round on write,
/// and both workers still hold the same parameters.
#[test]
fn f16_replies_halve_dense_pulls_and_the_workers_stay_identical() {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let run = |f16: bool| {
        let mut cfg = test_config(CompressionKind::None, 1.0, 6);
        cfg.compression.f16_replies = f16;
        run_cluster(cfg, store.clone(), prefix.clone()).expect("cluster run")
    };
    let exact = run(false);
    let rounded = run(true);
    summarize("dense f32 replies", &exact);
    summarize("dense f16 replies", &rounded);
    let ratio = rounded[0].bytes_pulled_per_step / exact[0].bytes_pulled_per_step;
    println!(
        "pulled per step f16 / f32 = {ratio:.3}; accuracy {:.2}% against {:.2}%",
        100.0 * rounded[0].final_accuracy,
        100.0 * exact[0].final_accuracy
    );
    // 2 bytes an entry and the base version per shard and step.
    assert!((0.49..0.52).contains(&ratio), "{ratio}");
    assert_eq!(rounded[0].steps, rounded[1].steps);
    assert_eq!(
        rounded[0].final_accuracy.to_bits(),
        rounded[1].final_accuracy.to_bits(),
        "both workers hold the server's rounded copy"
    );
    for r in &rounded {
        assert!(r.final_accuracy > ACCURACY_BAR, "{:.3}", r.final_accuracy);
    }
    assert!((rounded[0].final_accuracy - exact[0].final_accuracy).abs() < 0.02);
}

/// `training.overlap_backward`: a shard's dense push leaves as soon as
/// backward has finished its range, while the pass computes the layers
/// before it, and the cluster trains exactly what whole pushes train.
#[test]
fn pushes_streamed_during_backward_train_what_whole_pushes_train() {
    let streamed = streamed_and_whole("dense", CompressionKind::None, 1.0, 3, |_| {});
    assert!(streamed[0].final_accuracy > ACCURACY_BAR);
}

/// The same with top-k pushes selected per shard (`compression.scope =
/// "shard"`): each shard's top-k is taken as soon as backward has finished
/// its range, through the density warm-up and at the final density, and
/// the cluster trains exactly what the whole push selected per shard
/// trains.
#[test]
fn topk_pushes_selected_per_shard_stream_during_backward_bit_for_bit() {
    let what = "top-k 2% per shard";
    let streamed = streamed_and_whole(what, CompressionKind::Topk, 0.02, 8, |cfg| {
        cfg.compression.scope = ps_shared::config::TopkScope::Shard;
        cfg.compression.warmup_steps = 20;
        cfg.compression.warmup_start_density = 0.5;
        cfg.compression.f16_values = true;
    });
    for r in &streamed {
        // The warm-up's steps in the first epoch push more; the last epoch
        // is at the final density, each shard's 2% rounded.
        let (first, last) = (&r.epochs[0], &r.epochs[r.epochs.len() - 1]);
        assert!(
            first.density > 0.03 && first.density < 0.5,
            "{}",
            first.density
        );
        assert!((last.density - 0.02).abs() < 0.001, "{}", last.density);
        assert!(r.final_accuracy > ACCURACY_BAR, "{:.3}", r.final_accuracy);
    }
}

/// With Adam's moments on the workers (the GPT's top-k recipe), each
/// shard's direction and its top-k are made as soon as backward has
/// finished its range, bit for bit what the whole push makes.
#[test]
fn worker_adam_directions_stream_during_backward_bit_for_bit() {
    let what = "AdamW on the workers, top-k 5% per shard";
    let streamed = streamed_and_whole(what, CompressionKind::Topk, 0.05, 4, |cfg| {
        use ps_shared::config::{Moments, OptimizerKind};
        cfg.compression.scope = ps_shared::config::TopkScope::Shard;
        cfg.compression.momentum_correction = 0.0;
        cfg.optimizer.kind = OptimizerKind::Adamw;
        cfg.optimizer.lr = 0.003;
        cfg.optimizer.momentum = 0.0;
        cfg.optimizer.weight_decay = 0.01;
        cfg.optimizer.moments = Moments::Worker;
    });
    for r in &streamed {
        assert!(r.final_accuracy > ACCURACY_BAR, "{:.3}", r.final_accuracy);
    }
}

/// Runs the cluster with pushes made after backward and during it (the
/// second of two shards starts in the middle of three equal hidden layers,
/// so it is final before the first layer is), checks that both train the
/// same bit for bit, and returns the streamed run's reports.
fn streamed_and_whole(
    what: &str,
    kind: CompressionKind,
    density: f64,
    epochs: u64,
    configure: impl Fn(&mut ps_shared::config::ClusterConfig),
) -> Vec<ps_worker::run::WorkerReport> {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let run = |stream: bool| {
        let mut cfg = test_config(kind, density, epochs);
        cfg.model.hidden = vec![64, 64, 64];
        cfg.training.overlap_backward = stream;
        configure(&mut cfg);
        cfg.validate().unwrap();
        run_cluster(cfg, store.clone(), prefix.clone()).expect("cluster run")
    };
    let whole = run(false);
    let streamed = run(true);
    summarize(&format!("{what}, pushed after backward"), &whole);
    summarize(&format!("{what}, pushed during backward"), &streamed);
    for (w, s) in whole.iter().zip(&streamed) {
        assert_eq!(w.early_shards_per_step, 0.0);
        assert_eq!(s.early_shards_per_step, 1.0, "rank {}", s.rank);
        assert_eq!(w.steps, s.steps);
        for (a, b) in w.epochs.iter().zip(&s.epochs) {
            assert_eq!(a.density.to_bits(), b.density.to_bits());
            assert_eq!(a.bytes_pushed, b.bytes_pushed);
            assert_eq!(a.test_loss.to_bits(), b.test_loss.to_bits());
            assert_eq!(a.train_loss.to_bits(), b.train_loss.to_bits());
        }
        assert_eq!(w.final_accuracy.to_bits(), s.final_accuracy.to_bits());
    }
    streamed
}

/// `cluster.local_path`: workers on the server's host send every request
/// through its Unix socket, and the cluster trains bit for bit what it
/// trains over QUIC; with the path off, nothing crosses the socket.
#[test]
fn colocated_workers_train_through_the_same_host_socket_as_over_quic() {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let run = |on: bool| {
        let mut cfg = test_config(CompressionKind::None, 1.0, 2);
        cfg.cluster.local_path = on;
        let shards = cfg.total_shards() as u64;
        let sim = |_| ps_worker::simulate::Simulation::default();
        let (reports, status, servers) =
            ps_tests::run_cluster_counted(cfg, &sim, store.clone(), prefix.clone(), None)
                .expect("cluster run");
        let steps: u64 = reports.iter().map(|r| r.steps).sum();
        let local = servers[0].local_requests;
        println!("local_path = {on}: {steps} worker steps, {local} requests through the socket");
        (reports, status, local, steps * shards)
    };
    let (quic, quic_shards, quic_local, _) = run(false);
    let (socket, socket_shards, socket_local, pushes) = run(true);
    assert_eq!(quic_local, 0);
    // Every step's push to every shard, plus the joins and offers.
    assert!(socket_local >= pushes, "{socket_local} < {pushes}");
    summarize("dense over QUIC", &quic);
    summarize("dense through the socket", &socket);
    for (q, s) in quic.iter().zip(&socket) {
        assert_eq!(q.steps, s.steps);
        for (a, b) in q.epochs.iter().zip(&s.epochs) {
            assert_eq!(a.bytes_pushed, b.bytes_pushed);
            assert_eq!(a.train_loss.to_bits(), b.train_loss.to_bits());
            assert_eq!(a.test_loss.to_bits(), b.test_loss.to_bits());
        }
        assert!(s.final_accuracy > ACCURACY_BAR, "{:.3}", s.final_accuracy);
    }
    for (q, s) in quic_shards.iter().zip(&socket_shards) {
        assert_eq!(q.version, s.version);
        assert!(
            q.params
                .iter()
                .zip(&s.params)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "shard {} differs",
            q.shard
        );
    }
}

#[test]
fn two_server_processes_serve_their_shards() {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let mut cfg = test_config(CompressionKind::Topk, 0.01, 3);
    cfg.cluster.servers = vec!["127.0.0.1:0".into(), "127.0.0.1:0".into()];
    cfg.cluster.shards_per_server = 2;
    // Also: each worker keeps its part of the data across epochs.
    cfg.data.partition = ps_shared::sampler::Partition::Stable;
    cfg.validate().unwrap();
    let reports = run_cluster(cfg, store, prefix).expect("cluster run");
    summarize("2 servers x 2 shards, stable partition", &reports);
    assert_eq!(reports[0].steps, reports[1].steps);
    assert!(reports.iter().all(|r| r.final_accuracy > ACCURACY_BAR));
}

#[test]
fn asp_and_ssp_clusters_learn() {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    for (mode, overlap) in [
        (SyncMode::Asp, false),
        (SyncMode::Ssp, false),
        (SyncMode::Ssp, true),
        (SyncMode::Asp, true),
    ] {
        let mut cfg = test_config(CompressionKind::Topk, 0.01, 6);
        cfg.server.mode = mode;
        cfg.server.staleness = 2;
        // Gradients computed while the previous exchange is in flight.
        cfg.training.overlap = overlap;
        let reports = run_cluster(cfg, store.clone(), prefix.clone()).expect("cluster run");
        let mode = format!("{mode:?}{}", if overlap { " overlapped" } else { "" });
        summarize(&mode, &reports);
        for r in &reports {
            // Every batch of every epoch is trained exactly once.
            assert_eq!(r.steps, 6 * (4096 / 2 / 64), "{mode}");
            assert_eq!(r.epochs.len(), 6, "{mode}");
            assert!(r.epochs.iter().all(|e| e.steps == 4096 / 2 / 64), "{mode}");
            assert!(
                r.final_accuracy > ACCURACY_BAR,
                "{mode:?} worker {} reached {}",
                r.rank,
                r.final_accuracy
            );
        }
    }
}

#[test]
fn approx_topk_with_f16_values_and_warmup_learns() {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    let mut cfg = test_config(CompressionKind::Topk, 0.01, 6);
    cfg.compression.method = ps_shared::sparse::TopKMethod::Approx;
    cfg.compression.f16_values = true;
    cfg.compression.warmup_steps = 50;
    cfg.compression.warmup_start_density = 0.25;
    cfg.validate().unwrap();
    let reports = run_cluster(cfg, store, prefix).expect("cluster run");
    summarize("approx top-k, f16, warm-up", &reports);
    for r in &reports {
        assert!(
            r.final_accuracy > ACCURACY_BAR,
            "worker {} reached {}",
            r.rank,
            r.final_accuracy
        );
        // After warm-up the density settles at 1%: the last epoch pushes about
        // k entries of 6 bytes (u32 index + f16 value) per step.
        let last = r.epochs.last().unwrap();
        let per_step = last.bytes_pushed as f64 / last.steps as f64;
        let k = (0.01 * r.num_params as f64).round();
        assert!(
            per_step < k * 6.0 * 1.1 + 256.0,
            "{per_step} bytes/step for k = {k}"
        );
        assert!(
            (last.density - 0.01).abs() < 0.002,
            "density {}",
            last.density
        );
    }
}

#[test]
fn workers_evaluate_every_n_steps_and_stop_together_at_the_target() {
    let (store, prefix) = synthetic_bucket_blocking(&spec());
    // 4096 samples over 2 workers in batches of 64: 32 steps per epoch.
    let mut cfg = test_config(CompressionKind::None, 1.0, 20);
    cfg.training.eval_every = 5;
    cfg.training.target_accuracy = 0.85;
    let reports = run_cluster(cfg.clone(), store.clone(), prefix.clone()).expect("cluster run");
    for r in &reports {
        let steps: Vec<u64> = r.evals.iter().map(|e| e.step).collect();
        println!(
            "worker {}: stopped by {:?} at step {}, evaluations at {steps:?}, accuracy {:?}",
            r.rank,
            r.stop_reason,
            r.steps,
            r.evals.iter().map(|e| e.test_accuracy).collect::<Vec<_>>()
        );
        assert_eq!(
            r.stop_reason,
            StopReason::TargetAccuracy,
            "worker {}",
            r.rank
        );
        let last = r.evals.last().expect("evaluations");
        assert!(last.test_accuracy >= 0.85);
        assert_eq!(
            last.step, r.steps,
            "the run stops at the evaluation that reached it"
        );
        assert!(r.steps < 20 * 32, "stopped before the last epoch");
        // Every 5 steps, plus the ends of epochs; training time only grows.
        assert!(steps.iter().all(|s| s % 5 == 0 || s % 32 == 0), "{steps:?}");
        assert!(steps.windows(2).all(|w| w[0] < w[1]));
        assert!(r.evals.windows(2).all(|w| w[0].train_s <= w[1].train_s));
        assert!(r
            .evals
            .windows(2)
            .all(|w| w[0].bytes_pushed < w[1].bytes_pushed));
        // Earlier evaluations were all below the target.
        assert!(r.evals[..r.evals.len() - 1]
            .iter()
            .all(|e| e.test_accuracy < 0.85));
    }
    assert_eq!(
        reports[0].steps, reports[1].steps,
        "BSP workers stop together"
    );

    let mut cfg = test_config(CompressionKind::Topk, 0.01, 20);
    cfg.training.max_steps = 7;
    let reports = run_cluster(cfg, store, prefix).expect("capped run");
    for r in &reports {
        assert_eq!(r.stop_reason, StopReason::MaxSteps);
        assert_eq!(r.steps, 7);
        // The partial epoch is still reported and evaluated.
        assert_eq!(r.epochs.len(), 1);
        assert_eq!(r.epochs[0].steps, 7);
        assert_eq!(r.evals.len(), 1);
    }
}
