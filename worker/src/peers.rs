//! The peer cache tier: the cluster's caches serve each other before anyone
//! reads the bucket.
//!
//! **Ownership.** Every training sample has one owner, the rank that reads it
//! first in the run's sample stream ([`Owners`]: a pure function of the
//! sample order, so every rank computes the same table). The owner keeps its
//! samples in its own memory and disk tiers by when *any* rank needs them next
//! (the cluster's next use, see
//! [`Schedule::cluster_next_use`](crate::loader::Schedule::cluster_next_use)),
//! and keeps nothing it does not own once it has used it. The caches together
//! then hold each sample once: with the default reshuffled order and caches
//! that together fit the dataset, no rank reads the bucket after the first
//! epoch.
//!
//! **Asking.** A sample a rank misses in its own tiers is asked of its owner
//! (batched per owner, at most `peers.max_inflight_requests` exchanges in
//! flight, in the order the samples are needed), and read from the bucket
//! instead when the owner does not hold it, refuses, does not answer within
//! `peers.timeout_ms`, is unreachable, or sends bytes that fail the
//! manifest's checksum. A peer that failed is left alone for
//! `peers.retry_after_s`.
//!
//! **Serving.** [`PeerNet`] runs a QUIC endpoint with the rank's worker
//! certificate. Only clients presenting a worker certificate of the cluster's
//! CA get past the handshake; the asker checks that the endpoint carries the
//! owner's rank. An exchange names the dataset by its manifest's checksum
//! (another job's worker is refused), asks for at most
//! [`MAX_PEER_SAMPLES`] samples, and is answered by the rank's loader
//! from its window, memory or disk; a sample the owner is about to read for
//! itself (its first read is under way) is answered once it arrives, within
//! the asker's timeout.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ps_net::peer::{
    decode_peer_reply, decode_peer_request, encode_peer_reply, encode_peer_request, PeerReply,
    PeerRequest, MAX_PEER_REQUEST_BYTES, MAX_PEER_SAMPLES,
};
use ps_net::pki::worker_dns_name;
use ps_net::transport::{self, EndpointLimits, TransportError};
use ps_shared::config::PeersSection;
use ps_shared::sampler::RankPlan;
use ps_shared::sync::lock;
use quinn::{Connection, Endpoint};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio::task::JoinHandle;

use crate::comm::WorkerTls;

/// Largest reply frame an asker reads.
const MAX_REPLY_BYTES: usize = 1 << 30;

/// Who owns each sample: the rank that reads it first from the plan's
/// origin on (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owners {
    owner: Vec<u32>,
}

const NOBODY: u32 = u32::MAX;

impl Owners {
    /// The owners of `plan`'s stream (any rank's plan gives the same table).
    pub fn of_plan(plan: &RankPlan) -> Self {
        let sampler = plan.sampler();
        let n = sampler.num_samples();
        let mut owner = vec![NOBODY; n];
        let mut left = n;
        let origin = plan.origin_pos();
        let mut epoch = origin / n as u64;
        while left > 0 && epoch < plan.epochs() {
            let order = sampler.global_order(epoch, plan.batch_size());
            for (i, &sample) in order.iter().enumerate() {
                let pos = epoch * n as u64 + i as u64;
                if owner[sample] != NOBODY {
                    continue;
                }
                if let Some(rank) = plan.rank_at(pos) {
                    owner[sample] = rank as u32;
                    left -= 1;
                }
            }
            epoch += 1;
        }
        Self { owner }
    }

    /// The owner of `sample`; `None` when no rank reads it in this run.
    pub fn owner(&self, sample: usize) -> Option<u32> {
        self.owner.get(sample).copied().filter(|&r| r != NOBODY)
    }

    /// How many samples `rank` owns.
    pub fn count(&self, rank: u32) -> usize {
        self.owner.iter().filter(|&&r| r == rank).count()
    }
}

/// Faults a peer endpoint can be told to commit, for tests and
/// `ps-worker train --simulate` (`[peers]` of a simulation file).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PeerFaults {
    /// Wait this long before every reply.
    pub delay: Duration,
    /// Flip a byte of every record served.
    pub corrupt: bool,
}

/// A request from another rank, handed to the loader that serves it.
pub struct ServeCall {
    pub samples: Vec<u64>,
    /// One entry per sample: its bytes, or `None` when not held.
    pub reply: oneshot::Sender<Vec<Option<Bytes>>>,
}

/// What the serving side did, for the metrics.
#[derive(Debug, Default)]
pub struct ServeCounters {
    /// Exchanges answered with records.
    pub exchanges: AtomicU64,
    /// Samples served.
    pub samples: AtomicU64,
    /// Sample bytes served.
    pub bytes: AtomicU64,
    /// Samples asked for but not held.
    pub misses: AtomicU64,
    /// Exchanges refused (another dataset, too many samples, no loader).
    pub refused: AtomicU64,
}

/// Why an exchange with a peer failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("peer rank {rank} at {address}: {source}")]
    Transport {
        rank: u32,
        address: String,
        #[source]
        source: TransportError,
    },
    #[error("peer rank {rank} did not answer within {timeout:?}")]
    Timeout { rank: u32, timeout: Duration },
    #[error("peer rank {rank} refused: {message}")]
    Refused { rank: u32, message: String },
    #[error("peer rank {rank} answered {got} records for {asked} samples")]
    BadReply { rank: u32, asked: usize, got: usize },
    #[error("peer rank {rank} does not exist (the cluster has {world} ranks)")]
    NoSuchRank { rank: u32, world: u32 },
}

/// How a rank reaches and serves its peers.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerSettings {
    pub rank: u32,
    pub world: u32,
    /// Where each rank's endpoint is reached (`host:port`), by rank.
    pub addresses: Vec<String>,
    /// Where this rank's endpoint binds.
    pub listen: SocketAddr,
    pub max_inflight_requests: usize,
    pub max_request_samples: usize,
    pub timeout: Duration,
    pub retry_after: Duration,
    pub max_serving: usize,
    /// CRC-32 and length of the dataset's manifest.
    pub dataset: (u32, u64),
}

impl PeerSettings {
    /// The settings of `[peers]` for `rank` of `world`, reading the dataset
    /// whose manifest has checksum `dataset`.
    pub async fn from_config(
        peers: &PeersSection,
        rank: u32,
        world: u32,
        dataset: (u32, u64),
    ) -> Result<Self, TransportError> {
        let listen = transport::resolve(&format!(
            "{}:{}",
            bracket_v6(peers.listen_host.trim()),
            peers.port_of(rank)
        ))
        .await?;
        Ok(Self {
            rank,
            world,
            addresses: (0..world).map(|r| peers.address_of(r)).collect(),
            listen,
            max_inflight_requests: peers.max_inflight_requests,
            max_request_samples: peers.max_request_samples.min(MAX_PEER_SAMPLES),
            timeout: Duration::from_millis(peers.timeout_ms),
            retry_after: ps_shared::config::secs(peers.retry_after_s),
            max_serving: peers.max_serving,
            dataset,
        })
    }
}

fn bracket_v6(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// This rank's peer endpoint and its connections to the other ranks'.
/// Lives as long as the worker; a loader attaches to serve
/// ([`PeerNet::attach`]) and asks through it ([`PeerNet::fetch`]).
pub struct PeerNet {
    settings: PeerSettings,
    /// Where each rank is reached (the settings' addresses, unless set).
    addresses: Mutex<Vec<String>>,
    client: Endpoint,
    server: Endpoint,
    conns: tokio::sync::Mutex<HashMap<u32, Connection>>,
    serve: watch::Sender<Option<mpsc::Sender<ServeCall>>>,
    counters: Arc<ServeCounters>,
    accept: JoinHandle<()>,
}

impl std::fmt::Debug for PeerNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerNet")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Drop for PeerNet {
    fn drop(&mut self) {
        self.accept.abort();
        self.server.close(0u32.into(), b"bye");
        self.client.close(0u32.into(), b"bye");
    }
}

impl PeerNet {
    /// Binds this rank's endpoint (with its worker certificate) and starts
    /// serving; nothing is served until a loader attaches.
    pub fn start(
        settings: PeerSettings,
        tls: &WorkerTls,
        faults: PeerFaults,
    ) -> Result<Arc<Self>, TransportError> {
        let limits = EndpointLimits {
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            max_bidi_streams: settings.max_serving.clamp(1, 1024) as u32,
            ..EndpointLimits::default()
        };
        let server = transport::server_endpoint(
            settings.listen,
            &tls.identity.cert_pem,
            &tls.identity.key_pem,
            &tls.ca_pem,
            &limits,
        )?;
        let client = transport::client_endpoint(
            &tls.ca_pem,
            &tls.identity,
            settings.listen.is_ipv6(),
            &EndpointLimits {
                max_bidi_streams: 1024,
                ..limits
            },
        )?;
        let serve = watch::Sender::new(None);
        let counters = Arc::new(ServeCounters::default());
        let accept = tokio::spawn(accept_loop(
            server.clone(),
            Server {
                serve: serve.subscribe(),
                counters: counters.clone(),
                slots: Arc::new(Semaphore::new(settings.max_serving.max(1))),
                dataset: settings.dataset,
                world: settings.world,
                timeout: settings.timeout,
                limits,
                faults,
            },
        ));
        Ok(Arc::new(Self {
            addresses: Mutex::new(settings.addresses.clone()),
            settings,
            client,
            server,
            conns: tokio::sync::Mutex::new(HashMap::new()),
            serve,
            counters,
            accept,
        }))
    }

    pub fn settings(&self) -> &PeerSettings {
        &self.settings
    }

    /// Where this rank's endpoint is bound.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.server.local_addr()?)
    }

    /// Reach the ranks at `addresses` from now on (by rank): for endpoints
    /// bound to port 0, whose addresses are known only once bound.
    pub fn set_addresses(&self, addresses: Vec<String>) {
        *lock(&self.addresses) = addresses;
    }

    /// What this rank served so far.
    pub fn counters(&self) -> Arc<ServeCounters> {
        self.counters.clone()
    }

    /// Requests from other ranks now go to the returned receiver (the last
    /// loader attached serves; an earlier one stops receiving). A request
    /// that arrives before any loader attached waits for one, within the
    /// timeout.
    pub fn attach(&self, capacity: usize) -> mpsc::Receiver<ServeCall> {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        self.serve.send_replace(Some(tx));
        rx
    }

    /// Asks `owner` for `samples`: one entry per sample, its bytes or
    /// `None`. Bounded by the settings' timeout, connection included; a
    /// failed connection is dropped and dialled again next time.
    pub async fn fetch(
        &self,
        owner: u32,
        samples: &[u64],
    ) -> Result<Vec<Option<Bytes>>, PeerError> {
        let timeout = self.settings.timeout;
        match tokio::time::timeout(timeout, self.exchange(owner, samples)).await {
            Ok(Ok(records)) => Ok(records),
            Ok(Err(e)) => {
                self.conns.lock().await.remove(&owner);
                Err(e)
            }
            Err(_) => {
                self.conns.lock().await.remove(&owner);
                Err(PeerError::Timeout {
                    rank: owner,
                    timeout,
                })
            }
        }
    }

    async fn exchange(&self, owner: u32, samples: &[u64]) -> Result<Vec<Option<Bytes>>, PeerError> {
        let address =
            lock(&self.addresses)
                .get(owner as usize)
                .cloned()
                .ok_or(PeerError::NoSuchRank {
                    rank: owner,
                    world: self.settings.world,
                })?;
        let wrap = |source: TransportError| PeerError::Transport {
            rank: owner,
            address: address.clone(),
            source,
        };
        let conn = self.connection(owner, &address).await.map_err(wrap)?;
        let req = PeerRequest {
            dataset_crc32: self.settings.dataset.0,
            dataset_bytes: self.settings.dataset.1,
            samples: samples.to_vec(),
        };
        let frame = encode_peer_request(&req).map_err(|e| wrap(e.into()))?;
        let (mut send, mut recv) = conn
            .open_bi()
            .await
            .map_err(|e| wrap(TransportError::from(e)))?;
        transport::write_encoded(&mut send, &frame)
            .await
            .map_err(wrap)?;
        let payload = transport::read_frame(&mut recv, MAX_REPLY_BYTES)
            .await
            .map_err(wrap)?;
        match decode_peer_reply(&payload).map_err(|e| wrap(e.into()))? {
            PeerReply::Records(records) if records.len() == samples.len() => {
                Ok(records.into_iter().map(|r| r.map(Bytes::from)).collect())
            }
            PeerReply::Records(records) => Err(PeerError::BadReply {
                rank: owner,
                asked: samples.len(),
                got: records.len(),
            }),
            PeerReply::Refused(message) => Err(PeerError::Refused {
                rank: owner,
                message,
            }),
        }
    }

    async fn connection(&self, owner: u32, address: &str) -> Result<Connection, TransportError> {
        let mut conns = self.conns.lock().await;
        if let Some(c) = conns.get(&owner) {
            if c.close_reason().is_none() {
                return Ok(c.clone());
            }
        }
        let addr = transport::resolve(address).await?;
        let conn = transport::connect(
            &self.client,
            addr,
            &worker_dns_name(owner),
            self.settings.timeout,
        )
        .await?;
        conns.insert(owner, conn.clone());
        Ok(conn)
    }
}

#[derive(Clone)]
struct Server {
    serve: watch::Receiver<Option<mpsc::Sender<ServeCall>>>,
    counters: Arc<ServeCounters>,
    slots: Arc<Semaphore>,
    dataset: (u32, u64),
    world: u32,
    timeout: Duration,
    limits: EndpointLimits,
    faults: PeerFaults,
}

async fn accept_loop(endpoint: Endpoint, server: Server) {
    while let Some(incoming) = endpoint.accept().await {
        let server = server.clone();
        tokio::spawn(async move {
            // The handshake checked the client's certificate against the
            // cluster CA; it must also name a rank of this cluster.
            let Ok(Ok(conn)) = tokio::time::timeout(server.timeout, incoming).await else {
                return;
            };
            match transport::peer_rank(&conn) {
                Ok(rank) if rank < server.world => {}
                Ok(rank) => {
                    tracing::warn!("peer tier: refused rank {rank}: not a rank of this cluster");
                    conn.close(1u32.into(), b"not a rank of this cluster");
                    return;
                }
                Err(e) => {
                    tracing::warn!("peer tier: refused a client: {e}");
                    conn.close(1u32.into(), b"not a worker certificate");
                    return;
                }
            }
            transport::open_after_hello(&conn, &server.limits);
            while let Ok((send, recv)) = conn.accept_bi().await {
                tokio::spawn(server.clone().answer(send, recv));
            }
        });
    }
}

impl Server {
    async fn answer(self, mut send: quinn::SendStream, mut recv: quinn::RecvStream) {
        let Ok(_slot) = self.slots.clone().acquire_owned().await else {
            return;
        };
        let reply = match transport::read_frame(&mut recv, MAX_PEER_REQUEST_BYTES).await {
            Ok(payload) => match decode_peer_request(&payload) {
                Ok(req) => self.records(req).await,
                Err(e) => PeerReply::Refused(format!("malformed request: {e}")),
            },
            Err(_) => return,
        };
        if matches!(reply, PeerReply::Refused(_)) {
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
        }
        if !self.faults.delay.is_zero() {
            tokio::time::sleep(self.faults.delay).await;
        }
        if let Ok(frame) = encode_peer_reply(&reply) {
            let _ = transport::write_encoded(&mut send, &frame).await;
        }
    }

    async fn records(&self, req: PeerRequest) -> PeerReply {
        if (req.dataset_crc32, req.dataset_bytes) != self.dataset {
            return PeerReply::Refused("another dataset (the manifests differ)".into());
        }
        if req.samples.len() > MAX_PEER_SAMPLES {
            return PeerReply::Refused(format!(
                "{} samples asked, at most {MAX_PEER_SAMPLES}",
                req.samples.len()
            ));
        }
        // A worker starts serving before its loader exists (it joins the
        // servers first): wait for the loader rather than refuse.
        let mut serve = self.serve.clone();
        let attach_wait = self.timeout / 2;
        let tx = match tokio::time::timeout(attach_wait, serve.wait_for(Option::is_some)).await {
            Ok(Ok(tx)) => tx.clone(),
            _ => None,
        };
        let Some(tx) = tx else {
            return PeerReply::Refused("not serving (no loader)".into());
        };
        let asked = req.samples.len();
        let (reply, rx) = oneshot::channel();
        if tx
            .send(ServeCall {
                samples: req.samples,
                reply,
            })
            .await
            .is_err()
        {
            return PeerReply::Refused("not serving (the loader stopped)".into());
        }
        let records = match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(records)) => records,
            Ok(Err(_)) => return PeerReply::Refused("not serving (the loader stopped)".into()),
            Err(_) => return PeerReply::Refused("the loader did not answer in time".into()),
        };
        let held = records.iter().flatten().count() as u64;
        let bytes: u64 = records.iter().flatten().map(|b| b.len() as u64).sum();
        let c = &self.counters;
        c.exchanges.fetch_add(1, Ordering::Relaxed);
        c.samples.fetch_add(held, Ordering::Relaxed);
        c.bytes.fetch_add(bytes, Ordering::Relaxed);
        c.misses.fetch_add(asked as u64 - held, Ordering::Relaxed);
        PeerReply::Records(
            records
                .into_iter()
                .map(|r| {
                    r.map(|b| {
                        let mut v = b.to_vec();
                        if self.faults.corrupt {
                            if let Some(x) = v.last_mut() {
                                *x ^= 0x5a;
                            }
                        }
                        v
                    })
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ps_shared::sampler::EpochSampler;

    #[test]
    fn owners_are_the_first_readers_and_agree_across_ranks() {
        // 10 samples, 3 ranks, batches of 2: a global step takes 6 samples,
        // so step 1 straddles into epoch 1 and samples 0..10 of epoch 0 are
        // read by ranks 0,0,1,1,2,2,0,0,1,1.
        let plans: Vec<_> = (0..3)
            .map(|r| EpochSampler::new(10, 3, r, 9).unwrap().plan(2, 3))
            .collect();
        let owners = Owners::of_plan(&plans[0]);
        for p in &plans[1..] {
            assert_eq!(Owners::of_plan(p), owners);
        }
        let order = plans[0].sampler().global_order(0, 2);
        let expect = [0, 0, 1, 1, 2, 2, 0, 0, 1, 1];
        for (i, &s) in order.iter().enumerate() {
            assert_eq!(owners.owner(s), Some(expect[i]), "position {i}");
        }
        assert_eq!(owners.count(0) + owners.count(1) + owners.count(2), 10);
        // Every rank reads what it owns: the owner is a reader of the sample.
        for p in &plans {
            let rank = p.sampler().rank() as u32;
            for b in p.batches_from(0).iter().take_while(|b| b.epoch == 0) {
                for &s in &b.samples {
                    assert_eq!(owners.owner(s), Some(rank));
                }
            }
        }
    }

    #[test]
    fn a_resumed_plan_owns_from_its_origin() {
        // Resumed after 4 samples of epoch 0: those 4 are first read in
        // epoch 1, by whoever takes them there.
        let sampler = EpochSampler::new(8, 2, 0, 5).unwrap();
        let plan = sampler.plan(2, 2);
        let point = plan.resume_point(1);
        let resumed = sampler.plan_from(2, 2, point).unwrap();
        let owners = Owners::of_plan(&resumed);
        let e0 = sampler.global_order(0, 2);
        let e1 = sampler.global_order(1, 2);
        for (i, &s) in e0.iter().enumerate().skip(4) {
            assert_eq!(owners.owner(s), resumed.rank_at(i as u64).map(|r| r as u32));
        }
        for &s in &e0[..4] {
            let at = e1.iter().position(|&x| x == s).unwrap() as u64 + 8;
            assert_eq!(owners.owner(s), resumed.rank_at(at).map(|r| r as u32));
        }
        // A one-epoch run resumed mid-epoch never reads the first 4 again.
        let short = sampler.plan_from(2, 1, point).unwrap();
        let owners = Owners::of_plan(&short);
        assert!(e0[..4].iter().all(|&s| owners.owner(s).is_none()));
    }
}
