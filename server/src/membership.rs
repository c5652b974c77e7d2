//! Who is in the cluster, as one server process sees it: a sans-IO state
//! machine like [`crate::core`].
//!
//! [`Membership`] admits connections (caps on total and unauthenticated
//! ones, and on unauthenticated ones per source address; when a cap is
//! reached the oldest connection that has not said Hello makes room, so a
//! newcomer is never kept out by connections that never finish), checks each Hello against the rank in the client certificate and
//! the cluster's settings, refuses a second connection for a rank that is
//! alive, rate-limits requests per connection, drops workers that fall
//! silent or never arrive, and decides when the server exits: cleanly when
//! every rank has said goodbye, with an error when no worker joined in time
//! or every worker has been gone too long. The caller passes the time with
//! every event; shard cores learn of joins and departures from its actions.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use ps_server::membership::{Hello, MemberAction, Membership, MembershipSettings};
//! let t0 = Instant::now();
//! let mut m = Membership::new(MembershipSettings { workers: 1, ..MembershipSettings::default() }, t0);
//! assert!(m.connection_opened(1, t0).is_ok());
//! let hello = Hello { protocol_version: ps_net::protocol::PROTOCOL_VERSION, token: "t0ken-123".into(), worker_rank: 0, workers: 1, workers_per_node: 1, num_params: 10, layout_hash: 7 };
//! let settings = MembershipSettings { workers: 1, token: "t0ken-123".into(), num_params: 10, layout_hash: 7, ..MembershipSettings::default() };
//! let mut m = Membership::new(settings, t0);
//! m.connection_opened(1, t0).unwrap();
//! let actions = m.hello(1, 0, &hello, t0).unwrap();
//! assert!(matches!(actions[..], [MemberAction::Joined { rank: 0, conn: 1 }]));
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use ps_net::protocol::{ErrorCode, PROTOCOL_VERSION};
use ps_shared::link::Tokens;

use crate::core::ConnId;

/// The fields of a Hello the server checks.
#[derive(Debug, Clone, PartialEq)]
pub struct Hello {
    pub protocol_version: u32,
    pub token: String,
    pub worker_rank: u32,
    pub workers: u32,
    pub workers_per_node: u32,
    pub num_params: u64,
    pub layout_hash: u64,
}

/// Membership policy.
#[derive(Debug, Clone)]
pub struct MembershipSettings {
    /// The starting worker count: ranks `0..workers` are expected.
    pub workers: u32,
    /// Ranks `workers..max_workers` may join beyond the starting count
    /// (`cluster.max_workers`, ASP and SSP only); at most `workers` means none.
    pub max_workers: u32,
    /// `cluster.workers_per_node`: the servers' clients are the nodes, each
    /// connecting as its first rank and counted as client `rank / workers_per_node`.
    pub workers_per_node: u32,
    pub token: String,
    pub num_params: u64,
    pub layout_hash: u64,
    pub max_connections: usize,
    pub max_unauthenticated: usize,
    /// Connections not yet past Hello from one source address.
    pub max_unauthenticated_per_source: usize,
    /// Requests per second per connection (burst 1 s); 0 = unlimited.
    pub max_requests_per_sec: u32,
    /// A live rank silent this long is dropped.
    pub worker_timeout: Duration,
    /// No worker at all by then: exit with an error; a rank not joined by
    /// then leaves the barrier.
    pub join_timeout: Duration,
    /// Every worker gone (unfinished) this long: exit with an error.
    pub all_gone_grace: Duration,
    /// Exit once every rank said goodbye.
    pub exit_when_done: bool,
}

impl MembershipSettings {
    /// The clients in the barrier: one per node (one per worker when
    /// `workers_per_node` is 1).
    pub fn clients(&self) -> u32 {
        self.workers / self.workers_per_node.max(1)
    }
}

impl Default for MembershipSettings {
    fn default() -> Self {
        Self {
            workers: 2,
            max_workers: 0,
            workers_per_node: 1,
            token: String::new(),
            num_params: 0,
            layout_hash: 0,
            max_connections: 256,
            max_unauthenticated: 32,
            max_unauthenticated_per_source: 8,
            max_requests_per_sec: 0,
            worker_timeout: Duration::from_secs(10),
            join_timeout: Duration::from_secs(300),
            all_gone_grace: Duration::from_secs(60),
            exit_when_done: true,
        }
    }
}

/// What the caller must do.
#[derive(Debug, Clone, PartialEq)]
pub enum MemberAction {
    /// Tell every local shard that `rank` is in the barrier on `conn`.
    Joined { rank: u32, conn: ConnId },
    /// Tell every local shard that `rank` left (`conn`: the connection it was
    /// on, if it had one); `why` is for the log.
    Left {
        rank: u32,
        conn: Option<ConnId>,
        why: String,
    },
    /// Close this connection.
    Close { conn: ConnId, why: String },
    /// Stop the server: `ok` when every worker finished, else an error.
    Exit { ok: bool, message: String },
}

/// A refusal with its code and message.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub code: ErrorCode,
    pub message: String,
}

fn refused(code: ErrorCode, message: impl Into<String>) -> Refused {
    Refused {
        code,
        message: message.into(),
    }
}

struct Conn {
    rank: Option<u32>,
    /// The peer's address, when known (eviction picks among its own first).
    source: Option<IpAddr>,
    /// When the connection arrived (the oldest unauthenticated one makes
    /// room first).
    opened: Instant,
    last_seen: Instant,
    /// Request budget (burst: one second's worth).
    budget: Tokens,
}

/// State of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RankState {
    /// Expected, never connected.
    Pending,
    /// Connected on this connection.
    Live(ConnId),
    /// Left without finishing (dead, silent, or never came); may come back.
    Gone,
    /// Said goodbye when its work was done; may not come back.
    Finished,
    /// Said goodbye because it was told to stop (a signal): done, unless a
    /// replacement takes its place.
    Stopped,
}

impl RankState {
    /// Said goodbye, finished or stopped.
    fn said_goodbye(self) -> bool {
        matches!(self, RankState::Finished | RankState::Stopped)
    }
}

/// The server process's view of the workers.
pub struct Membership {
    s: MembershipSettings,
    started: Instant,
    conns: HashMap<ConnId, Conn>,
    ranks: BTreeMap<u32, RankState>,
    ever_joined: bool,
    /// Since when no rank has been live (after the first join).
    all_gone_since: Option<Instant>,
    exited: bool,
}

impl Membership {
    pub fn new(settings: MembershipSettings, now: Instant) -> Self {
        Self {
            ranks: (0..settings.clients())
                .map(|r| (r, RankState::Pending))
                .collect(),
            s: settings,
            started: now,
            conns: HashMap::new(),
            ever_joined: false,
            all_gone_since: None,
            exited: false,
        }
    }

    /// Open connections, and those not yet past Hello.
    pub fn connections(&self) -> (usize, usize) {
        let unauth = self.conns.values().filter(|c| c.rank.is_none()).count();
        (self.conns.len(), unauth)
    }

    /// Ranks connected now.
    pub fn live(&self) -> BTreeSet<u32> {
        self.ranks
            .iter()
            .filter(|(_, s)| matches!(s, RankState::Live(_)))
            .map(|(r, _)| *r)
            .collect()
    }

    /// Ranks that said goodbye.
    pub fn finished(&self) -> usize {
        self.ranks.values().filter(|s| s.said_goodbye()).count()
    }

    /// A QUIC connection from an unknown source arrived (before TLS
    /// completes); see [`Self::connection_from`].
    pub fn connection_opened(
        &mut self,
        conn: ConnId,
        now: Instant,
    ) -> Result<Vec<MemberAction>, Refused> {
        self.connection_from(conn, None, now)
    }

    /// A QUIC connection from `source` arrived, its address validated
    /// (before TLS completes): admit it, making room when a cap is reached.
    ///
    /// Connections that have not said Hello yet are capped per source
    /// (`max_unauthenticated_per_source`), in all (`max_unauthenticated`),
    /// and count towards `max_connections`. Reaching a cap never refuses the
    /// newcomer: the oldest connection not yet past Hello (from the same
    /// source when that source's cap is reached) is evicted, so a flood of
    /// handshakes that never finish cannot keep a worker out; each eviction
    /// is a [`MemberAction::Close`]. Only when `max_connections` are all
    /// past Hello is the newcomer refused.
    pub fn connection_from(
        &mut self,
        conn: ConnId,
        source: Option<IpAddr>,
        now: Instant,
    ) -> Result<Vec<MemberAction>, Refused> {
        let (total, unauth) = self.connections();
        if total - unauth >= self.s.max_connections {
            return Err(refused(
                ErrorCode::RateLimited,
                format!("server has {total} connections past Hello (server.max_connections)"),
            ));
        }
        let mut out = Vec::new();
        loop {
            let (total, unauth) = self.connections();
            let from_source = source.map_or(0, |ip| self.pre_hello_from(ip));
            let (scope, why) = if from_source >= self.s.max_unauthenticated_per_source.max(1) {
                (
                    source,
                    format!(
                        "evicted: {from_source} connections from this address had not said Hello (server.max_unauthenticated_per_source)"
                    ),
                )
            } else if unauth >= self.s.max_unauthenticated {
                (
                    None,
                    format!(
                        "evicted: {unauth} connections had not said Hello (server.max_unauthenticated)"
                    ),
                )
            } else if total >= self.s.max_connections {
                (
                    None,
                    format!("evicted before Hello: server has {total} connections (server.max_connections)"),
                )
            } else {
                break;
            };
            // Some connection is before Hello here: the caps above are only
            // reached with one, and max_connections are not all past Hello.
            let Some(oldest) = self.oldest_pre_hello(scope) else {
                break;
            };
            self.conns.remove(&oldest);
            out.push(MemberAction::Close { conn: oldest, why });
        }
        self.conns.insert(
            conn,
            Conn {
                rank: None,
                source,
                opened: now,
                last_seen: now,
                budget: Tokens::full(
                    f64::from(self.s.max_requests_per_sec),
                    f64::from(self.s.max_requests_per_sec),
                    now,
                ),
            },
        );
        Ok(out)
    }

    /// Connections from `ip` not yet past Hello.
    fn pre_hello_from(&self, ip: IpAddr) -> usize {
        self.conns
            .values()
            .filter(|c| c.rank.is_none() && c.source == Some(ip))
            .count()
    }

    /// The oldest connection not yet past Hello (from `source` when given).
    fn oldest_pre_hello(&self, source: Option<IpAddr>) -> Option<ConnId> {
        self.conns
            .iter()
            .filter(|(_, c)| c.rank.is_none() && (source.is_none() || c.source == source))
            .min_by_key(|(id, c)| (c.opened, **id))
            .map(|(id, _)| *id)
    }

    /// Check a Hello from `conn` whose client certificate names `cert_rank`.
    pub fn hello(
        &mut self,
        conn: ConnId,
        cert_rank: u32,
        hello: &Hello,
        now: Instant,
    ) -> Result<Vec<MemberAction>, Refused> {
        let Some(c) = self.conns.get(&conn) else {
            return Err(refused(ErrorCode::Internal, "unknown connection"));
        };
        if c.rank.is_some() {
            return Err(refused(
                ErrorCode::BadFrame,
                "Hello was already said on this connection",
            ));
        }
        if hello.protocol_version != PROTOCOL_VERSION {
            return Err(refused(
                ErrorCode::VersionMismatch,
                format!(
                    "client speaks protocol {}, server speaks {PROTOCOL_VERSION}",
                    hello.protocol_version
                ),
            ));
        }
        if !tokens_equal(&hello.token, &self.s.token) {
            return Err(refused(ErrorCode::Unauthorized, "wrong cluster token"));
        }
        if hello.worker_rank != cert_rank {
            return Err(refused(
                ErrorCode::Unauthorized,
                format!(
                    "Hello claims rank {} but the client certificate is for rank {cert_rank}",
                    hello.worker_rank
                ),
            ));
        }
        if hello.workers != self.s.workers || hello.workers_per_node != self.s.workers_per_node {
            return Err(refused(
                ErrorCode::WorkerCountMismatch,
                format!(
                    "worker is configured for cluster.workers = {} and cluster.workers_per_node = {}, this server for {} and {}",
                    hello.workers, hello.workers_per_node, self.s.workers, self.s.workers_per_node
                ),
            ));
        }
        let max = self.s.max_workers.max(self.s.workers);
        if cert_rank >= max {
            let message = if max > self.s.workers {
                format!(
                    "rank {cert_rank} but the cluster admits ranks 0..{max} (cluster.max_workers = {max})"
                )
            } else {
                format!(
                    "rank {cert_rank} but the cluster has {} workers; joining beyond cluster.workers needs cluster.max_workers, in an asp or ssp job",
                    self.s.workers
                )
            };
            return Err(refused(ErrorCode::UnknownWorker, message));
        }
        let wpn = self.s.workers_per_node.max(1);
        if !cert_rank.is_multiple_of(wpn) {
            return Err(refused(
                ErrorCode::UnknownWorker,
                format!(
                    "rank {cert_rank} is not the first rank of its node (cluster.workers_per_node = {wpn}): node {} pushes as rank {}",
                    cert_rank / wpn,
                    cert_rank / wpn * wpn
                ),
            ));
        }
        // The barrier counts clients: nodes when several ranks share one.
        let client = cert_rank / wpn;
        if hello.num_params != self.s.num_params || hello.layout_hash != self.s.layout_hash {
            return Err(refused(
                ErrorCode::LayoutMismatch,
                format!(
                    "worker model has {} parameters (layout {:x}), server has {} ({:x}): use the same [model] config",
                    hello.num_params, hello.layout_hash, self.s.num_params, self.s.layout_hash
                ),
            ));
        }
        if self.ranks.get(&client) == Some(&RankState::Finished) {
            return Err(refused(
                ErrorCode::RankFinished,
                format!(
                    "rank {cert_rank} already finished and said goodbye to this server; \
                     a finished rank cannot rejoin the same run"
                ),
            ));
        }
        if let Some(RankState::Live(other)) = self.ranks.get(&client) {
            if self.conns.contains_key(other) {
                return Err(refused(
                    ErrorCode::RankInUse,
                    format!("rank {cert_rank} is already connected and alive"),
                ));
            }
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            c.rank = Some(client);
            c.last_seen = now;
        }
        self.ranks.insert(client, RankState::Live(conn));
        self.ever_joined = true;
        self.all_gone_since = None;
        Ok(vec![MemberAction::Joined { rank: client, conn }])
    }

    /// A request arrived on `conn`: note the activity; `false` when the
    /// connection is over its request budget.
    pub fn request(&mut self, conn: ConnId, now: Instant) -> bool {
        let rate = f64::from(self.s.max_requests_per_sec);
        let Some(c) = self.conns.get_mut(&conn) else {
            return false;
        };
        c.last_seen = now;
        if rate == 0.0 {
            return true;
        }
        c.budget.try_take(1.0, now)
    }

    /// The authenticated rank of `conn`.
    pub fn rank_of(&self, conn: ConnId) -> Option<u32> {
        self.conns.get(&conn).and_then(|c| c.rank)
    }

    /// `conn`'s worker said goodbye.
    pub fn bye(&mut self, conn: ConnId, finished: bool, now: Instant) -> Vec<MemberAction> {
        let mut out = Vec::new();
        let Some(rank) = self.rank_of(conn) else {
            return out;
        };
        if self.ranks.get(&rank) == Some(&RankState::Live(conn)) {
            let (state, why) = if finished {
                (RankState::Finished, "finished")
            } else {
                (RankState::Stopped, "stopped")
            };
            self.ranks.insert(rank, state);
            out.push(MemberAction::Left {
                rank,
                conn: Some(conn),
                why: why.into(),
            });
        }
        self.check_exit(now, &mut out);
        out
    }

    /// `conn` closed (or failed).
    pub fn connection_closed(
        &mut self,
        conn: ConnId,
        why: &str,
        now: Instant,
    ) -> Vec<MemberAction> {
        let mut out = Vec::new();
        let Some(c) = self.conns.remove(&conn) else {
            return out;
        };
        if let Some(rank) = c.rank {
            if self.ranks.get(&rank) == Some(&RankState::Live(conn)) {
                self.ranks.insert(rank, RankState::Gone);
                out.push(MemberAction::Left {
                    rank,
                    conn: Some(conn),
                    why: format!("connection lost before goodbye ({why})"),
                });
            }
        }
        self.check_exit(now, &mut out);
        out
    }

    /// Timer: silent ranks, ranks that never came, and the exit rules.
    pub fn tick(&mut self, now: Instant) -> Vec<MemberAction> {
        let mut out = Vec::new();
        let silent: Vec<(u32, ConnId)> = self
            .ranks
            .iter()
            .filter_map(|(r, s)| match s {
                RankState::Live(c) => Some((*r, *c)),
                _ => None,
            })
            .filter(|(_, c)| {
                self.conns.get(c).is_some_and(|c| {
                    now.saturating_duration_since(c.last_seen) > self.s.worker_timeout
                })
            })
            .collect();
        for (rank, conn) in silent {
            self.ranks.insert(rank, RankState::Gone);
            out.push(MemberAction::Left {
                rank,
                conn: Some(conn),
                why: format!(
                    "silent for more than {:?} (server.worker_timeout_secs)",
                    self.s.worker_timeout
                ),
            });
            out.push(MemberAction::Close {
                conn,
                why: "silent too long".into(),
            });
        }
        if now.saturating_duration_since(self.started) > self.s.join_timeout {
            let never: Vec<u32> = self
                .ranks
                .iter()
                .filter(|(_, s)| **s == RankState::Pending)
                .map(|(r, _)| *r)
                .collect();
            for rank in never {
                self.ranks.insert(rank, RankState::Gone);
                out.push(MemberAction::Left {
                    rank,
                    conn: None,
                    why: format!(
                        "never joined within {:?} (server.join_timeout_secs); the others go on without it",
                        self.s.join_timeout
                    ),
                });
            }
        }
        self.check_exit(now, &mut out);
        out
    }

    fn check_exit(&mut self, now: Instant, out: &mut Vec<MemberAction>) {
        if self.exited {
            return;
        }
        let finished = self.finished();
        // Every expected rank, and every rank that joined beyond them.
        if self.ranks.values().all(|s| s.said_goodbye()) {
            if self.s.exit_when_done {
                self.exited = true;
                let stopped = self
                    .ranks
                    .values()
                    .filter(|s| matches!(s, RankState::Stopped))
                    .count();
                let message = if stopped == 0 {
                    "every worker finished".to_string()
                } else {
                    format!(
                        "every worker said goodbye: {} finished, {stopped} stopped by a signal",
                        self.ranks.len() - stopped
                    )
                };
                out.push(MemberAction::Exit { ok: true, message });
            }
            return;
        }
        if !self.ever_joined {
            if now.saturating_duration_since(self.started) > self.s.join_timeout {
                self.exited = true;
                out.push(MemberAction::Exit {
                    ok: false,
                    message: format!(
                        "no worker joined within {:?} (server.join_timeout_secs)",
                        self.s.join_timeout
                    ),
                });
            }
            return;
        }
        let any_live = self.ranks.values().any(|s| matches!(s, RankState::Live(_)));
        if any_live {
            self.all_gone_since = None;
            return;
        }
        let since = *self.all_gone_since.get_or_insert(now);
        if now.saturating_duration_since(since) > self.s.all_gone_grace {
            self.exited = true;
            out.push(MemberAction::Exit {
                ok: false,
                message: format!(
                    "every worker has been gone for more than {:?} ({finished} of {} finished; server.all_gone_grace_secs)",
                    self.s.all_gone_grace, self.s.clients()
                ),
            });
        }
    }
}

fn tokens_equal(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(workers: u32) -> MembershipSettings {
        MembershipSettings {
            workers,
            max_workers: 0,
            workers_per_node: 1,
            token: "secret-token".into(),
            num_params: 100,
            layout_hash: 42,
            max_connections: 4,
            max_unauthenticated: 2,
            max_unauthenticated_per_source: 2,
            max_requests_per_sec: 10,
            worker_timeout: Duration::from_secs(3),
            join_timeout: Duration::from_secs(30),
            all_gone_grace: Duration::from_secs(20),
            exit_when_done: true,
        }
    }

    fn hello(rank: u32, workers: u32) -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            token: "secret-token".into(),
            worker_rank: rank,
            workers,
            workers_per_node: 1,
            num_params: 100,
            layout_hash: 42,
        }
    }

    fn secs(t0: Instant, s: u64) -> Instant {
        t0 + Duration::from_secs(s)
    }

    #[test]
    fn ranks_beyond_the_start_count_join_only_when_admitted() {
        let t0 = Instant::now();
        // Without max_workers: refused, naming the setting.
        let mut m = Membership::new(settings(2), t0);
        m.connection_opened(1, t0).unwrap();
        let e = m.hello(1, 2, &hello(2, 2), t0).unwrap_err();
        assert_eq!(e.code, ErrorCode::UnknownWorker);
        assert!(e.message.contains("cluster.max_workers"), "{}", e.message);
        // With max_workers = 3: rank 2 joins, rank 3 does not.
        let mut m = Membership::new(
            MembershipSettings {
                max_workers: 3,
                max_unauthenticated: 4,
                ..settings(2)
            },
            t0,
        );
        for conn in 1..=4 {
            m.connection_opened(conn, t0).unwrap();
        }
        let e = m.hello(4, 3, &hello(3, 2), t0).unwrap_err();
        assert!(e.message.contains("0..3"), "{}", e.message);
        for (conn, rank) in [(1, 0), (2, 1), (3, 2)] {
            let acts = m.hello(conn, rank, &hello(rank, 2), t0).unwrap();
            assert_eq!(acts, vec![MemberAction::Joined { rank, conn }]);
        }
        assert_eq!(m.live().len(), 3);
        // The server ends once the joiner finished too.
        assert!(m
            .bye(1, true, t0)
            .iter()
            .all(|a| !matches!(a, MemberAction::Exit { .. })));
        assert!(m
            .bye(2, true, t0)
            .iter()
            .all(|a| !matches!(a, MemberAction::Exit { .. })));
        assert!(m
            .bye(3, true, t0)
            .iter()
            .any(|a| matches!(a, MemberAction::Exit { ok: true, .. })));
    }

    #[test]
    fn hello_checks_name_their_cause() {
        let t0 = Instant::now();
        let mut m = Membership::new(settings(2), t0);
        let cases = [
            (
                Hello {
                    token: "nope-nope".into(),
                    ..hello(0, 2)
                },
                0,
                ErrorCode::Unauthorized,
            ),
            (hello(1, 2), 0, ErrorCode::Unauthorized), // claims 1, certificate says 0
            (hello(0, 4), 0, ErrorCode::WorkerCountMismatch),
            (hello(7, 2), 7, ErrorCode::UnknownWorker),
            (
                Hello {
                    protocol_version: 1,
                    ..hello(0, 2)
                },
                0,
                ErrorCode::VersionMismatch,
            ),
            (
                Hello {
                    num_params: 1,
                    ..hello(0, 2)
                },
                0,
                ErrorCode::LayoutMismatch,
            ),
        ];
        for (i, (h, cert, code)) in cases.into_iter().enumerate() {
            let conn = i as ConnId;
            m.connection_opened(conn, t0).unwrap();
            assert_eq!(
                m.hello(conn, cert, &h, t0).unwrap_err().code,
                code,
                "case {i}"
            );
            m.connection_closed(conn, "refused", t0);
        }
        assert!(m.live().is_empty());
    }

    #[test]
    fn a_live_rank_cannot_be_taken_over() {
        let t0 = Instant::now();
        let mut m = Membership::new(settings(2), t0);
        m.connection_opened(1, t0).unwrap();
        m.hello(1, 0, &hello(0, 2), t0).unwrap();
        m.connection_opened(2, t0).unwrap();
        assert_eq!(
            m.hello(2, 0, &hello(0, 2), t0).unwrap_err().code,
            ErrorCode::RankInUse
        );
        // Once the first connection is gone, the rank may come back.
        let left = m.connection_closed(1, "timed out", t0);
        assert!(matches!(
            left[..],
            [MemberAction::Left {
                rank: 0,
                conn: Some(1),
                ..
            }]
        ));
        let joined = m.hello(2, 0, &hello(0, 2), t0).unwrap();
        assert_eq!(joined, vec![MemberAction::Joined { rank: 0, conn: 2 }]);
    }

    /// Two ranks that stay up when they finish; rank 0 joined on
    /// connection 1, said goodbye (`finished`: its work is done; else it
    /// was stopped) and that connection closed.
    fn rank_0_gone(finished: bool, t0: Instant) -> Membership {
        let mut m = Membership::new(
            MembershipSettings {
                exit_when_done: false,
                ..settings(2)
            },
            t0,
        );
        m.connection_opened(1, t0).unwrap();
        m.hello(1, 0, &hello(0, 2), t0).unwrap();
        let left = m.bye(1, finished, t0);
        let said = if finished { "finished" } else { "stopped" };
        assert!(matches!(
            left[..],
            [MemberAction::Left { rank: 0, ref why, .. }] if why == said
        ));
        assert!(m.connection_closed(1, "closed", t0).is_empty());
        m
    }

    #[test]
    fn a_finished_rank_cannot_rejoin() {
        let t0 = Instant::now();
        let mut m = rank_0_gone(true, t0);
        // A new connection with the same certificate comes.
        m.connection_opened(2, t0).unwrap();
        let e = m.hello(2, 0, &hello(0, 2), t0).unwrap_err();
        assert_eq!(e.code, ErrorCode::RankFinished);
        assert!(
            e.message.contains("rank 0") && e.message.contains("finished"),
            "{}",
            e.message
        );
        assert_eq!((m.finished(), m.live().len()), (1, 0));
        // The other rank still joins.
        m.connection_opened(3, t0).unwrap();
        assert!(m.hello(3, 1, &hello(1, 2), t0).is_ok());
    }

    #[test]
    fn a_rank_stopped_by_a_signal_may_be_replaced() {
        let t0 = Instant::now();
        let mut m = rank_0_gone(false, t0);
        // A replacement with the same certificate takes its place.
        m.connection_opened(2, t0).unwrap();
        let joined = m.hello(2, 0, &hello(0, 2), t0).unwrap();
        assert_eq!(joined, vec![MemberAction::Joined { rank: 0, conn: 2 }]);
        // Once it finishes, it is done for good.
        m.bye(2, true, t0);
        assert!(m.connection_closed(2, "closed", t0).is_empty());
        m.connection_opened(3, t0).unwrap();
        let e = m.hello(3, 0, &hello(0, 2), t0).unwrap_err();
        assert_eq!(e.code, ErrorCode::RankFinished);
    }

    #[test]
    fn the_exit_message_counts_the_ranks_stopped_by_a_signal() {
        let t0 = Instant::now();
        let mut m = Membership::new(settings(2), t0);
        for (conn, rank) in [(1, 0), (2, 1)] {
            m.connection_opened(conn, t0).unwrap();
            m.hello(conn, rank, &hello(rank, 2), t0).unwrap();
        }
        m.bye(1, true, t0);
        let out = m.bye(2, false, t0);
        let message = out.iter().find_map(|a| match a {
            MemberAction::Exit { ok: true, message } => Some(message.as_str()),
            _ => None,
        });
        assert_eq!(
            message,
            Some("every worker said goodbye: 1 finished, 1 stopped by a signal"),
            "{out:?}"
        );
    }

    #[test]
    fn nodes_join_as_their_first_rank_and_count_as_one_client() {
        let t0 = Instant::now();
        let mut m = Membership::new(
            MembershipSettings {
                workers_per_node: 2,
                max_unauthenticated: 4,
                ..settings(4)
            },
            t0,
        );
        let node = |rank| Hello {
            workers_per_node: 2,
            ..hello(rank, 4)
        };
        for conn in 1..=4 {
            m.connection_opened(conn, t0).unwrap();
        }
        // Rank 1 pushes through node 0's aggregator, never on its own.
        let e = m.hello(1, 1, &node(1), t0).unwrap_err();
        assert_eq!(e.code, ErrorCode::UnknownWorker);
        assert!(
            e.message.contains("cluster.workers_per_node"),
            "{}",
            e.message
        );
        // A worker configured without nodes is refused by name.
        let e = m.hello(2, 0, &hello(0, 4), t0).unwrap_err();
        assert_eq!(e.code, ErrorCode::WorkerCountMismatch);
        assert!(
            e.message.contains("cluster.workers_per_node"),
            "{}",
            e.message
        );
        // Ranks 0 and 2 are nodes 0 and 1.
        let a = m.hello(3, 0, &node(0), t0).unwrap();
        assert_eq!(a, vec![MemberAction::Joined { rank: 0, conn: 3 }]);
        let b = m.hello(4, 2, &node(2), t0).unwrap();
        assert_eq!(b, vec![MemberAction::Joined { rank: 1, conn: 4 }]);
        // Both nodes saying goodbye is every client finished.
        m.bye(3, true, t0);
        let out = m.bye(4, true, t0);
        assert!(
            out.iter()
                .any(|a| matches!(a, MemberAction::Exit { ok: true, .. })),
            "{out:?}"
        );
    }

    #[test]
    fn connection_caps_evict_the_oldest_before_authentication() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut m = Membership::new(settings(2), t0);
        assert_eq!(m.connection_opened(1, at(0)).unwrap(), vec![]);
        assert_eq!(m.connection_opened(2, at(1)).unwrap(), vec![]);
        // Two unauthenticated already: the third gets in, the oldest goes.
        let out = m.connection_opened(3, at(2)).unwrap();
        assert!(
            matches!(&out[..], [MemberAction::Close { conn: 1, why }] if why.contains("server.max_unauthenticated")),
            "{out:?}"
        );
        assert_eq!(m.connections(), (2, 2));
        // An evicted connection's Hello is refused; the newest one joins.
        assert!(m.hello(1, 0, &hello(0, 2), at(3)).is_err());
        m.hello(3, 0, &hello(0, 2), at(3)).unwrap();
        m.connection_opened(4, at(4)).unwrap();
        m.hello(4, 1, &hello(1, 2), at(4)).unwrap();
        // Two past Hello, two before it: the next one evicts connection 2,
        // the oldest before Hello.
        m.connection_opened(5, at(5)).unwrap();
        let out = m.connection_opened(6, at(6)).unwrap();
        assert!(
            matches!(&out[..], [MemberAction::Close { conn: 2, why }] if why.contains("server.max_unauthenticated")),
            "{out:?}"
        );
        assert_eq!(m.connections(), (4, 2));
        // The total cap makes room the same way.
        let mut m = Membership::new(
            MembershipSettings {
                max_unauthenticated: 4,
                ..settings(2)
            },
            t0,
        );
        for (conn, rank) in [(1, 0), (2, 1)] {
            m.connection_opened(conn, at(conn)).unwrap();
            m.hello(conn, rank, &hello(rank, 2), at(conn)).unwrap();
        }
        m.connection_opened(3, at(3)).unwrap();
        m.connection_opened(4, at(4)).unwrap();
        let out = m.connection_opened(5, at(5)).unwrap();
        assert!(
            matches!(&out[..], [MemberAction::Close { conn: 3, why }] if why.contains("server.max_connections")),
            "{out:?}"
        );
        assert_eq!(m.connections(), (4, 2));
        // Evicting makes room only among connections before Hello: with
        // four past it, a newcomer is refused.
        let mut m = Membership::new(
            MembershipSettings {
                max_workers: 4,
                ..settings(2)
            },
            t0,
        );
        for (conn, rank) in [(1, 0), (2, 1), (3, 2), (4, 3)] {
            m.connection_opened(conn, at(conn)).unwrap();
            m.hello(conn, rank, &hello(rank, 2), at(conn)).unwrap();
        }
        let e = m.connection_opened(5, at(5)).unwrap_err();
        assert_eq!(e.code, ErrorCode::RateLimited);
        assert!(
            e.message.contains("server.max_connections"),
            "{}",
            e.message
        );
    }

    #[test]
    fn one_source_cannot_take_every_slot_before_hello() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let flood: IpAddr = "192.0.2.7".parse().unwrap();
        let worker: IpAddr = "198.51.100.3".parse().unwrap();
        let mut m = Membership::new(
            MembershipSettings {
                max_connections: 8,
                max_unauthenticated: 4,
                max_unauthenticated_per_source: 2,
                ..settings(2)
            },
            t0,
        );
        // A source at its cap makes room among its own connections only.
        let mut evicted = Vec::new();
        for conn in 1..=10 {
            for action in m.connection_from(conn, Some(flood), at(conn)).unwrap() {
                let MemberAction::Close { conn, why } = action else {
                    panic!("{action:?}");
                };
                assert!(
                    why.contains("server.max_unauthenticated_per_source"),
                    "{why}"
                );
                evicted.push(conn);
            }
        }
        assert_eq!(evicted, (1..=8).collect::<Vec<_>>());
        assert_eq!(m.connections(), (2, 2));
        // The worker finds a free slot, evicts nobody, and says Hello while
        // the flood goes on.
        assert_eq!(
            m.connection_from(100, Some(worker), at(11)).unwrap(),
            vec![]
        );
        for conn in 11..=20 {
            let out = m.connection_from(conn, Some(flood), at(conn)).unwrap();
            assert!(
                out.iter()
                    .all(|a| !matches!(a, MemberAction::Close { conn: 100, .. })),
                "{out:?}"
            );
        }
        let joined = m.hello(100, 0, &hello(0, 2), at(21)).unwrap();
        assert_eq!(joined, vec![MemberAction::Joined { rank: 0, conn: 100 }]);
        // Many sources: the oldest before Hello goes, whoever it is.
        let out = m.connection_from(200, Some(worker), at(22)).unwrap();
        assert_eq!(out, vec![]);
        let third: IpAddr = "203.0.113.9".parse().unwrap();
        assert_eq!(m.connection_from(201, Some(third), at(23)).unwrap(), vec![]);
        let fourth: IpAddr = "2001:db8::4".parse().unwrap();
        let out = m.connection_from(202, Some(fourth), at(24)).unwrap();
        assert!(
            matches!(&out[..], [MemberAction::Close { conn: 19, why }] if why.contains("server.max_unauthenticated")),
            "{out:?}"
        );
    }

    #[test]
    fn request_budget_refills_with_time() {
        let t0 = Instant::now();
        let mut m = Membership::new(settings(1), t0);
        m.connection_opened(1, t0).unwrap();
        let passed = (0..30).filter(|_| m.request(1, t0)).count();
        assert_eq!(passed, 10, "burst of one second at 10/s");
        assert!(!m.request(1, t0));
        assert!(
            m.request(1, t0 + Duration::from_millis(150)),
            "refilled after 0.15 s"
        );
    }

    #[test]
    fn silent_ranks_are_dropped_and_never_joined_ranks_leave_the_barrier() {
        let t0 = Instant::now();
        let mut m = Membership::new(settings(2), t0);
        m.connection_opened(1, t0).unwrap();
        m.hello(1, 0, &hello(0, 2), t0).unwrap();
        assert!(m.tick(secs(t0, 2)).is_empty());
        let acts = m.tick(secs(t0, 4));
        assert!(acts.contains(&MemberAction::Close {
            conn: 1,
            why: "silent too long".into()
        }));
        assert!(matches!(
            acts[0],
            MemberAction::Left {
                rank: 0,
                conn: Some(1),
                ..
            }
        ));
        // Rank 1 never came: after the join timeout it leaves the barrier.
        let acts = m.tick(secs(t0, 31));
        assert!(acts.iter().any(|a| matches!(
            a,
            MemberAction::Left {
                rank: 1,
                conn: None,
                ..
            }
        )));
    }

    #[test]
    fn a_rank_dropped_for_silence_comes_back_only_on_a_new_connection() {
        let t0 = Instant::now();
        let mut m = Membership::new(settings(2), t0);
        for (conn, rank) in [(1, 0), (2, 1)] {
            m.connection_opened(conn, t0).unwrap();
            m.hello(conn, rank, &hello(rank, 2), t0).unwrap();
        }
        // Rank 1 is paused; rank 0 keeps talking.
        assert!(m.request(1, secs(t0, 3)));
        let acts = m.tick(secs(t0, 4));
        assert_eq!(
            acts,
            vec![
                MemberAction::Left {
                    rank: 1,
                    conn: Some(2),
                    why: "silent for more than 3s (server.worker_timeout_secs)".into(),
                },
                MemberAction::Close {
                    conn: 2,
                    why: "silent too long".into(),
                },
            ]
        );
        assert_eq!(m.live(), BTreeSet::from([0]));
        // It comes back on a new connection: a new admission, which the
        // shards see as a join on that connection (its stale steps on it
        // are then fenced by the shards).
        m.connection_opened(3, secs(t0, 5)).unwrap();
        let acts = m.hello(3, 1, &hello(1, 2), secs(t0, 5)).unwrap();
        assert_eq!(acts, vec![MemberAction::Joined { rank: 1, conn: 3 }]);
        // The old connection closing late changes nothing.
        assert!(m.connection_closed(2, "evicted", secs(t0, 5)).is_empty());
        assert_eq!(m.live(), BTreeSet::from([0, 1]));
    }

    #[test]
    fn ends_are_never_silent() {
        let t0 = Instant::now();
        // Nobody joins: an error after the join timeout.
        let mut m = Membership::new(settings(2), t0);
        assert!(m.tick(secs(t0, 29)).is_empty());
        let acts = m.tick(secs(t0, 31));
        assert!(acts.iter().any(|a| matches!(a, MemberAction::Exit { ok: false, message } if message.contains("no worker joined"))));
        // Everyone leaves without finishing: an error after the grace period.
        let mut m = Membership::new(settings(2), t0);
        for (conn, rank) in [(1, 0), (2, 1)] {
            m.connection_opened(conn, t0).unwrap();
            m.hello(conn, rank, &hello(rank, 2), t0).unwrap();
        }
        m.bye(1, true, secs(t0, 1));
        m.connection_closed(2, "reset", secs(t0, 2));
        assert!(!m
            .tick(secs(t0, 21))
            .iter()
            .any(|a| matches!(a, MemberAction::Exit { .. })));
        let acts = m.tick(secs(t0, 23));
        assert!(acts.iter().any(|a| matches!(a, MemberAction::Exit { ok: false, message } if message.contains("1 of 2 finished"))));
        // Everyone finishes: a clean exit.
        let mut m = Membership::new(settings(2), t0);
        for (conn, rank) in [(1, 0), (2, 1)] {
            m.connection_opened(conn, t0).unwrap();
            m.hello(conn, rank, &hello(rank, 2), t0).unwrap();
        }
        m.bye(1, true, t0);
        let acts = m.bye(2, true, t0);
        assert!(acts
            .iter()
            .any(|a| matches!(a, MemberAction::Exit { ok: true, .. })));
    }
}
