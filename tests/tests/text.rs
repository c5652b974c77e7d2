//! Text datasets through the whole system: the loader serves a text
//! dataset's (input, target) windows in the sampler's known order, from its
//! caches after the first epoch and unchanged after a resume; and a small
//! GPT trained on generated text by one server and two workers learns it.

use std::sync::Arc;
use std::time::Duration;

use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::ObjectStore;
use ps_dataset::{
    generated_text, write_text_dataset, Batch, DatasetReader, Layout, TextOptions, TextTokenizer,
    WriteOptions,
};
use ps_shared::config::{
    ClusterConfig, CompressionKind, GptSection, ModelKind, OptimizerKind, ScheduleKind,
};
use ps_shared::sampler::EpochSampler;
use ps_tests::{run_cluster, test_config};
use ps_worker::loader::{BatchPos, Loader, LoaderError, LoaderSettings, RetryPolicy};
use ps_worker::run::StopReason;
use ps_worker::simstore::{SimSettings, SimStore};

const SEQ_LEN: usize = 15;

/// The byte tokens of `lines` lines of generated text, and that text
/// written as a byte-level text dataset (seq_len [`SEQ_LEN`], the last 10%
/// of the windows for testing) under `text/` of an in-memory bucket.
async fn text_bucket(lines: usize, layout: Layout) -> (Vec<u32>, Arc<InMemory>, Path) {
    let dir = tempfile::tempdir().expect("temp dir");
    let text = generated_text(lines, 11);
    let file = dir.path().join("corpus.txt");
    std::fs::write(&file, &text).expect("write the corpus");
    let store = Arc::new(InMemory::new());
    let prefix = Path::from("text");
    let options = TextOptions {
        train: vec![file],
        test: Vec::new(),
        test_fraction: 0.1,
        seq_len: SEQ_LEN,
        name: "grammar".into(),
        write: WriteOptions {
            layout,
            records_per_shard: 16,
        },
        overwrite: false,
        remove_dir_if_empty: None,
    };
    write_text_dataset(store.as_ref(), &prefix, &TextTokenizer::Bytes, &options)
        .await
        .expect("write the text dataset");
    (text.bytes().map(u32::from).collect(), store, prefix)
}

async fn open(store: Arc<dyn ObjectStore>, prefix: &Path) -> DatasetReader {
    DatasetReader::open(store, prefix.clone())
        .await
        .expect("open the text dataset")
}

/// Fast retries; a window of one batch, so that repeats in later epochs
/// come from the cache tiers and not from the prefetch window.
fn settings(batch: usize, epochs: u64) -> LoaderSettings {
    let mut s = LoaderSettings::new(batch, epochs);
    s.lookahead_samples = batch;
    s.retry = RetryPolicy {
        backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(20),
        outage_budget: Duration::from_secs(5),
        request_timeout: Duration::from_secs(10),
        seed: 3,
    };
    s
}

async fn drain(loader: &mut Loader) -> Result<Vec<(BatchPos, Arc<Batch>)>, LoaderError> {
    let mut out = Vec::new();
    for _ in 0..10_000 {
        match loader.next().await? {
            Some(item) => out.push(item),
            None => return Ok(out),
        }
    }
    panic!("the loader gave more than 10000 batches");
}

/// Every batch holds, row by row, the windows the sampler names: window
/// `i` is tokens `i * (SEQ_LEN + 1)..` of the corpus (the model's input is
/// its first `SEQ_LEN` tokens, its targets the last `SEQ_LEN`), labelled
/// with its last token.
fn check_windows(got: &[(BatchPos, Arc<Batch>)], tokens: &[u32]) {
    let window = SEQ_LEN + 1;
    for (pos, batch) in got {
        assert_eq!(batch.dim, window, "window width of {pos:?}");
        assert_eq!(batch.len(), pos.samples.len());
        for (row, &sample) in batch.features.chunks(window).zip(pos.samples.iter()) {
            let want = &tokens[sample * window..(sample + 1) * window];
            let ids: Vec<u32> = row.iter().map(|&t| t as u32).collect();
            assert_eq!(ids, want, "window {sample} of {pos:?}");
        }
        for (&label, &sample) in batch.labels.iter().zip(pos.samples.iter()) {
            assert_eq!(
                label,
                tokens[(sample + 1) * window - 1],
                "label of {sample}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_windows_come_in_the_known_order_from_the_cache() {
    for layout in [Layout::Shards, Layout::PerSample] {
        let (tokens, raw, prefix) = text_bucket(60, layout).await;
        let manifest = open(raw.clone(), &prefix).await.manifest().clone();
        let samples = manifest.train.num_samples;
        assert!(samples >= 60, "{samples} training windows");
        let sim = Arc::new(SimStore::new(raw.clone(), SimSettings::instant()));
        // One worker: every epoch is the whole split, in a new order.
        let sampler = EpochSampler::new(samples, 1, 0, 7).unwrap();
        let mut s = settings(4, 3);
        s.memory_cache_bytes = 1 << 20;
        let mut loader =
            Loader::start(open(sim.clone(), &prefix).await, sampler.clone(), s).expect("start");
        let got = drain(&mut loader).await.expect("the run's batches");
        // The order is the sampler's, batch for batch.
        let plan = sampler.plan(4, 3).batches_from(0);
        assert_eq!(got.len(), plan.len(), "{layout}");
        for ((pos, _), want) in got.iter().zip(&plan) {
            assert_eq!((pos.epoch, pos.step), (want.epoch, want.step), "{layout}");
            assert_eq!(&pos.samples[..], &want.samples[..], "{layout}");
        }
        check_windows(&got, &tokens);
        // The first epoch reads the bucket; the later ones its memory tier.
        let stats = loader.stats();
        assert!(stats.epoch(0).bucket_samples > 0, "{layout}");
        for epoch in 1..3 {
            let e = stats.epoch(epoch);
            assert_eq!((e.bucket_samples, e.gets), (0, 0), "{layout} epoch {epoch}");
            assert_eq!(e.memory_hits, e.samples, "{layout} epoch {epoch}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_text_run_serves_the_windows_of_the_uninterrupted_one() {
    let (tokens, raw, prefix) = text_bucket(60, Layout::Shards).await;
    let samples = open(raw.clone(), &prefix)
        .await
        .manifest()
        .train
        .num_samples;
    let sim: Arc<dyn ObjectStore> = Arc::new(SimStore::new(raw, SimSettings::instant()));
    let sampler = EpochSampler::new(samples, 2, 0, 21).unwrap();
    let mut full = Loader::start(
        open(sim.clone(), &prefix).await,
        sampler.clone(),
        settings(5, 2),
    )
    .expect("start");
    let full = drain(&mut full).await.expect("the uninterrupted run");
    let end = sampler.plan(5, 2).end_step();
    assert_eq!(full.len() as u64, end);
    check_windows(&full, &tokens);
    // Mid-epoch, at an epoch's end and at the last step.
    let per_epoch = samples.div_ceil(10) as u64;
    for step in [3, per_epoch - 1, per_epoch, end - 1] {
        // A fresh sampler and loader, as after a restart.
        let again = EpochSampler::new(samples, 2, 0, 21).unwrap();
        let mut s = settings(5, 2);
        s.memory_cache_bytes = 1 << 20;
        let mut resumed =
            Loader::start_at(open(sim.clone(), &prefix).await, again, s, step).expect("start");
        let resumed = drain(&mut resumed).await.expect("the resumed run");
        let skip = step as usize;
        assert_eq!(resumed.len(), full.len() - skip, "step {step}");
        for (a, b) in resumed.iter().zip(&full[skip..]) {
            assert_eq!(a.0, b.0, "step {step}");
            assert_eq!(a.1, b.1, "step {step}");
        }
    }
}

/// A generated corpus of `lines` lines in shards, for the cluster runs:
/// written outside any runtime the cluster starts.
fn generated_text_bucket(lines: usize) -> (Arc<InMemory>, Path) {
    let (_, raw, prefix) = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime to write the dataset")
        .block_on(text_bucket(lines, Layout::Shards));
    (raw, prefix)
}

/// A GPT small enough to train in seconds of CPU: 1 server with 2 shards,
/// 2 workers, dense AdamW with warm-up and cosine decay.
fn tiny_gpt_config(epochs: u64, steps: u64) -> ClusterConfig {
    let mut cfg = test_config(CompressionKind::None, 1.0, epochs);
    cfg.model.kind = ModelKind::Gpt;
    cfg.model.hidden = Vec::new();
    cfg.model.gpt = GptSection {
        vocab: 256,
        seq_len: SEQ_LEN,
        d_model: 32,
        n_layer: 1,
        n_head: 2,
        d_ff: 0,
        dropout: 0.0,
    };
    cfg.data.batch_size = 16;
    let o = &mut cfg.optimizer;
    o.kind = OptimizerKind::Adamw;
    o.momentum = 0.0;
    o.lr = 1e-2;
    o.weight_decay = 0.01;
    o.schedule.kind = ScheduleKind::Cosine;
    o.schedule.warmup_steps = steps / 10;
    o.schedule.total_steps = steps;
    o.schedule.min_lr = 1e-3;
    cfg.validate().expect("a valid GPT config");
    cfg
}

#[test]
fn a_tiny_gpt_learns_generated_text_on_two_workers() {
    let (raw, prefix) = generated_text_bucket(600);
    let samples = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime to read the manifest")
        .block_on(open(raw.clone(), &prefix))
        .manifest()
        .train
        .num_samples;
    let epochs = 4;
    // The sample stream runs on across epoch ends; the run's last step
    // may have a batch for one rank only, so stop at the last full one.
    let steps = epochs * samples as u64 / (2 * 16);
    let mut cfg = tiny_gpt_config(epochs, steps);
    cfg.training.max_steps = steps;
    let reports = run_cluster(cfg, raw, prefix).expect("the GPT trains");
    assert_eq!(reports.len(), 2);
    let uniform = (256f32).ln();
    for r in &reports {
        let first = &r.epochs[0];
        let last = r.epochs.last().expect("epochs");
        println!(
            "tiny GPT rank {}: test_loss {:.3} -> {:.3} (ln 256 = {uniform:.3}), perplexity {:?} after {} steps",
            r.rank, first.test_loss, last.test_loss, last.test_perplexity, r.steps
        );
        assert_eq!(r.steps, steps);
        // Text models report the perplexity of the mean per-token loss.
        for e in &r.epochs {
            let ppl = e
                .test_perplexity
                .expect("a text model reports its perplexity");
            assert!(
                (ppl / e.test_loss.exp() - 1.0).abs() < 1e-5,
                "{ppl} {}",
                e.test_loss
            );
        }
        // Letters and spaces alone are about ln 25 = 3.2 nats: learning
        // the grammar's words goes well below that.
        assert!(
            last.test_loss < 0.45 * uniform,
            "rank {} ended at test loss {} (uniform {uniform})",
            r.rank,
            last.test_loss
        );
        assert!(last.test_loss < first.test_loss);
    }
    // Both ranks end with the same parameters: the same final evaluation,
    // bit for bit. (Earlier epochs may end a step apart on the two ranks,
    // since the sample stream runs on across epoch ends.)
    let (a, b) = (&reports[0], &reports[1]);
    assert_eq!((a.final_version, b.final_version), (steps, steps));
    let (x, y) = (a.epochs.last().unwrap(), b.epochs.last().unwrap());
    assert_eq!(x.test_loss.to_bits(), y.test_loss.to_bits());
    assert_eq!(x.test_accuracy.to_bits(), y.test_accuracy.to_bits());
    assert_eq!(a.final_accuracy.to_bits(), b.final_accuracy.to_bits());
}

/// `training.target_loss`: both ranks stop together after the first
/// evaluation whose validation loss is at most the target, well before the
/// step cap; no earlier evaluation had reached it.
#[test]
fn a_tiny_gpt_stops_at_its_validation_loss_target() {
    let (raw, prefix) = generated_text_bucket(600);
    let steps = 400;
    let mut cfg = tiny_gpt_config(100, steps);
    cfg.training.max_steps = steps;
    cfg.training.eval_every = 5;
    // Halfway from uniform (ln 256 = 5.5 nats) to where the run above ends
    // (below 2.5): reached early in the run.
    let target = 0.6 * (256f32).ln();
    cfg.training.target_loss = target;
    cfg.validate().expect("a valid config");
    let reports = run_cluster(cfg, raw, prefix).expect("the GPT trains");
    assert_eq!(reports.len(), 2);
    for r in &reports {
        let losses: Vec<(u64, f32)> = r.evals.iter().map(|e| (e.step, e.test_loss)).collect();
        println!(
            "rank {}: stopped by {:?} at step {}, evaluations {losses:?}",
            r.rank, r.stop_reason, r.steps
        );
        assert_eq!(r.stop_reason, StopReason::TargetLoss, "rank {}", r.rank);
        let (last, before) = r.evals.split_last().expect("evaluations");
        assert!(last.test_loss <= target, "{losses:?}");
        assert_eq!(
            last.step, r.steps,
            "the run stops at the evaluation that reached it"
        );
        assert!(r.steps < steps, "stopped before the cap: {}", r.steps);
        assert!(
            before.iter().all(|e| e.test_loss > target),
            "an earlier evaluation reached {target}: {losses:?}"
        );
    }
    assert_eq!(
        reports[0].steps, reports[1].steps,
        "both ranks stop together"
    );
}

/// `training.init_weights`: every worker loads the safetensors file, so the
/// parameters the cluster serves are the file's. With a learning rate far
/// below float resolution (1e-30: every AdamW step and decay rounds away)
/// the parameters the workers pull stay the first ones, and both ranks'
/// evaluation equals, bit for bit, that of the file's weights evaluated
/// here in the same chunks; the seeded weights evaluate differently.
#[test]
fn the_cluster_starts_from_the_initial_weights_file() {
    use ps_dataset::Split;
    use ps_worker::model::Model;

    let (raw, prefix) = generated_text_bucket(200);
    let test = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime to read the test split")
        .block_on(async {
            let reader = open(raw.clone(), &prefix).await;
            reader.fetch_all(Split::Test).await.expect("the test split")
        });
    let mut cfg = tiny_gpt_config(1, 100);
    cfg.optimizer.lr = 1e-30;
    cfg.optimizer.schedule = Default::default();
    cfg.training.max_steps = 3;
    cfg.training.eval_batch_size = 7;

    // Weights unlike any seed's: every entry nonzero and well above 1e-20.
    let device = candle_core::Device::Cpu;
    let mut file_model = Model::new(&cfg.model, device.clone(), 99).expect("the model");
    let flat: Vec<f32> = (0..file_model.num_params())
        .map(|i| 0.05 + 0.2 * ((i as f32) * 0.37).sin().abs())
        .collect();
    file_model.set_flat(&flat).expect("set the weights");
    let tensors: std::collections::HashMap<String, candle_core::Tensor> = file_model
        .tensors()
        .iter()
        .map(|t| {
            let v = flat[file_model.range_of(&t.name).unwrap()].to_vec();
            let tensor = candle_core::Tensor::from_vec(v, t.shape.as_slice(), &device).unwrap();
            (t.name.clone(), tensor)
        })
        .collect();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("init.safetensors");
    candle_core::safetensors::save(&tensors, &path).expect("write the weights");
    cfg.training.init_weights = path.to_str().expect("a UTF-8 path").to_string();
    cfg.validate().expect("a valid config");

    let want = file_model.evaluate_chunked(&test, 7).expect("evaluate");
    let seeded = Model::new(&cfg.model, device, cfg.training.init_seed)
        .expect("the model")
        .evaluate_chunked(&test, 7)
        .expect("evaluate");
    assert_ne!(want.0, seeded.0, "the file's weights are the seed's");

    let reports = run_cluster(cfg, raw, prefix).expect("the GPT trains");
    assert_eq!(reports.len(), 2);
    for r in &reports {
        assert_eq!(r.steps, 3);
        let last = r.epochs.last().expect("an epoch");
        assert_eq!(
            (last.test_loss.to_bits(), last.test_accuracy.to_bits()),
            (want.0.to_bits(), want.1.to_bits()),
            "rank {}: test loss {} vs the file's {} (seeded {})",
            r.rank,
            last.test_loss,
            want.0,
            seeded.0
        );
    }
}

/// A file that does not fit the model stops the worker with an error that
/// names the file and the tensor.
#[test]
fn initial_weights_of_another_model_are_refused_by_name() {
    let (raw, prefix) = generated_text_bucket(200);
    let mut cfg = tiny_gpt_config(1, 100);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("other.safetensors");
    let device = candle_core::Device::Cpu;
    let tensors = std::collections::HashMap::from([(
        "wte.weight".to_string(),
        candle_core::Tensor::zeros((256, 16), candle_core::DType::F32, &device).unwrap(),
    )]);
    candle_core::safetensors::save(&tensors, &path).expect("write the weights");
    cfg.training.init_weights = path.to_str().expect("a UTF-8 path").to_string();
    let err = run_cluster(cfg, raw, prefix).expect_err("the weights do not fit");
    let text = format!("{err:#}");
    assert!(
        text.contains("other.safetensors")
            && text.contains("`wte.weight`")
            && text.contains("[256, 16]"),
        "{text}"
    );
}
