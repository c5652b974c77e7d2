//! `TrainerActor`: forward/backward in candle, then gradient compression.
//!
//! The trainer runs on an arbiter (thread) of its own, so compute never stalls
//! the loader's fetches or the comm actor's network I/O. It owns the model and
//! the error-feedback compressor; what leaves it is the gradient to push
//! (with `optimizer.moments = "worker"`, the worker's Adam direction in its
//! place, [`crate::moments`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;

use ps_dataset::Batch;
use ps_net::protocol::ParamUpdate;
use ps_shared::sparse::{values_from_f16, Compressor, SparseError, SparseGrad};

use ps_shared::config::ClusterConfig;

use crate::comm::{GradSink, Outgoing, ShardPush, ShardUpdate};
use crate::model::{Model, ModelError};
use crate::moments::WorkerMoments;

#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Sparse(#[from] SparseError),
    #[error("training diverged: loss is {0}")]
    Diverged(f32),
}

/// Forward, backward and compression of one step.
pub struct StepOutput {
    pub loss: f32,
    /// The push; `None` when it was streamed to the exchange during the
    /// backward pass ([`ComputeStep`]'s sink).
    pub grad: Option<Outgoing>,
    /// Entries pushed / parameters.
    pub density: f64,
    pub compute: Duration,
    pub compress: Duration,
    /// Shards handed to the exchange before the backward pass ended.
    pub early_shards: u64,
}

pub struct TrainerActor {
    model: Model,
    /// `None` for the dense baseline.
    compressor: Option<Compressor>,
    /// The flat gradient, overwritten every step (the compressor reads it
    /// where it lies).
    grad: Vec<f32>,
    /// Adam's moments, when the worker keeps them: the gradient is turned
    /// into the Adam direction before the compressor sees it.
    moments: Option<WorkerMoments>,
    /// The parameters, read for the direction's weight decay (empty
    /// without moments).
    params: Vec<f32>,
    /// The global step of the next gradient ([`SetStep`], then one more per
    /// step).
    step: u64,
}

impl TrainerActor {
    pub fn new(model: Model, compressor: Option<Compressor>) -> Self {
        let grad = vec![0.0; model.num_params()];
        Self {
            model,
            compressor,
            grad,
            moments: None,
            params: Vec::new(),
            step: 0,
        }
    }

    /// Keeps Adam's moments on this worker (`optimizer.moments = "worker"`):
    /// every gradient becomes the scheduled Adam direction of its step
    /// before it is compressed.
    pub fn with_moments(mut self, moments: WorkerMoments) -> Self {
        self.params = vec![0.0; self.model.num_params()];
        self.moments = Some(moments);
        self
    }
}

impl Actor for TrainerActor {
    type Context = Context<Self>;
}

/// Compute the gradient of a batch, scaled by the weight (the batch's
/// share of the global batch with throughput balancing, `b_r /
/// data.batch_size`; exactly 1 with equal batches, which leaves the
/// gradient untouched). With a sink, the dense gradient leaves through it
/// shard by shard while the backward pass runs ([`why_not_streamed`]).
#[derive(Message)]
#[rtype(result = "Result<StepOutput, TrainerError>")]
pub struct ComputeStep(pub Arc<Batch>, pub f32, pub Option<GradSink>);

/// Why a rank of `cfg` on its own connections pushes after the backward
/// pass, or `None` when it streams its push to the exchange during the
/// pass: `training.overlap_backward` with pushes that a shard's range
/// decides alone (dense, or a top-k per shard with `compression.scope =
/// "shard"` and no local clipping; Adam's moments on either side), and
/// without `training.overlap`, which computes ahead instead.
pub fn why_not_streamed(cfg: &ClusterConfig) -> Option<&'static str> {
    use ps_shared::config::TopkScope;
    if !cfg.training.overlap_backward {
        Some("training.overlap_backward is off")
    } else if cfg.overlaps_compute() {
        Some("training.overlap computes the next gradient during the exchange instead")
    } else if cfg.compression.streams() {
        None
    } else if cfg.compression.scope == TopkScope::Model {
        Some("a top-k over the whole model needs the whole gradient (compression.scope = \"shard\" selects per shard)")
    } else {
        Some("compression.clip_norm scales by the whole gradient's norm")
    }
}

impl Handler<ComputeStep> for TrainerActor {
    type Result = Result<StepOutput, TrainerError>;
    fn handle(&mut self, msg: ComputeStep, _: &mut Context<Self>) -> Self::Result {
        // The compressor's passes are rayon iterators. Called from this
        // actor's thread, each one is handed to the pool and waited for: a
        // wake-up and two context switches per pass, and with one pool
        // thread (RAYON_NUM_THREADS=1) nothing runs here meanwhile. Running
        // the step on a pool thread makes that one hand-over per step; the
        // passes then split over the pool from there, or run inline.
        rayon::scope(|_| match msg.2 {
            Some(sink) => self.streamed_step(&msg.0, msg.1, sink),
            None => self.compute_step(&msg.0, msg.1),
        })
    }
}

impl TrainerActor {
    /// Forward and backward, each shard of the dense gradient handed to
    /// `sink` as soon as the pass has finished it.
    fn streamed_step(
        &mut self,
        batch: &Batch,
        weight: f32,
        mut sink: GradSink,
    ) -> Result<StepOutput, TrainerError> {
        // A compressed push streams when each shard has its own top-k
        // (`compression.scope = "shard"`, the same shards as the sink's) and
        // no clipping scale waits for the whole gradient's norm.
        let per_shard = self
            .compressor
            .as_ref()
            .is_none_or(|c| c.blocks() == sink.map().ranges() && c.config().streams());
        if !per_shard {
            return self.whole_into(batch, weight, sink);
        }
        let t0 = Instant::now();
        if self.moments.is_some() {
            // Adam's direction is taken at the parameters held now, which
            // the pass does not change.
            self.model.flat_params_into(&mut self.params)?;
        }
        // The last call (`from` 0) comes as the pass ends: shards that left
        // before it left early.
        let mut early_shards = 0;
        let mut sent = 0usize;
        let mut prepare = Duration::ZERO;
        let mut failed: Option<TrainerError> = None;
        let mut direction = None;
        let mut scratch = Vec::new();
        let step = self.step;
        let (compressor, moments, params) = (&mut self.compressor, &mut self.moments, &self.params);
        let plain = compressor.is_none() && moments.is_none();
        let loss = self
            .model
            .gradient_streamed(batch, &mut self.grad, &mut |from, grads| {
                let t = Instant::now();
                let handed = if plain {
                    sink.offer(from, grads, weight)
                } else {
                    // Per shard, what `compute_step` does to the whole: the
                    // batch's weight, Adam's direction, the top-k.
                    let made = sink.offer_with(from, grads, |shard, range, part| {
                        let (push, scale): (&[f32], f32) = match moments.as_mut() {
                            Some(m) => {
                                let k = *direction.get_or_insert_with(|| m.begin(step));
                                scratch.clear();
                                match weight == 1.0 {
                                    true => scratch.extend_from_slice(part),
                                    false => scratch.extend(part.iter().map(|&g| g * weight)),
                                }
                                let at = params.get(range.clone()).unwrap_or(&[]);
                                m.direction_in(&k, range, &mut scratch, at)?;
                                (&scratch, 1.0)
                            }
                            None => (part, weight),
                        };
                        Ok::<_, TrainerError>(match compressor.as_mut() {
                            Some(c) => {
                                let picked = c.compress_block(shard, push, scale)?;
                                sent += picked.len();
                                ShardPush::Sparse(picked)
                            }
                            None => ShardPush::Dense(push.iter().map(|&v| v * scale).collect()),
                        })
                    });
                    made.unwrap_or_else(|e| {
                        failed.get_or_insert(e);
                        0
                    })
                };
                prepare += t.elapsed();
                if from > 0 {
                    early_shards += handed;
                }
            })?;
        if !loss.is_finite() {
            return Err(TrainerError::Diverged(loss));
        }
        if let Some(e) = failed {
            return Err(e);
        }
        let density = match &mut self.compressor {
            Some(c) => {
                c.end_step();
                sent as f64 / self.grad.len().max(1) as f64
            }
            None => 1.0,
        };
        self.step += 1;
        Ok(StepOutput {
            loss,
            grad: None,
            density,
            compute: t0.elapsed().saturating_sub(prepare),
            compress: prepare,
            early_shards,
        })
    }

    /// The step computed whole ([`Self::compute_step`]) and handed to the
    /// sink at once, each shard its part of the push.
    fn whole_into(
        &mut self,
        batch: &Batch,
        weight: f32,
        mut sink: GradSink,
    ) -> Result<StepOutput, TrainerError> {
        let mut out = self.compute_step(batch, weight)?;
        let mut parts: Vec<Option<ShardPush>> = match out.grad.take() {
            Some(Outgoing::Dense(d)) => {
                sink.offer(0, &d, 1.0);
                return Ok(out);
            }
            Some(Outgoing::Sparse(g)) => sink
                .map()
                .split(&g)
                .into_iter()
                .map(|p| Some(ShardPush::Sparse(p)))
                .collect(),
            other => {
                out.grad = other;
                return Ok(out);
            }
        };
        let whole = sink.offer_with(0, &self.grad, |shard, _, _| {
            let part = parts.get_mut(shard).and_then(Option::take);
            Ok::<_, std::convert::Infallible>(
                part.unwrap_or(ShardPush::Sparse(SparseGrad::default())),
            )
        });
        if let Err(never) = whole {
            match never {}
        }
        Ok(out)
    }

    fn compute_step(&mut self, batch: &Batch, weight: f32) -> Result<StepOutput, TrainerError> {
        let t0 = Instant::now();
        let loss = self.model.gradient_into(batch, &mut self.grad)?;
        if !loss.is_finite() {
            return Err(TrainerError::Diverged(loss));
        }
        if weight != 1.0 {
            // The servers average the pushes: weighting each mean gradient
            // by its batch's share keeps the average the global batch's mean.
            self.grad.iter_mut().for_each(|g| *g *= weight);
        }
        if let Some(moments) = &mut self.moments {
            self.model.flat_params_into(&mut self.params)?;
            moments.direction(&mut self.grad, &self.params, self.step)?;
        }
        self.step += 1;
        let compute = t0.elapsed();
        let t1 = Instant::now();
        let n = self.grad.len().max(1) as f64;
        let (grad, density) = match &mut self.compressor {
            None => (Outgoing::Dense(self.grad.clone()), 1.0),
            Some(c) => {
                let sparse = c.compress(&self.grad)?;
                let density = sparse.len() as f64 / n;
                (Outgoing::Sparse(sparse), density)
            }
        };
        Ok(StepOutput {
            loss,
            grad: Some(grad),
            density,
            compute,
            compress: t1.elapsed(),
            early_shards: 0,
        })
    }
}

/// Parameters pulled from the servers.
#[derive(Message)]
#[rtype(result = "Result<(), TrainerError>")]
pub struct ApplyUpdates(pub Vec<ShardUpdate>);

impl Handler<ApplyUpdates> for TrainerActor {
    type Result = Result<(), TrainerError>;
    fn handle(&mut self, msg: ApplyUpdates, _: &mut Context<Self>) -> Self::Result {
        for u in &msg.0 {
            match &u.update {
                ParamUpdate::Dense(values) => self.model.write_range(u.offset, values)?,
                ParamUpdate::Sparse { indices, values } => {
                    self.model.write_sparse(u.offset, indices, values)?
                }
                ParamUpdate::DenseDelta16 { values, .. } => {
                    self.model.add_range(u.offset, &values_from_f16(values))?
                }
                ParamUpdate::SparseDelta16 {
                    indices, values, ..
                } => self
                    .model
                    .add_sparse(u.offset, indices, &values_from_f16(values))?,
            }
        }
        Ok(())
    }
}

/// The model's current flat parameters.
#[derive(Message)]
#[rtype(result = "Vec<f32>")]
pub struct GetParams;

impl Handler<GetParams> for TrainerActor {
    type Result = MessageResult<GetParams>;
    fn handle(&mut self, _: GetParams, _: &mut Context<Self>) -> Self::Result {
        // The model's tensors are always readable on the CPU; an empty
        // vector would fail the offer's length check rather than pass.
        MessageResult(self.model.flat_params().unwrap_or_default())
    }
}

/// Loss and accuracy on a held-out batch, evaluated `chunk` samples at a
/// time (0 = in one pass).
#[derive(Message)]
#[rtype(result = "Result<(f32, f32), TrainerError>")]
pub struct Evaluate {
    pub batch: Arc<Batch>,
    pub chunk: usize,
}

impl Handler<Evaluate> for TrainerActor {
    type Result = Result<(f32, f32), TrainerError>;
    fn handle(&mut self, msg: Evaluate, _: &mut Context<Self>) -> Self::Result {
        Ok(self.model.evaluate_chunked(&msg.batch, msg.chunk)?)
    }
}

/// Recompute the batch-norm running statistics on these training batches
/// before an evaluation (nothing for a model without batch norm).
#[derive(Message)]
#[rtype(result = "Result<(), TrainerError>")]
pub struct CalibrateBn(pub Vec<Arc<Batch>>);

impl Handler<CalibrateBn> for TrainerActor {
    type Result = Result<(), TrainerError>;
    fn handle(&mut self, msg: CalibrateBn, _: &mut Context<Self>) -> Self::Result {
        Ok(self.model.calibrate_bn(&msg.0)?)
    }
}

/// The run's step, from which the dropout masks continue (a worker that
/// rejoins a run draws the masks the run is at).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetStep(pub u64);

impl Handler<SetStep> for TrainerActor {
    type Result = ();
    fn handle(&mut self, msg: SetStep, _: &mut Context<Self>) {
        self.step = msg.0;
        self.model.set_step(msg.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_shared::config::{CompressionKind, SyncMode, TopkScope};

    /// Each setting that keeps a push whole is named; the rest stream.
    #[test]
    fn why_a_push_is_not_streamed_names_the_setting() {
        let mut cfg = ClusterConfig::embedded_default().unwrap();
        assert!(why_not_streamed(&cfg)
            .unwrap()
            .contains("overlap_backward is off"));
        cfg.training.overlap_backward = true;
        let why = why_not_streamed(&cfg).unwrap();
        assert!(why.contains("compression.scope"), "{why}");
        cfg.compression.scope = TopkScope::Shard;
        assert_eq!(why_not_streamed(&cfg), None);
        cfg.compression.clip_norm = 1.0;
        assert!(why_not_streamed(&cfg).unwrap().contains("clip_norm"));
        cfg.compression.kind = CompressionKind::None;
        assert_eq!(
            why_not_streamed(&cfg),
            None,
            "dense pushes need no selection"
        );
        cfg.server.mode = SyncMode::Asp;
        cfg.training.overlap = true;
        assert!(why_not_streamed(&cfg)
            .unwrap()
            .contains("training.overlap "));
    }
}
