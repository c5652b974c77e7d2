//! The state of one parameter shard, free of actors and sockets.
//!
//! A [`ShardState`] owns `params[lo..hi)`, its optimizer state and the BSP
//! barrier for the step in progress. Every push is validated completely before
//! it touches the aggregation buffer, so a bad push is refused with a typed
//! error and leaves the shard exactly as it was.
//!
//! ```
//! use ps_server::shard::{Mode, ShardSetup, ShardState};
//! use ps_server::optimizer::UpdateRule;
//! use ps_shared::protocol::{WireGrad, WireValues};
//! let rule = UpdateRule { lr: 0.5, momentum: 0.0, nesterov: false, weight_decay: 0.0, lars: None };
//! let mut s = ShardState::new(ShardSetup { shard: 0, lo: 0, hi: 4, segments: vec![0..4], rule, workers: 1, mode: Mode::Bsp });
//! s.init(vec![1.0; 4]).unwrap();
//! let grad = WireGrad::Sparse { indices: vec![2], values: WireValues::F32(vec![2.0]) };
//! assert!(s.push(0, 0, grad).unwrap()); // the only worker: the step is applied
//! assert_eq!(s.params(), &[1.0, 1.0, 0.0, 1.0]);
//! ```

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Range;

use ps_shared::protocol::{ErrorCode, ParamUpdate, Response, WireGrad, WireValues};

use crate::checkpoint::ShardCheckpoint;
use crate::optimizer::{fused_update, UpdateRule};

/// A refusal: the code and a message for the client.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub code: ErrorCode,
    pub message: String,
}

impl Refusal {
    fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn into_response(self) -> Response {
        Response::error(self.code, self.message)
    }
}

/// Everything needed to build a shard.
#[derive(Debug, Clone)]
pub struct ShardSetup {
    pub shard: u32,
    pub lo: usize,
    pub hi: usize,
    /// Tensor boundaries inside the shard (local ranges), for LARS.
    pub segments: Vec<Range<usize>>,
    pub rule: UpdateRule,
    /// Worker ranks `0..workers` form the initial barrier.
    pub workers: u32,
    pub mode: Mode,
}

/// How pushes from different workers are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Bulk synchronous: one update per step from every live worker's push.
    Bsp,
    /// Asynchronous: every push is applied on arrival.
    Asp,
    /// Stale synchronous: applied on arrival, but no worker may run more than
    /// `staleness` steps ahead of the slowest live worker.
    Ssp { staleness: u64 },
}

/// Changed-index sets kept for sparse pulls (one per recent version).
const CHANGE_HISTORY: usize = 64;

/// Parameters, optimizer state and the barrier of one shard.
pub struct ShardState {
    setup: ShardSetup,
    params: Vec<f32>,
    momentum: Vec<f32>,
    agg: Vec<f32>,
    /// Which local indices `agg` holds, for sparse clearing and sparse pulls.
    marked: Vec<bool>,
    touched: Vec<u32>,
    all_touched: bool,
    initialized: bool,
    version: u64,
    live: BTreeSet<u32>,
    pushed: BTreeSet<u32>,
    /// Next step each worker pushes (ASP/SSP); kept for workers that left so
    /// they resume where they stopped.
    clocks: BTreeMap<u32, u64>,
    /// Indices changed by each of the last updates, oldest first; the last
    /// entry produced `version` (None: every entry may have moved).
    changes: VecDeque<Option<Vec<u32>>>,
    /// Whether an update can move untouched entries (momentum, weight decay).
    moves_untouched: bool,
}

impl ShardState {
    pub fn new(setup: ShardSetup) -> Self {
        let len = setup.hi - setup.lo;
        let rule = setup.rule;
        let moves_untouched = rule.momentum > 0.0 || rule.weight_decay > 0.0;
        Self {
            params: vec![0.0; len],
            momentum: if rule.momentum > 0.0 {
                vec![0.0; len]
            } else {
                Vec::new()
            },
            agg: vec![0.0; len],
            marked: vec![false; len],
            touched: Vec::new(),
            all_touched: false,
            initialized: false,
            version: 0,
            live: (0..setup.workers).collect(),
            pushed: BTreeSet::new(),
            clocks: (0..setup.workers).map(|w| (w, 0)).collect(),
            changes: VecDeque::new(),
            moves_untouched,
            setup,
        }
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    pub fn id(&self) -> u32 {
        self.setup.shard
    }

    pub fn range(&self) -> Range<usize> {
        self.setup.lo..self.setup.hi
    }

    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Number of updates applied so far (the step being aggregated).
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn is_initialized(&self) -> bool {
        self.initialized
    }

    pub fn live_workers(&self) -> &BTreeSet<u32> {
        &self.live
    }

    /// Everything needed to resume this shard.
    pub fn snapshot(&self, layout_hash: u64) -> ShardCheckpoint {
        ShardCheckpoint {
            shard: self.id(),
            lo: self.setup.lo as u64,
            hi: self.setup.hi as u64,
            layout_hash,
            version: self.version,
            params: self.params.clone(),
            momentum: self.momentum.clone(),
            clocks: self.clocks.iter().map(|(w, c)| (*w, *c)).collect(),
        }
    }

    /// Resume from a checkpoint of this very shard (same range and layout).
    pub fn restore(&mut self, ckpt: ShardCheckpoint, layout_hash: u64) -> Result<(), String> {
        if ckpt.shard != self.id()
            || ckpt.lo as usize != self.setup.lo
            || ckpt.hi as usize != self.setup.hi
            || ckpt.layout_hash != layout_hash
        {
            return Err(format!(
                "checkpoint is of shard {} [{}, {}) layout {:x}, this is shard {} [{}, {}) layout {layout_hash:x}",
                ckpt.shard, ckpt.lo, ckpt.hi, ckpt.layout_hash, self.id(), self.setup.lo, self.setup.hi
            ));
        }
        if ckpt.params.len() != self.len() || ckpt.momentum.len() != self.momentum.len() {
            return Err("checkpoint vectors have the wrong length".into());
        }
        self.params = ckpt.params;
        self.momentum = ckpt.momentum;
        self.version = ckpt.version;
        for (w, c) in ckpt.clocks {
            self.clocks.insert(w, c);
        }
        self.initialized = true;
        self.changes.clear();
        Ok(())
    }

    /// Offer initial values; the first valid offer wins (returns whether this one did).
    pub fn init(&mut self, values: Vec<f32>) -> Result<bool, Refusal> {
        if values.len() != self.len() {
            return Err(Refusal::new(
                ErrorCode::WrongLength,
                format!(
                    "init for shard {} has {} values, the shard has {}",
                    self.id(),
                    values.len(),
                    self.len()
                ),
            ));
        }
        if values.iter().any(|v| !v.is_finite()) {
            return Err(Refusal::new(
                ErrorCode::NonFinite,
                "init values must be finite",
            ));
        }
        if self.initialized {
            return Ok(false);
        }
        self.params = values;
        self.initialized = true;
        Ok(true)
    }

    /// Validate a push without changing anything.
    fn check_push(&self, worker: u32, step: u64, grad: &WireGrad) -> Result<(), Refusal> {
        if !self.initialized {
            return Err(Refusal::new(
                ErrorCode::NotInitialized,
                format!("shard {} has no parameters yet", self.id()),
            ));
        }
        if !self.live.contains(&worker) {
            return Err(Refusal::new(
                ErrorCode::UnknownWorker,
                format!("worker {worker} is not a member of the barrier"),
            ));
        }
        let expected = self.next_step(worker);
        if step < expected || (self.setup.mode == Mode::Bsp && self.pushed.contains(&worker)) {
            return Err(Refusal::new(
                ErrorCode::DuplicatePush,
                format!("worker {worker} already pushed step {step}"),
            ));
        }
        if step != expected {
            return Err(Refusal::new(
                ErrorCode::WrongStep,
                format!(
                    "push for step {step}, shard {} expects step {expected} from worker {worker}",
                    self.id()
                ),
            ));
        }
        let finite = |v: &WireValues| match v {
            WireValues::F32(v) => v.iter().all(|x| x.is_finite()),
            WireValues::F16(v) => v.iter().all(|b| (b & 0x7c00) != 0x7c00),
        };
        match grad {
            WireGrad::Dense(values) => {
                if values.len() != self.len() {
                    return Err(Refusal::new(
                        ErrorCode::WrongLength,
                        format!(
                            "dense push of {} values for a shard of {}",
                            values.len(),
                            self.len()
                        ),
                    ));
                }
                if !finite(values) {
                    return Err(Refusal::new(
                        ErrorCode::NonFinite,
                        "gradient has NaN or inf",
                    ));
                }
            }
            WireGrad::Sparse { indices, values } => {
                if indices.len() != values.len() {
                    return Err(Refusal::new(
                        ErrorCode::WrongLength,
                        format!("{} indices but {} values", indices.len(), values.len()),
                    ));
                }
                let mut prev: Option<u32> = None;
                for &i in indices {
                    if i as usize >= self.len() || prev.is_some_and(|p| p >= i) {
                        return Err(Refusal::new(
                            ErrorCode::OutOfRange,
                            format!(
                                "index {i} is out of range or out of order (shard length {})",
                                self.len()
                            ),
                        ));
                    }
                    prev = Some(i);
                }
                if !finite(values) {
                    return Err(Refusal::new(
                        ErrorCode::NonFinite,
                        "gradient has NaN or inf",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Add a worker's gradient for `step`. Returns whether this push completed
    /// the barrier (and the update was applied).
    pub fn push(&mut self, worker: u32, step: u64, grad: WireGrad) -> Result<bool, Refusal> {
        self.check_push(worker, step, &grad)?;
        match grad {
            WireGrad::Dense(values) => {
                for (a, g) in self.agg.iter_mut().zip(values.into_f32()) {
                    *a += g;
                }
                self.all_touched = true;
            }
            WireGrad::Sparse { indices, values } => {
                for (&i, g) in indices.iter().zip(values.into_f32()) {
                    let i = i as usize;
                    self.agg[i] += g;
                    if !self.marked[i] {
                        self.marked[i] = true;
                        self.touched.push(i as u32);
                    }
                }
            }
        }
        self.pushed.insert(worker);
        if self.setup.mode != Mode::Bsp {
            *self.clocks.entry(worker).or_insert(0) += 1;
            // One update per push, scaled like a BSP average over the live workers.
            let scale = 1.0 / self.live.len().max(1) as f32;
            self.apply(scale);
            return Ok(true);
        }
        Ok(self.maybe_apply())
    }

    /// The step `worker` pushes next.
    pub fn next_step(&self, worker: u32) -> u64 {
        match self.setup.mode {
            Mode::Bsp => self.version,
            Mode::Asp | Mode::Ssp { .. } => self.clocks.get(&worker).copied().unwrap_or(0),
        }
    }

    /// Remove a worker from the barrier; returns whether that completed a step.
    pub fn leave(&mut self, worker: u32) -> bool {
        self.live.remove(&worker);
        self.maybe_apply()
    }

    /// (Re)admit a worker to the barrier. In BSP it joins at the current step;
    /// in ASP/SSP it resumes at its own clock, but never below the slowest
    /// live worker (so it does not hold SSP back).
    pub fn join(&mut self, worker: u32) {
        if self.live.contains(&worker) {
            return;
        }
        let floor = self.min_live_clock();
        self.live.insert(worker);
        if self.setup.mode != Mode::Bsp {
            let clock = self.clocks.entry(worker).or_insert(0);
            *clock = (*clock).max(floor.unwrap_or(0));
        }
    }

    fn min_live_clock(&self) -> Option<u64> {
        self.live
            .iter()
            .filter_map(|w| self.clocks.get(w))
            .min()
            .copied()
    }

    fn maybe_apply(&mut self) -> bool {
        if self.setup.mode != Mode::Bsp
            || self.pushed.is_empty()
            || !self.live.iter().all(|w| self.pushed.contains(w))
        {
            return false;
        }
        let scale = 1.0 / self.pushed.len() as f32;
        self.apply(scale);
        true
    }

    fn apply(&mut self, scale: f32) {
        let segments = self.setup.segments.clone();
        // Lengths are fixed at construction, so the update cannot fail here;
        // keep the shard consistent even if it ever did.
        if let Err(e) = fused_update(
            &mut self.params,
            &self.agg,
            &mut self.momentum,
            &segments,
            &self.setup.rule,
            scale,
        ) {
            tracing::error!(shard = self.id(), "update failed: {e}");
        }
        let sparse_ok = !self.all_touched && !self.moves_untouched;
        if sparse_ok {
            self.touched.sort_unstable();
            for &i in &self.touched {
                self.agg[i as usize] = 0.0;
                self.marked[i as usize] = false;
            }
            self.changes
                .push_back(Some(std::mem::take(&mut self.touched)));
        } else {
            self.agg.fill(0.0);
            self.marked.fill(false);
            self.touched.clear();
            self.changes.push_back(None);
        }
        if self.changes.len() > CHANGE_HISTORY {
            self.changes.pop_front();
        }
        self.all_touched = false;
        self.pushed.clear();
        self.version += 1;
    }

    /// Entries changed between `have` and the current version, if known and few.
    fn changed_since(&self, have: u64) -> Option<Vec<u32>> {
        let behind = usize::try_from(self.version.checked_sub(have)?).ok()?;
        if behind > self.changes.len() {
            return None;
        }
        let mut union = Vec::new();
        for c in self.changes.iter().skip(self.changes.len() - behind) {
            union.extend_from_slice(c.as_deref()?);
            if union.len() * 2 >= self.len() {
                return None;
            }
        }
        union.sort_unstable();
        union.dedup();
        Some(union)
    }

    /// Whether a pull from a worker that will next push `next_step` may be
    /// answered now.
    fn pull_ready(&self, min_version: u64) -> bool {
        match self.setup.mode {
            Mode::Bsp => self.version >= min_version,
            Mode::Asp => true,
            Mode::Ssp { staleness } => {
                // After `min_version` completed steps the worker may go on only
                // while it is at most `staleness` steps ahead of the slowest
                // live worker.
                let slowest = self.min_live_clock().unwrap_or(u64::MAX);
                min_version <= slowest.saturating_add(staleness)
            }
        }
    }

    /// Answer a pull if it may be answered now (BSP: the shard reached
    /// `min_version`; SSP: the staleness bound allows it), else `None`. The
    /// reply is sparse when the updates since `have_version` are remembered
    /// and moved fewer than half the entries.
    pub fn pull(
        &self,
        worker: u32,
        have_version: Option<u64>,
        min_version: u64,
    ) -> Option<Response> {
        if !self.initialized || !self.pull_ready(min_version) {
            return None;
        }
        let update = match have_version.and_then(|h| self.changed_since(h)) {
            Some(changed) => ParamUpdate::Sparse {
                values: changed.iter().map(|&i| self.params[i as usize]).collect(),
                indices: changed,
            },
            None => ParamUpdate::Dense(self.params.clone()),
        };
        Some(Response::Params {
            shard: self.id(),
            version: self.version,
            next_step: self.next_step(worker),
            update,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard_in(workers: u32, momentum: f32, mode: Mode) -> ShardState {
        let rule = UpdateRule {
            lr: 1.0,
            momentum,
            nesterov: false,
            weight_decay: 0.0,
            lars: None,
        };
        let mut s = ShardState::new(ShardSetup {
            shard: 0,
            lo: 10,
            hi: 18,
            segments: std::iter::once(0..8).collect(),
            rule,
            workers,
            mode,
        });
        assert!(s.init(vec![0.0; 8]).unwrap());
        s
    }

    fn shard(workers: u32, momentum: f32) -> ShardState {
        shard_in(workers, momentum, Mode::Bsp)
    }

    fn sparse(indices: Vec<u32>, values: Vec<f32>) -> WireGrad {
        WireGrad::Sparse {
            indices,
            values: WireValues::F32(values),
        }
    }

    #[test]
    fn bsp_waits_for_every_worker_and_averages() {
        let mut s = shard(2, 0.0);
        assert!(!s.push(0, 0, sparse(vec![1], vec![2.0])).unwrap());
        assert!(s.pull(0, Some(0), 1).is_none());
        assert!(s.push(1, 0, sparse(vec![1, 3], vec![4.0, 2.0])).unwrap());
        assert_eq!(s.version(), 1);
        assert_eq!(s.params()[1], -3.0);
        assert_eq!(s.params()[3], -1.0);
        match s.pull(0, Some(0), 1).unwrap() {
            Response::Params {
                update: ParamUpdate::Sparse { indices, values },
                ..
            } => {
                assert_eq!(indices, vec![1, 3]);
                assert_eq!(values, vec![-3.0, -1.0]);
            }
            other => panic!("expected sparse params, got {other:?}"),
        }
        // A worker further behind gets everything.
        assert!(matches!(
            s.pull(0, None, 1),
            Some(Response::Params {
                update: ParamUpdate::Dense(_),
                ..
            })
        ));
    }

    #[test]
    fn momentum_makes_pulls_dense() {
        let mut s = shard(1, 0.9);
        s.push(0, 0, sparse(vec![0], vec![1.0])).unwrap();
        assert!(matches!(
            s.pull(0, Some(0), 1),
            Some(Response::Params {
                update: ParamUpdate::Dense(_),
                ..
            })
        ));
    }

    #[test]
    fn bad_pushes_are_refused_without_side_effects() {
        let mut s = shard(2, 0.0);
        s.push(0, 0, sparse(vec![2], vec![1.0])).unwrap();
        let before = (s.params().to_vec(), s.version());
        let cases = [
            (1, 0, sparse(vec![8], vec![1.0]), ErrorCode::OutOfRange),
            (
                1,
                0,
                sparse(vec![3, 3], vec![1.0, 1.0]),
                ErrorCode::OutOfRange,
            ),
            (1, 0, sparse(vec![1, 2], vec![1.0]), ErrorCode::WrongLength),
            (1, 0, sparse(vec![1], vec![f32::NAN]), ErrorCode::NonFinite),
            (
                1,
                0,
                sparse(vec![1], vec![f32::INFINITY]),
                ErrorCode::NonFinite,
            ),
            (1, 1, sparse(vec![1], vec![1.0]), ErrorCode::WrongStep),
            (0, 1, sparse(vec![1], vec![1.0]), ErrorCode::DuplicatePush),
            (0, 0, sparse(vec![1], vec![1.0]), ErrorCode::DuplicatePush),
            (7, 0, sparse(vec![1], vec![1.0]), ErrorCode::UnknownWorker),
            (
                1,
                0,
                WireGrad::Dense(WireValues::F32(vec![0.0; 3])),
                ErrorCode::WrongLength,
            ),
        ];
        for (worker, step, grad, code) in cases {
            let err = s.push(worker, step, grad).unwrap_err();
            assert_eq!(err.code, code, "{}", err.message);
        }
        assert_eq!((s.params().to_vec(), s.version()), before);
        // The barrier still completes correctly afterwards.
        assert!(s.push(1, 0, sparse(vec![2], vec![3.0])).unwrap());
        assert_eq!(s.params()[2], -2.0);
    }

    #[test]
    fn leaving_worker_releases_the_barrier() {
        let mut s = shard(2, 0.0);
        s.push(0, 0, sparse(vec![0], vec![1.0])).unwrap();
        assert!(s.leave(1));
        assert_eq!(s.version(), 1);
        assert_eq!(s.params()[0], -1.0);
    }

    #[test]
    fn first_init_wins() {
        let mut s = shard(1, 0.0);
        assert!(!s.init(vec![5.0; 8]).unwrap());
        assert_eq!(s.params()[0], 0.0);
        assert_eq!(
            s.init(vec![1.0; 2]).unwrap_err().code,
            ErrorCode::WrongLength
        );
    }

    #[test]
    fn asp_applies_every_push_on_arrival() {
        let mut s = shard_in(2, 0.0, Mode::Asp);
        assert!(s.push(0, 0, sparse(vec![0], vec![2.0])).unwrap());
        assert!(s.push(0, 1, sparse(vec![0], vec![2.0])).unwrap());
        assert_eq!(s.version(), 2);
        assert_eq!(s.params()[0], -2.0);
        assert_eq!(
            s.push(0, 1, sparse(vec![0], vec![1.0])).unwrap_err().code,
            ErrorCode::DuplicatePush
        );
        assert_eq!(
            s.push(1, 3, sparse(vec![0], vec![1.0])).unwrap_err().code,
            ErrorCode::WrongStep
        );
        // Pulls never wait; two updates since version 0 are merged sparsely.
        match s.pull(1, Some(0), 1).unwrap() {
            Response::Params {
                update: ParamUpdate::Sparse { indices, .. },
                next_step,
                ..
            } => {
                assert_eq!(indices, vec![0]);
                assert_eq!(next_step, 0);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ssp_bounds_staleness() {
        let mut s = shard_in(2, 0.0, Mode::Ssp { staleness: 1 });
        // Worker 0 pushes steps 0 and 1 while worker 1 is still at step 0.
        s.push(0, 0, sparse(vec![0], vec![1.0])).unwrap();
        assert!(
            s.pull(0, Some(1), 1).is_some(),
            "step 1 is within the bound"
        );
        s.push(0, 1, sparse(vec![0], vec![1.0])).unwrap();
        assert!(
            s.pull(0, Some(2), 2).is_none(),
            "step 2 would be 2 ahead of worker 1"
        );
        s.push(1, 0, sparse(vec![1], vec![1.0])).unwrap();
        assert!(s.pull(0, Some(2), 2).is_some());
        // A departed slow worker does not hold the others back.
        let mut s = shard_in(2, 0.0, Mode::Ssp { staleness: 0 });
        s.push(0, 0, sparse(vec![0], vec![1.0])).unwrap();
        assert!(s.pull(0, None, 1).is_none());
        s.leave(1);
        assert!(s.pull(0, None, 1).is_some());
        // Rejoining resumes at least at the slowest live clock.
        s.join(1);
        assert_eq!(s.next_step(1), 1);
    }

    #[test]
    fn bsp_rejoin_joins_the_current_step() {
        let mut s = shard(2, 0.0);
        s.push(0, 0, sparse(vec![0], vec![1.0])).unwrap();
        s.leave(1);
        assert_eq!(s.version(), 1);
        s.join(1);
        assert_eq!(s.next_step(1), 1);
        assert!(!s.push(0, 1, sparse(vec![0], vec![1.0])).unwrap());
        assert!(s.push(1, 1, sparse(vec![0], vec![1.0])).unwrap());
        assert_eq!(s.version(), 2);
    }
}
