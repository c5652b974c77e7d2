//! `[training]`: the worker's training loop (epochs, device, evaluation,
//! metrics, stopping rules, compute threads).

use serde::{Deserialize, Serialize};

use super::{check_range, invalid, ConfigError};

/// Training loop settings (worker side).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingSection {
    pub epochs: u64,
    /// `cpu`, or `cuda` / `cuda:N` when built with the `cuda` feature.
    pub device: String,
    /// Seed of the initial weights (the first worker's initial weights win).
    pub init_seed: u64,
    /// Directory for per-epoch metrics (`worker-<rank>.jsonl` and `.csv`);
    /// empty disables.
    pub metrics_dir: String,
    /// Evaluate on the test split every this many steps (0 = only at the end
    /// of each epoch). Evaluation time is not counted as training time.
    pub eval_every: u64,
    /// Also write a per-step record (loss, learning rate, data, compute,
    /// compress and exchange seconds, bytes) to `worker-<rank>.jsonl`
    /// every this many steps (0 = per-epoch records only).
    pub step_metrics_every: u64,
    /// Stop (saying goodbye) after the evaluation that reaches this test
    /// accuracy, in [0, 1] (0 = train every epoch).
    pub target_accuracy: f32,
    /// Stop (saying goodbye) after the evaluation whose mean test loss is
    /// at most this (a language model's validation loss; 0 = no loss
    /// target). With `target_accuracy` too, whichever is reached first.
    pub target_loss: f32,
    /// Stop after this many steps of the run (0 = no cap).
    pub max_steps: u64,
    /// asp/ssp only: compute the next step's gradient while this step's
    /// push and pull are in flight (the gradient is one step stale).
    pub overlap: bool,
    /// Dense pushes on a rank's own connections (no top-k, moments on the
    /// servers, no `overlap`): push each shard's gradient as soon as the
    /// backward pass has finished its range, so that the exchange overlaps
    /// the rest of the pass. Off by default: it pays where the pass is long
    /// against the exchange and the network has cores of its own, and it
    /// can cost where a colocated node's uplink is the bound (an early
    /// shard's reply then queues before the last shard's push).
    pub overlap_backward: bool,
    /// Threads of a worker process's compute pool (forward, backward,
    /// compression). 0 = automatic: `RAYON_NUM_THREADS` when set, else the
    /// CPUs divided among the worker processes when every server is on
    /// loopback (the whole cluster on one machine), else every CPU.
    pub compute_threads: usize,
    /// Initial weights: a `.safetensors` file (a path, or a bucket URL such
    /// as `s3://bucket/gpt/init.safetensors`) whose tensors are the model's,
    /// matched by name and shape; every worker loads it, so the cluster
    /// starts from these weights instead of `init_seed`'s. Empty = none.
    pub init_weights: String,
    /// Test windows per evaluation pass: the test split is evaluated in
    /// chunks of this many samples (0 = `data.batch_size`), the loss and
    /// accuracy summed over the chunks.
    pub eval_batch_size: usize,
}

impl Default for TrainingSection {
    fn default() -> Self {
        Self {
            epochs: 5,
            device: "cpu".into(),
            init_seed: 1,
            metrics_dir: "runs".into(),
            eval_every: 0,
            step_metrics_every: 10,
            target_accuracy: 0.0,
            target_loss: 0.0,
            max_steps: 0,
            overlap: false,
            overlap_backward: false,
            compute_threads: 0,
            init_weights: String::new(),
            eval_batch_size: 0,
        }
    }
}

impl TrainingSection {
    /// Step and epoch counts.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        check_range("training.epochs", self.epochs, 1..=1_000_000)?;
        check_range("training.eval_every", self.eval_every, 0..=1 << 40)?;
        check_range(
            "training.step_metrics_every",
            self.step_metrics_every,
            0..=1 << 40,
        )?;
        check_range("training.max_steps", self.max_steps, 0..=1 << 48)?;
        check_range("training.compute_threads", self.compute_threads, 0..=1024)?;
        check_range(
            "training.eval_batch_size",
            self.eval_batch_size,
            0..=1 << 24,
        )
    }

    /// Some evaluation target (accuracy or loss) is set: the run needs a
    /// test split.
    pub fn has_target(&self) -> bool {
        self.target_accuracy > 0.0 || self.target_loss > 0.0
    }

    /// Counts in range, a known device, a target accuracy in [0, 1] and a
    /// target loss >= 0. Whether `overlap` fits the sync mode is a rule
    /// across sections ([`super::ClusterConfig::validate`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_ranges()?;
        if self.epochs == 0 {
            return Err(invalid("training.epochs", "must be >= 1"));
        }
        if !(self.device == "cpu" || self.device == "cuda" || self.device.starts_with("cuda:")) {
            return Err(invalid(
                "training.device",
                format!("`{}`: use cpu, cuda or cuda:N", self.device),
            ));
        }
        if !(0.0..=1.0).contains(&self.target_accuracy) {
            return Err(invalid(
                "training.target_accuracy",
                format!("must be in [0, 1], got {}", self.target_accuracy),
            ));
        }
        if !(self.target_loss.is_finite() && self.target_loss >= 0.0) {
            return Err(invalid(
                "training.target_loss",
                format!("must be a finite loss >= 0, got {}", self.target_loss),
            ));
        }
        let init = self.init_weights.trim();
        if init != self.init_weights {
            return Err(invalid(
                "training.init_weights",
                format!("`{}` has leading or trailing spaces", self.init_weights),
            ));
        }
        if !init.is_empty() && !init.ends_with(".safetensors") {
            return Err(invalid(
                "training.init_weights",
                format!("`{init}` is not a .safetensors file"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_weights_must_name_a_safetensors_file() {
        let mut t = TrainingSection::default();
        assert!(t.validate().is_ok());
        t.init_weights = "runs/init.safetensors".into();
        assert!(t.validate().is_ok());
        t.init_weights = "s3://bucket/gpt/init.safetensors".into();
        assert!(t.validate().is_ok());
        t.init_weights = "runs/init.pt".into();
        let e = t.validate().unwrap_err().to_string();
        assert!(
            e.contains("training.init_weights") && e.contains("init.pt"),
            "{e}"
        );
        t.init_weights = " runs/init.safetensors".into();
        assert!(t.validate().is_err());
    }

    #[test]
    fn eval_batch_size_is_bounded() {
        let t = TrainingSection {
            eval_batch_size: 1 << 25,
            ..Default::default()
        };
        let e = t.validate().unwrap_err().to_string();
        assert!(e.contains("training.eval_batch_size"), "{e}");
    }
}
