//! The pump and the peer cache tier (see [`crate::peers`]): misses asked of
//! their owners before the bucket, the owner's keep-or-drop rule, and the
//! requests of other ranks answered from this loader's window and tiers.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use ps_dataset::Split;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::cache::{CacheError, Lookup};
use crate::loader::pump::{Done, Pump, Source};
use crate::loader::schedule::FAR_FUTURE;
use crate::peers::{Owners, PeerNet, ServeCall};

/// The pump's side of the peer tier.
pub(in crate::loader) struct PeerState {
    pub(super) net: Arc<PeerNet>,
    pub(super) owners: Owners,
    pub(super) me: u32,
    /// Requests of other ranks; `None` once another loader took over.
    pub(super) calls: Option<mpsc::Receiver<ServeCall>>,
    /// Owned samples whose first read has arrived.
    arrived: Vec<bool>,
    /// Requests waiting for an owned sample whose first read is under way.
    parked: HashMap<usize, Vec<oneshot::Sender<Bytes>>>,
    /// `(owner, sample)` to ask, soonest needed first.
    queued: Vec<(u32, usize)>,
    /// Exchanges not started yet.
    requests: VecDeque<(u32, Vec<usize>)>,
    inflight: usize,
    down_until: HashMap<u32, Instant>,
}

impl PeerState {
    pub(in crate::loader) fn new(net: Arc<PeerNet>, owners: Owners, num_samples: usize) -> Self {
        let me = net.settings().rank;
        let calls = Some(net.attach(64));
        Self {
            net,
            owners,
            me,
            calls,
            arrived: vec![false; num_samples],
            parked: HashMap::new(),
            queued: Vec::new(),
            requests: VecDeque::new(),
            inflight: 0,
            down_until: HashMap::new(),
        }
    }

    pub(super) fn owns(&self, sample: usize) -> bool {
        self.owners.owner(sample) == Some(self.me)
    }

    fn is_down(&self, rank: u32) -> bool {
        self.down_until
            .get(&rank)
            .is_some_and(|&t| Instant::now() < t)
    }
}

/// Waits for the next request of another rank (never resolves without a
/// peer tier).
pub(super) async fn next_call(peers: &mut Option<PeerState>) -> Option<ServeCall> {
    match peers.as_mut().and_then(|p| p.calls.as_mut()) {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// One sample of a request being answered.
enum Part {
    Ready(Bytes),
    Disk(oneshot::Receiver<Result<Bytes, CacheError>>),
    Parked(oneshot::Receiver<Bytes>),
    Missing,
}

impl Pump {
    /// How long to keep `sample` after its use at stream position `pos`:
    /// without peers, until this rank's next use; with peers, nothing it
    /// does not own, and what it owns for the rest of the run, ranked by
    /// the next use of any rank (after the run's last use, last of all).
    /// Owned samples are kept even after what looks like their last use:
    /// ranks do not move in lock step (a rank behind may still need a
    /// sample this rank has already used for the last time), and their
    /// room is taken for the whole run anyway.
    pub(super) fn keep_until(&mut self, pos: u64, sample: usize) -> Option<u64> {
        match &self.peers {
            None => self.schedule.next_use_after(pos, sample),
            Some(p) if p.owns(sample) => Some(
                self.schedule
                    .cluster_next_use(sample, pos + 1)
                    .unwrap_or(FAR_FUTURE + sample as u64),
            ),
            Some(_) => None,
        }
    }

    /// Planning reached `epoch` (with peers): owned samples whose recorded
    /// next use has passed (another rank used them) get their next one;
    /// anything else goes.
    pub(super) async fn rekey_owned(&mut self, epoch: u64) {
        let Some(p) = &self.peers else { return };
        let from = epoch * self.schedule.plan().sampler().num_samples() as u64;
        let stale = self.cache.plan().keys_needed_before(from);
        let owned: Vec<(u64, bool)> = stale
            .into_iter()
            .map(|k| (k, usize::try_from(k).is_ok_and(|s| p.owns(s))))
            .collect();
        for (key, owned) in owned {
            let next = owned.then(|| {
                self.schedule
                    .cluster_next_use(key as usize, from)
                    .unwrap_or(FAR_FUTURE + key)
            });
            self.cache.reprioritize(key, next).await;
        }
    }

    /// A missed sample goes to its owner when there is one to ask; returns
    /// whether it was queued for a peer.
    pub(super) fn ask_peer(&mut self, sample: usize) -> bool {
        let Some(p) = &mut self.peers else {
            return false;
        };
        match p.owners.owner(sample) {
            Some(owner) if owner != p.me && !p.is_down(owner) => {
                p.queued.push((owner, sample));
                true
            }
            _ => false,
        }
    }

    /// Turns queued peer samples into exchanges and starts as many as
    /// allowed; samples of a peer that is down go to the bucket.
    pub(super) fn launch_peers(&mut self) {
        let Some(p) = &mut self.peers else { return };
        if !p.queued.is_empty() {
            let per = p.net.settings().max_request_samples.max(1);
            let mut open: HashMap<u32, usize> = HashMap::new();
            for (owner, sample) in std::mem::take(&mut p.queued) {
                match open.get(&owner) {
                    Some(&i) if p.requests[i].1.len() < per => p.requests[i].1.push(sample),
                    _ => {
                        open.insert(owner, p.requests.len());
                        p.requests.push_back((owner, vec![sample]));
                    }
                }
            }
        }
        let max = p.net.settings().max_inflight_requests.max(1);
        let mut to_bucket = Vec::new();
        while p.inflight < max {
            let Some((owner, samples)) = p.requests.pop_front() else {
                break;
            };
            if p.is_down(owner) {
                to_bucket.extend(samples);
                continue;
            }
            let net = p.net.clone();
            p.inflight += 1;
            self.tasks.spawn(async move {
                let keys: Vec<u64> = samples.iter().map(|&s| s as u64).collect();
                let result = net.fetch(owner, &keys).await;
                Done::Peer {
                    owner,
                    samples,
                    result,
                }
            });
        }
        for sample in to_bucket {
            self.read_from_bucket(sample);
        }
    }

    /// The epoch of the first batch waiting for `sample`.
    pub(super) fn need_epoch(&self, sample: usize) -> u64 {
        self.waiting
            .get(&sample)
            .and_then(|w| w.waiters.first())
            .and_then(|&(seq, _)| self.slot(seq).map(|s| s.pos.epoch))
            .unwrap_or(0)
    }

    fn read_from_bucket(&mut self, sample: usize) {
        if let Some(w) = self.waiting.get_mut(&sample) {
            w.source = Source::Bucket;
            self.queued.push(sample);
        }
    }

    /// An exchange with `owner` ended.
    pub(super) async fn complete_peer(
        &mut self,
        owner: u32,
        samples: Vec<usize>,
        result: Result<Vec<Option<Bytes>>, crate::peers::PeerError>,
    ) {
        if let Some(p) = &mut self.peers {
            p.inflight = p.inflight.saturating_sub(1);
        }
        let epoch = samples.first().map_or(0, |&s| self.need_epoch(s));
        let records = match result {
            Ok(records) => records,
            Err(e) => {
                let retry = self.mark_down(owner);
                tracing::warn!(
                    "{e}; reading its {} samples from the bucket, asking again in {retry:?}",
                    samples.len()
                );
                self.shared.stats.update(epoch, |s| {
                    s.peer_errors += 1;
                    s.peer_fallbacks += samples.len() as u64;
                });
                for sample in samples {
                    self.read_from_bucket(sample);
                }
                return;
            }
        };
        self.shared.stats.update(epoch, |s| s.peer_exchanges += 1);
        let mut delivered = Vec::new();
        let mut damaged = 0;
        for (sample, record) in samples.into_iter().zip(records) {
            let epoch = self.need_epoch(sample);
            let Some(bytes) = record else {
                self.shared.stats.update(epoch, |s| s.peer_fallbacks += 1);
                self.read_from_bucket(sample);
                continue;
            };
            match self.reader.verify_record(Split::Train, sample, &bytes) {
                Ok(()) => {
                    let n = bytes.len() as u64;
                    self.shared.stats.update(epoch, |s| s.peer_bytes += n);
                    delivered.push(sample);
                    self.deliver(sample, bytes).await;
                }
                Err(e) => {
                    damaged += 1;
                    if damaged == 1 {
                        tracing::warn!(
                            "peer rank {owner} sent sample {sample} damaged ({e}); reading it from the bucket"
                        );
                    }
                    self.shared.stats.update(epoch, |s| {
                        s.peer_damaged += 1;
                        s.peer_fallbacks += 1;
                    });
                    self.read_from_bucket(sample);
                }
            }
        }
        if damaged > 0 {
            self.mark_down(owner);
        }
        if !delivered.is_empty() {
            // What the bucket would have been asked for them.
            let gets = self
                .reader
                .plan_requests(Split::Train, &delivered, self.settings.max_request_bytes)
                .map_or(0, |r| r.len() as u64);
            self.shared
                .stats
                .update(epoch, |s| s.peer_gets_saved += gets);
        }
    }

    fn mark_down(&mut self, owner: u32) -> std::time::Duration {
        let Some(p) = &mut self.peers else {
            return std::time::Duration::ZERO;
        };
        let retry = p.net.settings().retry_after;
        p.down_until.insert(owner, Instant::now() + retry);
        retry
    }

    /// A sample arrived: an owned one is now held, and requests parked for
    /// it are answered.
    pub(super) fn arrived(&mut self, sample: usize, bytes: &Bytes) {
        let Some(p) = &mut self.peers else { return };
        if !p.owns(sample) {
            return;
        }
        if let Some(a) = p.arrived.get_mut(sample) {
            *a = true;
        }
        for tx in p.parked.remove(&sample).unwrap_or_default() {
            let _ = tx.send(bytes.clone());
        }
    }

    /// Answers another rank's request from the window, the memory tier or
    /// the disk tier; an owned sample whose first read is under way is
    /// answered when it arrives. The reply is sent from its own task.
    pub(super) async fn serve(&mut self, call: ServeCall) {
        let num_samples = self.schedule.plan().sampler().num_samples();
        let mut parts = Vec::with_capacity(call.samples.len());
        for &key in &call.samples {
            let sample = match usize::try_from(key) {
                Ok(s) if s < num_samples => s,
                _ => {
                    parts.push(Part::Missing);
                    continue;
                }
            };
            if let Some(h) = self.held.get(&sample) {
                parts.push(Part::Ready(h.bytes.clone()));
                continue;
            }
            let part = match self.cache.lookup(key).await {
                Lookup::Memory(bytes) => Part::Ready(bytes),
                Lookup::Disk(rx) => Part::Disk(rx),
                Lookup::Miss => match &mut self.peers {
                    Some(p) if p.owns(sample) && !p.arrived[sample] => {
                        let (tx, rx) = oneshot::channel();
                        p.parked.entry(sample).or_default().push(tx);
                        Part::Parked(rx)
                    }
                    _ => Part::Missing,
                },
            };
            parts.push(part);
        }
        // The asker gives up after its timeout: so does the answer.
        let deadline = Instant::now()
            + self
                .peers
                .as_ref()
                .map_or(std::time::Duration::ZERO, |p| p.net.settings().timeout);
        tokio::spawn(async move {
            let mut records = Vec::with_capacity(parts.len());
            for part in parts {
                records.push(match part {
                    Part::Ready(b) => Some(b),
                    Part::Disk(rx) => tokio::time::timeout_at(deadline, rx)
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .and_then(Result::ok),
                    Part::Parked(rx) => tokio::time::timeout_at(deadline, rx)
                        .await
                        .ok()
                        .and_then(Result::ok),
                    Part::Missing => None,
                });
            }
            let _ = call.reply.send(records);
        });
    }
}
