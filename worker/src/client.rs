//! The worker's client as a sans-IO state machine: every policy of talking to
//! the parameter servers, with no sockets, no tasks and no clock of its own.
//!
//! A [`ClientCore`] holds what the worker knows about each shard (the version
//! it holds, the version the trainer applied, the step the shard expects
//! next), the state of each link (one connection per server process) and the
//! exchange under way: a join (an offer to every shard) or a step (a push to
//! every shard). It is driven by [`Event`]s (a reply, a refusal, a lost
//! connection, a redial that worked or failed) and answers with [`Action`]s
//! (send a push, send an offer, redial a link at a given time, deliver the
//! step's parameters, give up). The driver ([`crate::comm::Comm`]) does the
//! IO and passes the time with every event, so retry delays, the attempt and
//! time bounds and the recovery rules are tested without sockets.
//!
//! **Retries.** A refusal that says "later" (`RateLimited`, `Timeout`,
//! `TooManyPending`) sends the same request again after a delay; a lost
//! connection redials its link after a delay. Delays start at
//! [`ClientSettings::first_delay`] and double up to
//! [`ClientSettings::max_delay`]; a shard gets at most
//! [`ClientSettings::max_attempts`] requests per exchange, a link is redialed
//! for at most [`ClientSettings::connect_timeout`], and an exchange ends within
//! [`ClientSettings::budget`]. Each request carries a [`Token`]: a reply whose
//! token is no longer awaited (late, duplicated, or from a connection given
//! up) is ignored.
//!
//! **Recovery.** After a redial the worker offers its copy of every shard of
//! that link (a restarted server rebuilds its shards from the workers'
//! copies). A shard whose reply to the offer is already past the step being
//! pushed applied that step before it died (or the cluster went on without
//! this worker): its reply is the step's result and the push is not sent
//! again.
//!
//! **Global-norm clipping across shards.** With `optimizer.clip_grad_norm`
//! and several shards a shard answers a push with its norm share (the
//! squared norm of its part of the step's mean gradient) instead of the
//! parameters. Once every shard of the step has answered, the core sums the
//! shares (in shard order, so every worker sends the same total) and sends
//! the total to each shard that gave a share ([`Action::Total`]); their
//! replies are the parameters. A shard that already applied the step sends
//! the total it applied along with its share, and that one is used. When a
//! shard answered with its parameters instead of a share (it applied the
//! step without this worker), the sum is unknown: the totals go out empty and
//! wait for another worker's.
//!
//! **Fencing.** A worker the servers declared dead (silent past
//! `server.worker_timeout_secs`) finds its push refused with `Fenced`, or its
//! offer answered at a later step. It then takes the cluster's parameters and
//! step: [`Delivery::next_step`] is beyond the step after the one pushed, and
//! the driver moves its step counter and sample order there.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use ps_net::protocol::{ErrorCode, ParamUpdate};
//! use ps_worker::client::{Action, ClientCore, ClientSettings, Event, Params};
//!
//! let settings = ClientSettings::new(vec![0], Duration::from_secs(30), Duration::from_secs(60));
//! let mut core = ClientCore::new(settings);
//! let t0 = Instant::now();
//! // Join: one offer per shard; the reply is where the worker starts.
//! let acts = core.handle(Event::JoinRequested, t0);
//! let Action::Offer { token, .. } = acts[0] else { panic!() };
//! let params = |version| Params { version, next_step: version, live_workers: 1, update: ParamUpdate::Dense(vec![0.0; 2]), sent: 40, received: 8 };
//! let acts = core.handle(Event::Reply { token, shard: 0, params: params(0) }, t0);
//! assert!(matches!(acts[..], [Action::Deliver(_)]));
//! core.handle(Event::Applied, t0);
//! // A step: the shard is busy, then answers.
//! let acts = core.handle(Event::StepRequested, t0);
//! let Action::Send { token, step: 0, .. } = acts[0] else { panic!() };
//! let acts = core.handle(Event::Refused { token, shard: 0, code: ErrorCode::RateLimited, message: "busy".into() }, t0);
//! let Action::Send { token, at, .. } = acts[0] else { panic!() };
//! assert_eq!(at, t0 + Duration::from_millis(50), "a refusal that says later waits");
//! let acts = core.handle(Event::Reply { token, shard: 0, params: params(1) }, at);
//! let [Action::Deliver(d)] = &acts[..] else { panic!() };
//! assert_eq!((d.next_step, d.pushed_step), (1, 0));
//! ```

use std::time::{Duration, Instant};

use ps_net::protocol::{ErrorCode, ParamUpdate};

/// Index of a shard in the cluster's shard map.
pub type ShardId = usize;
/// Index of a link: one connection per server process.
pub type LinkId = usize;
/// Identifies one request in flight; a reply carrying a token no longer
/// awaited is ignored.
pub type Token = u64;

/// Retry and routing policy of a [`ClientCore`].
#[derive(Debug, Clone)]
pub struct ClientSettings {
    /// The link that serves each shard.
    pub route: Vec<LinkId>,
    /// Requests one shard gets in one exchange (the first one included).
    pub max_attempts: u32,
    /// The first retry delay; each further retry doubles it.
    pub first_delay: Duration,
    /// The longest retry delay.
    pub max_delay: Duration,
    /// How long a lost link is redialed before the exchange gives up
    /// (`server.connect_timeout_secs`).
    pub connect_timeout: Duration,
    /// How long one exchange (a join or a step) may take in all.
    pub budget: Duration,
    /// Push one step number to every shard (BSP, the default): a shard that
    /// expects a later step applied this one without the worker and is
    /// asked for its parameters instead. `false` (ASP and SSP, where a
    /// shard's step is its own clock of this worker's pushes) pushes each
    /// shard the step it expects.
    pub one_step: bool,
    /// Backup workers (`server.backup_workers` > 0, with `one_step`): a
    /// shard that expects a later step still gets this step's push, which it
    /// folds into its next update as a late push (or fences, when too old),
    /// instead of being asked for its parameters with its part of the
    /// gradient dropped.
    pub late_pushes: bool,
}

/// Requests per shard and exchange, the first included.
pub const MAX_ATTEMPTS: u32 = 8;

impl ClientSettings {
    /// The policy for `route` with the config's timeouts: retries from
    /// 50 ms doubling to 2 s, [`MAX_ATTEMPTS`] requests per shard, links
    /// redialed for `connect_timeout`, and an exchange budget of
    /// `connect_timeout + 2 × request_timeout` (a push may wait a whole
    /// request timeout at the barrier, be refused with `Timeout`, and wait
    /// once more after a server came back).
    pub fn new(route: Vec<LinkId>, connect_timeout: Duration, request_timeout: Duration) -> Self {
        Self {
            route,
            max_attempts: MAX_ATTEMPTS,
            first_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(2),
            connect_timeout,
            budget: connect_timeout
                .saturating_add(request_timeout)
                .saturating_add(request_timeout),
            one_step: true,
            late_pushes: false,
        }
    }

    /// The delay before retry number `n` (1 for the first retry): never
    /// zero, doubling from `first_delay` up to `max_delay`.
    pub fn delay(&self, n: u32) -> Duration {
        let first = self.first_delay.max(Duration::from_millis(1));
        let doubled = first.saturating_mul(1u32 << n.saturating_sub(1).min(20));
        doubled.min(self.max_delay.max(first))
    }
}

/// A shard's answer with parameters (a `Response::Params`), with the bytes
/// the exchange moved.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    pub version: u64,
    /// The step the shard expects from this worker next.
    pub next_step: u64,
    pub live_workers: u32,
    pub update: ParamUpdate,
    /// Bytes of the request.
    pub sent: u64,
    /// Bytes of the update in the reply.
    pub received: u64,
}

/// An input to the core.
#[derive(Debug, Clone)]
pub enum Event {
    /// Offer the worker's copy of every shard and take the parameters the
    /// cluster starts (or goes on) from.
    JoinRequested,
    /// Push this step's gradient to every shard (the driver holds each
    /// shard's part).
    StepRequested,
    /// A shard answered the request `token` with parameters.
    Reply {
        token: Token,
        shard: ShardId,
        params: Params,
    },
    /// A shard answered the push `token` with its norm share for `step`
    /// (global-norm clipping across shards), and the total it applied when
    /// it already applied the step.
    Share {
        token: Token,
        shard: ShardId,
        step: u64,
        sum_sq: f64,
        total: Option<f64>,
    },
    /// A shard refused the request `token`.
    Refused {
        token: Token,
        shard: ShardId,
        code: ErrorCode,
        message: String,
    },
    /// The request `token` got no reply: its connection failed or its
    /// deadline passed.
    ConnLost {
        token: Token,
        shard: ShardId,
        error: String,
    },
    /// `link` is usable again (`redialed`: on a new connection).
    Reconnected { link: LinkId, redialed: bool },
    /// One attempt to redial `link` failed.
    DialFailed { link: LinkId, error: String },
    /// Time passed: enforce the exchange's budget.
    Tick,
    /// The trainer applied what the last [`Action::Deliver`] carried.
    Applied,
}

/// What one exchange delivers to the trainer.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    /// New values per shard (merged when a shard answered more than once),
    /// ascending by shard; a shard whose updates could not be merged has
    /// several, to be applied in this order.
    pub updates: Vec<(ShardId, ParamUpdate)>,
    pub pushed_bytes: u64,
    pub pulled_bytes: u64,
    /// Requests sent in this exchange (offers and pushes, retries included).
    pub round_trips: u64,
    /// Fewest workers in any shard's barrier in the replies.
    pub live_workers: u32,
    /// The step pushed (the lowest over the shards); for a join, the step
    /// the worker held before it.
    pub pushed_step: u64,
    /// The step the cluster expects next (the lowest over the shards).
    /// Above `pushed_step + 1` after a step: the cluster went on without
    /// this worker, which must move to this step.
    pub next_step: u64,
    /// Shards that refused the push as fenced (the worker had been declared
    /// dead for that step).
    pub fenced: usize,
}

/// Why an exchange ended without its parameters.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GiveUp {
    #[error("shard {shard} refused the {what}: {code:?}: {message}")]
    Refused {
        shard: ShardId,
        what: &'static str,
        code: ErrorCode,
        message: String,
    },
    #[error("shard {shard} still failed after {attempts} attempts: {last}")]
    Exhausted {
        shard: ShardId,
        attempts: u32,
        last: String,
    },
    #[error("the exchange took more than its {secs:.0} s budget (server.connect_timeout_secs + 2 x server.request_timeout_secs): {last}")]
    OutOfTime { secs: f64, last: String },
    #[error("link {link} could not be redialed within {secs:.0} s (server.connect_timeout_secs): {last}")]
    Unreachable {
        link: LinkId,
        secs: f64,
        last: String,
    },
    #[error("a {what} was requested while another exchange is under way")]
    Busy { what: &'static str },
}

/// An output of the core.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// At `at`, push the step's gradient of `shard` as `step`, holding
    /// `have_version` (the driver reuses its encoded frame while these stay
    /// the same).
    Send {
        token: Token,
        shard: ShardId,
        step: u64,
        have_version: Option<u64>,
        at: Instant,
    },
    /// At `at`, offer the trainer's copy of `shard` (the driver supplies the
    /// values) at `version`, pushing `next_step` next.
    Offer {
        token: Token,
        shard: ShardId,
        version: u64,
        next_step: u64,
        at: Instant,
    },
    /// At `at`, send `shard` the total norm of `step`'s mean gradient
    /// (`None`: unknown to this worker, wait for another worker's), holding
    /// `have_version`; the reply is the parameters.
    Total {
        token: Token,
        shard: ShardId,
        step: u64,
        have_version: Option<u64>,
        total: Option<f64>,
        at: Instant,
    },
    /// At `at`, make `link` usable: when its connection is dead (or, with
    /// `await_close`, once the server closed it), dial again; then report
    /// [`Event::Reconnected`] or [`Event::DialFailed`].
    Reconnect {
        link: LinkId,
        at: Instant,
        await_close: bool,
    },
    /// The exchange is complete.
    Deliver(Delivery),
    /// The exchange failed for good.
    GiveUp(GiveUp),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Join,
    Step,
}

/// Where one shard stands in the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// A push is out (or scheduled).
    Pushing(Token),
    /// An offer is out (or scheduled).
    Offering(Token),
    /// Its link is being redialed.
    AwaitLink,
    /// Its norm share is in; the total goes out once every shard answered.
    Shared,
    /// The total is out (or scheduled).
    Totaling(Token),
    Done,
}

struct Exchange {
    kind: Kind,
    started: Instant,
    /// The step pushed to each shard (the shard's next step at the start).
    pushed_step: Vec<u64>,
    phase: Vec<Phase>,
    results: Vec<Option<Params>>,
    /// Updates a shard sent earlier in the exchange that its later ones
    /// could not be merged into (an f16 change on top of sparse values),
    /// in order; delivered before the shard's result.
    earlier: Vec<(ShardId, ParamUpdate)>,
    /// Requests sent per shard.
    attempts: Vec<u32>,
    /// Refusals that said "later", per shard (for the delay).
    waits: Vec<u32>,
    round_trips: u64,
    fenced: usize,
    last_error: String,
    /// Norm shares per shard (global-norm clipping across shards).
    shares: Vec<Option<f64>>,
    /// The total a shard said it applied.
    known_total: Option<f64>,
}

#[derive(Debug, Clone, Copy, Default)]
struct LinkState {
    /// Since when the link is down (a redial is due or under way).
    down_since: Option<Instant>,
    /// Failed redials since it went down.
    failures: u32,
}

/// The worker's view of the cluster and of the exchange under way.
pub struct ClientCore {
    s: ClientSettings,
    /// The version of each shard the worker holds once it applied the last
    /// delivery.
    versions: Vec<Option<u64>>,
    /// The versions the trainer applied (what offers describe).
    held: Vec<Option<u64>>,
    /// The step each shard expects from this worker next.
    next_steps: Vec<u64>,
    links: Vec<LinkState>,
    exchange: Option<Exchange>,
    next_token: Token,
    recoveries: u64,
    round_trips: u64,
}

/// `newer` applied on top of `older` (both for the same shard), as one
/// update when that can be done without the worker's copy; else both back,
/// to be applied in order.
pub fn merge_updates(
    older: ParamUpdate,
    newer: ParamUpdate,
) -> Result<ParamUpdate, (ParamUpdate, ParamUpdate)> {
    match (older, newer) {
        (_, dense @ ParamUpdate::Dense(_)) => Ok(dense),
        (ParamUpdate::Dense(mut base), newer) => match newer.apply_to(&mut base) {
            Ok(()) => Ok(ParamUpdate::Dense(base)),
            Err(_) => Err((ParamUpdate::Dense(base), newer)),
        },
        (
            ParamUpdate::Sparse {
                indices: ia,
                values: va,
            },
            ParamUpdate::Sparse {
                indices: ib,
                values: vb,
            },
        ) => {
            let mut merged: std::collections::BTreeMap<u32, f32> = ia.into_iter().zip(va).collect();
            merged.extend(ib.into_iter().zip(vb));
            let (indices, values) = merged.into_iter().unzip();
            Ok(ParamUpdate::Sparse { indices, values })
        }
        pair => Err(pair),
    }
}

impl ClientCore {
    pub fn new(settings: ClientSettings) -> Self {
        let shards = settings.route.len();
        let links = settings.route.iter().copied().max().map_or(0, |m| m + 1);
        Self {
            versions: vec![None; shards],
            held: vec![None; shards],
            next_steps: vec![0; shards],
            links: vec![LinkState::default(); links],
            exchange: None,
            next_token: 1,
            recoveries: 0,
            round_trips: 0,
            s: settings,
        }
    }

    pub fn settings(&self) -> &ClientSettings {
        &self.s
    }

    /// The version of each shard the worker holds.
    pub fn versions(&self) -> &[Option<u64>] {
        &self.versions
    }

    /// The step each shard expects next.
    pub fn next_steps(&self) -> &[u64] {
        &self.next_steps
    }

    /// The oldest shard version held.
    pub fn min_version(&self) -> u64 {
        self.versions
            .iter()
            .map(|v| v.unwrap_or(0))
            .min()
            .unwrap_or(0)
    }

    /// `shard` expects `step` next (a make-up round said so, after an
    /// update made without this worker's push): the next push goes there.
    /// Never moves a shard's step back.
    pub fn follow(&mut self, shard: usize, step: u64) {
        if let Some(next) = self.next_steps.get_mut(shard) {
            *next = (*next).max(step);
        }
    }

    /// The step the worker continues from (the lowest over the shards).
    pub fn start_step(&self) -> u64 {
        self.next_steps.iter().copied().min().unwrap_or(0)
    }

    /// Links redialed on a new connection so far.
    pub fn recoveries(&self) -> u64 {
        self.recoveries
    }

    /// Requests sent so far.
    pub fn round_trips(&self) -> u64 {
        self.round_trips
    }

    /// Whether an exchange is under way.
    pub fn busy(&self) -> bool {
        self.exchange.is_some()
    }

    /// Feed one event; returns what the driver must do.
    pub fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::JoinRequested => self.start(Kind::Join, now, &mut out),
            Event::StepRequested => self.start(Kind::Step, now, &mut out),
            Event::Reply {
                token,
                shard,
                params,
            } => {
                if self.awaited(shard, token) {
                    self.reply(shard, params, now, &mut out);
                }
            }
            Event::Share {
                token,
                shard,
                step,
                sum_sq,
                total,
            } => {
                if self.awaited(shard, token) {
                    self.share(shard, step, sum_sq, total, now, &mut out);
                }
            }
            Event::Refused {
                token,
                shard,
                code,
                message,
            } => {
                if self.awaited(shard, token) {
                    self.refused(shard, code, message, now, &mut out);
                }
            }
            Event::ConnLost {
                token,
                shard,
                error,
            } => {
                if self.awaited(shard, token) {
                    if let Some(x) = self.exchange.as_mut() {
                        x.last_error = error;
                    }
                    self.link_lost(self.s.route[shard], false, now, &mut out);
                }
            }
            Event::Reconnected { link, redialed } => {
                self.reconnected(link, redialed, now, &mut out)
            }
            Event::DialFailed { link, error } => self.dial_failed(link, error, now, &mut out),
            Event::Tick => self.check_budget(now, &mut out),
            Event::Applied => self.held.clone_from(&self.versions),
        }
        out
    }

    fn token(&mut self) -> Token {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    /// Whether `token` is the request `shard` waits for.
    fn awaited(&self, shard: ShardId, token: Token) -> bool {
        let Some(x) = &self.exchange else {
            return false;
        };
        match x.phase.get(shard) {
            Some(Phase::Pushing(t)) | Some(Phase::Offering(t)) | Some(Phase::Totaling(t)) => {
                *t == token
            }
            _ => false,
        }
    }

    fn start(&mut self, kind: Kind, now: Instant, out: &mut Vec<Action>) {
        if self.exchange.is_some() {
            out.push(Action::GiveUp(GiveUp::Busy {
                what: match kind {
                    Kind::Join => "join",
                    Kind::Step => "step",
                },
            }));
            return;
        }
        let n = self.s.route.len();
        // In BSP a step pushes one step number to every shard: the lowest any shard
        // expects. A shard that expects a later one applied this step
        // without this worker (it was declared dead when the shard applied
        // it, or it rejoined while the shards stood at different steps):
        // pushing the step's gradient there as that shard's next step would
        // count it for the wrong step and leave this worker one step ahead
        // on that shard for good. Such a shard is asked for its parameters
        // (an offer) instead, and its part of the gradient is dropped, as a
        // fenced push's is.
        let common = self.start_step();
        let pushed_step = match kind {
            Kind::Step if self.s.one_step => vec![common; n],
            Kind::Join | Kind::Step => self.next_steps.clone(),
        };
        self.exchange = Some(Exchange {
            kind,
            started: now,
            pushed_step,
            phase: vec![Phase::Done; n],
            results: vec![None; n],
            earlier: Vec::new(),
            attempts: vec![0; n],
            waits: vec![0; n],
            round_trips: 0,
            fenced: 0,
            last_error: String::new(),
            shares: vec![None; n],
            known_total: None,
        });
        for shard in 0..n {
            if self.links[self.s.route[shard]].down_since.is_some() {
                // A redial left over from an exchange that gave up.
                self.set_phase(shard, Phase::AwaitLink);
                continue;
            }
            match kind {
                Kind::Step
                    if !self.s.one_step
                        || self.s.late_pushes
                        || self.next_steps[shard] == common =>
                {
                    self.send_push(shard, now, out)
                }
                Kind::Step => {
                    tracing::info!(
                        shard,
                        step = common,
                        expects = self.next_steps[shard],
                        "the shard applied this step without this worker: taking its parameters"
                    );
                    self.send_offer(shard, now, out)
                }
                Kind::Join => self.send_offer(shard, now, out),
            }
        }
        for link in 0..self.links.len() {
            if self.links[link].down_since.is_some() {
                out.push(Action::Reconnect {
                    link,
                    at: now,
                    await_close: false,
                });
            }
        }
        self.maybe_deliver(out);
    }

    fn set_phase(&mut self, shard: ShardId, phase: Phase) {
        if let Some(x) = self.exchange.as_mut() {
            x.phase[shard] = phase;
        }
    }

    /// Count one more request for `shard`; `false` (after giving up) when
    /// it has had its attempts.
    fn attempt(&mut self, shard: ShardId, out: &mut Vec<Action>) -> bool {
        let max = self.s.max_attempts.max(1);
        let Some(x) = self.exchange.as_mut() else {
            return false;
        };
        if x.attempts[shard] >= max {
            let give_up = GiveUp::Exhausted {
                shard,
                attempts: x.attempts[shard],
                last: x.last_error.clone(),
            };
            self.give_up(give_up, out);
            return false;
        }
        x.attempts[shard] += 1;
        x.round_trips += 1;
        self.round_trips += 1;
        true
    }

    fn send_push_at(&mut self, shard: ShardId, at: Instant, out: &mut Vec<Action>) {
        if !self.attempt(shard, out) {
            return;
        }
        let token = self.token();
        self.set_phase(shard, Phase::Pushing(token));
        let mut step = self.next_steps[shard];
        if self.s.one_step && self.s.late_pushes {
            // The step this exchange pushes, to a shard ahead of it too.
            if let Some(x) = &self.exchange {
                step = step.min(x.pushed_step[shard]);
            }
        }
        out.push(Action::Send {
            token,
            shard,
            step,
            have_version: self.versions[shard],
            at,
        });
    }

    fn send_push(&mut self, shard: ShardId, now: Instant, out: &mut Vec<Action>) {
        self.send_push_at(shard, now, out);
    }

    fn send_offer_at(&mut self, shard: ShardId, at: Instant, out: &mut Vec<Action>) {
        if !self.attempt(shard, out) {
            return;
        }
        let token = self.token();
        self.set_phase(shard, Phase::Offering(token));
        out.push(Action::Offer {
            token,
            shard,
            version: self.versions[shard].unwrap_or(0),
            next_step: self.next_steps[shard],
            at,
        });
    }

    fn send_offer(&mut self, shard: ShardId, now: Instant, out: &mut Vec<Action>) {
        self.send_offer_at(shard, now, out);
    }

    fn reply(&mut self, shard: ShardId, params: Params, now: Instant, out: &mut Vec<Action>) {
        let Some(x) = self.exchange.as_mut() else {
            return;
        };
        let offered = matches!(x.phase[shard], Phase::Offering(_));
        let pushed = x.pushed_step[shard];
        let kind = x.kind;
        if let Some(base) = params.update.base() {
            if self.versions[shard] != Some(base) {
                // A change from a version this worker will not hold (a
                // server bug or a reordered reply): ask for the values.
                let message = format!(
                    "the change from version {base} for a worker holding {:?}",
                    self.versions[shard]
                );
                x.last_error = format!("shard {shard}: {message}");
                if offered || kind != Kind::Step {
                    self.give_up(
                        GiveUp::Refused {
                            shard,
                            what: "offer",
                            code: ErrorCode::Internal,
                            message: format!("answered with {message}"),
                        },
                        out,
                    );
                } else {
                    self.versions[shard] = None;
                    self.send_push(shard, now, out);
                }
                return;
            }
        }
        self.versions[shard] = Some(params.version);
        self.next_steps[shard] = params.next_step;
        let next_step = params.next_step;
        x.results[shard] = Some(match x.results[shard].take() {
            None => params,
            Some(prev) => {
                let update = match merge_updates(prev.update, params.update) {
                    Ok(merged) => merged,
                    Err((older, newer)) => {
                        x.earlier.push((shard, older));
                        newer
                    }
                };
                Params {
                    update,
                    sent: prev.sent + params.sent,
                    received: prev.received + params.received,
                    ..params
                }
            }
        });
        if offered && kind == Kind::Step && next_step <= pushed {
            // The shard has not applied this step: push it (again).
            self.send_push(shard, now, out);
        } else {
            self.set_phase(shard, Phase::Done);
        }
        self.send_totals(now, out);
        self.maybe_deliver(out);
    }

    /// `shard` answered the push with its norm share for `step`.
    fn share(
        &mut self,
        shard: ShardId,
        step: u64,
        sum_sq: f64,
        total: Option<f64>,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        let Some(x) = self.exchange.as_mut() else {
            return;
        };
        if !matches!(x.phase[shard], Phase::Pushing(_)) || step != x.pushed_step[shard] {
            let message = format!(
                "a norm share for step {step}, but step {} was pushed",
                x.pushed_step[shard]
            );
            self.give_up(
                GiveUp::Refused {
                    shard,
                    what: "step",
                    code: ErrorCode::WrongStep,
                    message,
                },
                out,
            );
            return;
        }
        x.shares[shard] = Some(sum_sq);
        if total.is_some() {
            x.known_total = total;
        }
        x.phase[shard] = Phase::Shared;
        self.send_totals(now, out);
    }

    /// Once no shard waits for a push, an offer or a link, send the total
    /// norm to every shard that gave its share: the total a shard applied,
    /// else the sum of every shard's share in shard order (the same on
    /// every worker), else `None` (a shard answered without a share).
    fn send_totals(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some(x) = &self.exchange else {
            return;
        };
        let waiting = x
            .phase
            .iter()
            .any(|p| matches!(p, Phase::Pushing(_) | Phase::Offering(_) | Phase::AwaitLink));
        if waiting || !x.phase.contains(&Phase::Shared) {
            return;
        }
        let total = self.total_for();
        for shard in 0..self.s.route.len() {
            let shared = self
                .exchange
                .as_ref()
                .is_some_and(|x| x.phase[shard] == Phase::Shared);
            if shared {
                self.send_total_at(shard, total, now, out);
            }
        }
    }

    fn send_total_at(
        &mut self,
        shard: ShardId,
        total: Option<f64>,
        at: Instant,
        out: &mut Vec<Action>,
    ) {
        if !self.attempt(shard, out) {
            return;
        }
        let token = self.token();
        let Some(x) = self.exchange.as_mut() else {
            return;
        };
        x.phase[shard] = Phase::Totaling(token);
        let step = x.pushed_step[shard];
        out.push(Action::Total {
            token,
            shard,
            step,
            have_version: self.versions[shard],
            total,
            at,
        });
    }

    /// The total norm this worker sends: the one a shard applied, else the
    /// sum of every shard's share, else unknown.
    fn total_for(&self) -> Option<f64> {
        let x = self.exchange.as_ref()?;
        x.known_total.or_else(|| {
            x.shares
                .iter()
                .try_fold(0.0f64, |sum, share| share.map(|s| sum + s))
        })
    }

    fn refused(
        &mut self,
        shard: ShardId,
        code: ErrorCode,
        message: String,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        let Some(x) = self.exchange.as_mut() else {
            return;
        };
        let offering = matches!(x.phase[shard], Phase::Offering(_));
        let totaling = matches!(x.phase[shard], Phase::Totaling(_));
        x.last_error = format!("shard {shard}: {code:?}: {message}");
        match code {
            ErrorCode::RateLimited | ErrorCode::Timeout | ErrorCode::TooManyPending => {
                x.waits[shard] += 1;
                let delay = self.s.delay(x.waits[shard]);
                let at = now + delay;
                if at > x.started + self.s.budget {
                    let last = x.last_error.clone();
                    self.give_up(self.out_of_time(last), out);
                    return;
                }
                if offering {
                    self.send_offer_at(shard, at, out);
                } else if totaling {
                    let total = self.total_for();
                    self.send_total_at(shard, total, at, out);
                } else {
                    self.send_push_at(shard, at, out);
                }
            }
            ErrorCode::UnknownWorker | ErrorCode::ShuttingDown | ErrorCode::NotInitialized => {
                let await_close = code == ErrorCode::ShuttingDown;
                self.link_lost(self.s.route[shard], await_close, now, out);
            }
            ErrorCode::Fenced if !offering && !totaling => {
                // Declared dead for this step: take the cluster's parameters
                // and step through an offer instead of pushing again.
                x.fenced += 1;
                self.send_offer(shard, now, out);
            }
            code => {
                let what = if offering {
                    "offer"
                } else if totaling {
                    "norm total"
                } else {
                    "step"
                };
                self.give_up(
                    GiveUp::Refused {
                        shard,
                        what,
                        code,
                        message,
                    },
                    out,
                );
            }
        }
    }

    fn out_of_time(&self, last: String) -> GiveUp {
        GiveUp::OutOfTime {
            secs: self.s.budget.as_secs_f64(),
            last,
        }
    }

    /// `link` failed: every shard it serves waits for a redial, then offers
    /// again what the trainer holds.
    fn link_lost(&mut self, link: LinkId, await_close: bool, now: Instant, out: &mut Vec<Action>) {
        let Some(x) = self.exchange.as_mut() else {
            return;
        };
        for shard in 0..self.s.route.len() {
            if self.s.route[shard] != link {
                continue;
            }
            // Forget this exchange's replies from that link: the offers
            // describe what the trainer holds.
            if x.results[shard].take().is_some() {
                self.versions[shard] = self.held[shard];
                self.next_steps[shard] = x.pushed_step[shard];
            }
            // A restarted server forgot its barrier: the share comes again
            // with the push.
            x.shares[shard] = None;
            x.phase[shard] = Phase::AwaitLink;
        }
        let state = &mut self.links[link];
        if state.down_since.is_some() {
            // A redial is already due.
            return;
        }
        state.down_since = Some(now);
        state.failures = 0;
        let at = now + self.s.delay(1);
        if at > x.started + self.s.budget {
            let last = x.last_error.clone();
            self.give_up(self.out_of_time(last), out);
            return;
        }
        out.push(Action::Reconnect {
            link,
            at,
            await_close,
        });
    }

    fn reconnected(&mut self, link: LinkId, redialed: bool, now: Instant, out: &mut Vec<Action>) {
        let Some(state) = self.links.get_mut(link) else {
            return;
        };
        if state.down_since.take().is_none() {
            return;
        }
        state.failures = 0;
        if redialed {
            self.recoveries += 1;
        }
        if self.exchange.is_none() {
            return;
        }
        for shard in 0..self.s.route.len() {
            let waiting = self
                .exchange
                .as_ref()
                .is_some_and(|x| x.phase[shard] == Phase::AwaitLink);
            if self.s.route[shard] == link && waiting {
                self.send_offer(shard, now, out);
            }
        }
        self.maybe_deliver(out);
    }

    fn dial_failed(&mut self, link: LinkId, error: String, now: Instant, out: &mut Vec<Action>) {
        let Some(state) = self.links.get_mut(link) else {
            return;
        };
        let Some(since) = state.down_since else {
            return;
        };
        state.failures += 1;
        let at = now + self.s.delay(state.failures + 1);
        let failures = state.failures;
        if at > since + self.s.connect_timeout {
            self.give_up(
                GiveUp::Unreachable {
                    link,
                    secs: self.s.connect_timeout.as_secs_f64(),
                    last: error,
                },
                out,
            );
            return;
        }
        if let Some(x) = self.exchange.as_mut() {
            x.last_error = error;
            if at > x.started + self.s.budget {
                let last = x.last_error.clone();
                self.give_up(self.out_of_time(last), out);
                return;
            }
        }
        tracing::debug!(link, failures, "redial failed, trying again");
        out.push(Action::Reconnect {
            link,
            at,
            await_close: false,
        });
    }

    fn check_budget(&mut self, now: Instant, out: &mut Vec<Action>) {
        if let Some(x) = &self.exchange {
            if now > x.started + self.s.budget {
                let last = x.last_error.clone();
                self.give_up(self.out_of_time(last), out);
            }
        }
    }

    /// End the exchange without parameters: what this exchange received is
    /// forgotten, the worker holds what the trainer applied.
    fn give_up(&mut self, why: GiveUp, out: &mut Vec<Action>) {
        if let Some(x) = self.exchange.take() {
            for shard in 0..self.s.route.len() {
                if x.results[shard].is_some() {
                    self.versions[shard] = self.held[shard];
                    self.next_steps[shard] = x.pushed_step[shard];
                }
            }
        }
        out.push(Action::GiveUp(why));
    }

    fn maybe_deliver(&mut self, out: &mut Vec<Action>) {
        let complete = self
            .exchange
            .as_ref()
            .is_some_and(|x| x.phase.iter().all(|p| *p == Phase::Done));
        if !complete {
            return;
        }
        let Some(x) = self.exchange.take() else {
            return;
        };
        let mut d = Delivery {
            updates: Vec::new(),
            pushed_bytes: 0,
            pulled_bytes: 0,
            round_trips: x.round_trips,
            live_workers: u32::MAX,
            pushed_step: x.pushed_step.iter().copied().min().unwrap_or(0),
            next_step: self.start_step(),
            fenced: x.fenced,
        };
        let mut earlier = x.earlier;
        // By shard, each shard's in the order they came (a stable sort).
        earlier.sort_by_key(|(s, _)| *s);
        let mut earlier = earlier.into_iter().peekable();
        for (shard, r) in x.results.into_iter().enumerate() {
            let Some(r) = r else { continue };
            d.pushed_bytes += r.sent;
            d.pulled_bytes += r.received;
            d.live_workers = d.live_workers.min(r.live_workers);
            while let Some(e) = earlier.next_if(|(s, _)| *s == shard) {
                d.updates.push(e);
            }
            d.updates.push((shard, r.update));
        }
        out.push(Action::Deliver(d));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(version: u64, next_step: u64) -> Params {
        Params {
            version,
            next_step,
            live_workers: 2,
            update: ParamUpdate::Sparse {
                indices: vec![version as u32],
                values: vec![version as f32],
            },
            sent: 10,
            received: 8,
        }
    }

    /// The reply `params` of `shard` to the request `token`.
    fn reply(token: Token, shard: ShardId, params: Params) -> Event {
        Event::Reply {
            token,
            shard,
            params,
        }
    }

    /// The request `token` to `shard` got no reply (`error` says why).
    fn lost(token: Token, shard: ShardId, error: &str) -> Event {
        Event::ConnLost {
            token,
            shard,
            error: error.into(),
        }
    }

    fn core(route: Vec<LinkId>) -> ClientCore {
        ClientCore::new(ClientSettings::new(
            route,
            Duration::from_secs(10),
            Duration::from_secs(20),
        ))
    }

    /// Join every shard at version 0.
    fn joined(route: Vec<LinkId>, t0: Instant) -> ClientCore {
        let shards = route.len();
        joined_at(core(route), &vec![0; shards], t0)
    }

    /// Join with shard `s` answering at version and step `at[s]`.
    fn joined_at(mut c: ClientCore, at: &[u64], t0: Instant) -> ClientCore {
        for a in c.handle(Event::JoinRequested, t0) {
            if let Action::Offer { token, shard, .. } = a {
                c.handle(reply(token, shard, params(at[shard], at[shard])), t0);
            }
        }
        c.handle(Event::Applied, t0);
        assert!(!c.busy());
        c
    }

    /// The (shard, step) of each push among `acts`.
    fn pushes(acts: &[Action]) -> Vec<(ShardId, u64)> {
        acts.iter()
            .filter_map(|a| match a {
                Action::Send { shard, step, .. } => Some((*shard, *step)),
                _ => None,
            })
            .collect()
    }

    fn sends(acts: &[Action]) -> Vec<(Token, ShardId)> {
        acts.iter()
            .filter_map(|a| match a {
                Action::Send { token, shard, .. } | Action::Offer { token, shard, .. } => {
                    Some((*token, *shard))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn retry_delays_double_from_50_ms_to_2_s_and_are_never_zero() {
        let s = ClientSettings::new(vec![0], Duration::from_secs(1), Duration::from_secs(1));
        let delays: Vec<u128> = (1..=8).map(|n| s.delay(n).as_millis()).collect();
        assert_eq!(delays, vec![50, 100, 200, 400, 800, 1600, 2000, 2000]);
        let zero = ClientSettings {
            first_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
            ..s
        };
        assert!(zero.delay(1) > Duration::ZERO && zero.delay(30) > Duration::ZERO);
    }

    #[test]
    fn a_lost_link_is_redialed_and_offered_and_an_applied_step_not_pushed_again() {
        let t0 = Instant::now();
        // Shards 0 and 1 on link 0, shard 2 on link 1.
        let mut c = joined(vec![0, 0, 1], t0);
        let acts = c.handle(Event::StepRequested, t0);
        let s = sends(&acts);
        assert_eq!(s.len(), 3);
        // Shard 0 answers, then link 0 dies under shard 1.
        c.handle(reply(s[0].0, 0, params(1, 1)), t0);
        let acts = c.handle(lost(s[1].0, 1, "reset"), t0);
        let [Action::Reconnect { link: 0, at, .. }] = acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!(at, t0 + Duration::from_millis(50));
        assert_eq!(
            c.versions()[0],
            Some(0),
            "the reply of a lost link is forgotten"
        );
        // A late reply on the dead link is ignored.
        assert!(c.handle(reply(s[1].0, 1, params(1, 1)), at,).is_empty());
        let acts = c.handle(
            Event::Reconnected {
                link: 0,
                redialed: true,
            },
            at,
        );
        let offers: Vec<_> = acts
            .iter()
            .filter_map(|a| match a {
                Action::Offer {
                    token,
                    shard,
                    version: 0,
                    next_step: 0,
                    ..
                } => Some((*token, *shard)),
                _ => None,
            })
            .collect();
        assert_eq!(offers.len(), 2, "{acts:?}");
        assert_eq!(c.recoveries(), 1);
        // Shard 0 had applied step 0 (the offer's reply is past it); shard 1
        // had not: only shard 1 is pushed again.
        assert!(c
            .handle(reply(offers[0].0, 0, params(1, 1)), at,)
            .is_empty());
        let acts = c.handle(reply(offers[1].0, 1, params(0, 0)), at);
        let [Action::Send {
            token,
            shard: 1,
            step: 0,
            ..
        }] = acts[..]
        else {
            panic!("{acts:?}")
        };
        c.handle(reply(s[2].0, 2, params(1, 1)), at);
        let acts = c.handle(reply(token, 1, params(1, 1)), at);
        let [Action::Deliver(d)] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!((d.pushed_step, d.next_step, d.updates.len()), (0, 1, 3));
        // 3 pushes, 2 offers, 1 push again.
        assert_eq!(d.round_trips, 6);
    }

    fn change16(base: u64, indices: Option<Vec<u32>>, values: Vec<f32>) -> ParamUpdate {
        let values = ps_shared::sparse::values_to_f16(&values);
        match indices {
            None => ParamUpdate::DenseDelta16 { base, values },
            Some(indices) => ParamUpdate::SparseDelta16 {
                base,
                indices,
                values,
            },
        }
    }

    #[test]
    fn f16_changes_merge_onto_whole_values_and_stay_apart_from_sparse_ones() {
        let merged = merge_updates(
            ParamUpdate::Dense(vec![1.0, 2.0]),
            change16(3, None, vec![0.5, -1.0]),
        );
        assert_eq!(merged, Ok(ParamUpdate::Dense(vec![1.5, 1.0])));
        let merged = merge_updates(
            ParamUpdate::Dense(vec![1.0, 2.0]),
            change16(3, Some(vec![1]), vec![0.25]),
        );
        assert_eq!(merged, Ok(ParamUpdate::Dense(vec![1.0, 2.25])));
        // Values, then a change of entries they do not hold: both, in order.
        let older = ParamUpdate::Sparse {
            indices: vec![0],
            values: vec![4.0],
        };
        let newer = change16(3, Some(vec![1]), vec![0.25]);
        assert_eq!(
            merge_updates(older.clone(), newer.clone()),
            Err((older.clone(), newer.clone()))
        );
        assert_eq!(
            merge_updates(newer, ParamUpdate::Dense(vec![0.0; 2])),
            Ok(ParamUpdate::Dense(vec![0.0; 2]))
        );
    }

    #[test]
    fn an_offer_then_an_f16_change_are_delivered_in_order() {
        let t0 = Instant::now();
        let mut c = joined(vec![0], t0);
        let s = sends(&c.handle(Event::StepRequested, t0));
        c.handle(lost(s[0].0, 0, "reset"), t0);
        let acts = c.handle(
            Event::Reconnected {
                link: 0,
                redialed: true,
            },
            t0,
        );
        let offers = sends(&acts);
        assert_eq!(offers.len(), 1, "{acts:?}");
        // The shard had not applied step 0: push it again after the offer.
        let acts = c.handle(reply(offers[0].0, 0, params(0, 0)), t0);
        let [Action::Send {
            token,
            have_version: Some(0),
            ..
        }] = acts[..]
        else {
            panic!("{acts:?}")
        };
        let change = change16(0, Some(vec![3]), vec![0.5]);
        let acts = c.handle(
            reply(
                token,
                0,
                Params {
                    update: change.clone(),
                    ..params(1, 1)
                },
            ),
            t0,
        );
        let [Action::Deliver(d)] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!(d.updates, vec![(0, params(0, 0).update), (0, change)]);
        assert_eq!(c.versions()[0], Some(1));
    }

    #[test]
    fn a_change_from_a_version_not_held_is_asked_for_as_values() {
        let t0 = Instant::now();
        let mut c = joined(vec![0], t0);
        let s = sends(&c.handle(Event::StepRequested, t0));
        let acts = c.handle(
            reply(
                s[0].0,
                0,
                Params {
                    update: change16(5, None, vec![0.5; 2]),
                    ..params(6, 1)
                },
            ),
            t0,
        );
        let [Action::Send {
            token,
            step: 0,
            have_version: None,
            ..
        }] = acts[..]
        else {
            panic!("{acts:?}")
        };
        let acts = c.handle(
            reply(
                token,
                0,
                Params {
                    update: ParamUpdate::Dense(vec![0.5; 2]),
                    ..params(1, 1)
                },
            ),
            t0,
        );
        let [Action::Deliver(d)] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!(d.updates, vec![(0, ParamUpdate::Dense(vec![0.5; 2]))]);
    }

    #[test]
    fn a_fenced_worker_takes_the_clusters_step_without_pushing_again() {
        let t0 = Instant::now();
        let mut c = joined(vec![0], t0);
        let s = sends(&c.handle(Event::StepRequested, t0));
        let acts = c.handle(
            Event::Refused {
                token: s[0].0,
                shard: 0,
                code: ErrorCode::Fenced,
                message: "dropped at step 0".into(),
            },
            t0,
        );
        let [Action::Offer {
            token,
            version: 0,
            next_step: 0,
            ..
        }] = acts[..]
        else {
            panic!("{acts:?}")
        };
        let acts = c.handle(reply(token, 0, params(40, 40)), t0);
        let [Action::Deliver(d)] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!((d.pushed_step, d.next_step, d.fenced), (0, 40, 1));
        assert_eq!(c.start_step(), 40);
    }

    #[test]
    fn a_worker_pushes_one_step_to_every_shard_after_rejoining_shards_at_different_steps() {
        // Rejoined while the shards stood at different steps: shard 1 had
        // already applied step 30 without this worker when it answered.
        let t0 = Instant::now();
        let mut c = joined_at(core(vec![0, 0]), &[30, 31], t0);
        assert_eq!((c.start_step(), c.next_steps()), (30, &[30, 31][..]));
        // Step 30 goes to shard 0 only; shard 1 is asked for its
        // parameters, never sent step 30's gradient as its step 31.
        let acts = c.handle(Event::StepRequested, t0);
        let (push, offer) = match &acts[..] {
            [Action::Send {
                token: p,
                shard: 0,
                step: 30,
                ..
            }, Action::Offer {
                token: o, shard: 1, ..
            }] => (*p, *o),
            other => panic!("{other:?}"),
        };
        assert!(c.handle(reply(offer, 1, params(31, 31)), t0,).is_empty());
        let acts = c.handle(reply(push, 0, params(31, 31)), t0);
        let [Action::Deliver(d)] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!((d.pushed_step, d.next_step, d.updates.len()), (30, 31, 2));
        c.handle(Event::Applied, t0);
        // From here on both shards get the same step.
        let acts = c.handle(Event::StepRequested, t0);
        assert_eq!(pushes(&acts), vec![(0, 31), (1, 31)], "{acts:?}");
    }

    #[test]
    fn with_backup_workers_a_shard_ahead_gets_the_push_as_a_late_one() {
        // Shard 1 applied step 30 without this worker (it was late there):
        // with backup workers it still gets step 30's push, to fold.
        let t0 = Instant::now();
        let backups = ClientCore::new(ClientSettings {
            late_pushes: true,
            ..ClientSettings::new(vec![0, 0], Duration::from_secs(10), Duration::from_secs(20))
        });
        let mut c = joined_at(backups, &[30, 31], t0);
        let acts = c.handle(Event::StepRequested, t0);
        assert_eq!(pushes(&acts), vec![(0, 30), (1, 30)], "{acts:?}");
        let tokens: Vec<Token> = acts
            .iter()
            .filter_map(|a| match a {
                Action::Send { token, .. } => Some(*token),
                _ => None,
            })
            .collect();
        assert!(c
            .handle(reply(tokens[1], 1, params(32, 32)), t0,)
            .is_empty());
        let acts = c.handle(reply(tokens[0], 0, params(31, 31)), t0);
        let [Action::Deliver(d)] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!((d.pushed_step, d.next_step, d.fenced), (30, 31, 0));
        c.handle(Event::Applied, t0);
        // Step 31 next, to both shards (shard 1 folds it in turn).
        let acts = c.handle(Event::StepRequested, t0);
        assert_eq!(pushes(&acts), vec![(0, 31), (1, 31)], "{acts:?}");
    }

    #[test]
    fn asp_pushes_each_shard_the_step_it_expects() {
        // In ASP a shard's step is its own clock of this worker's pushes:
        // shards one push apart each get the step they expect.
        let t0 = Instant::now();
        let asp = ClientCore::new(ClientSettings {
            one_step: false,
            ..ClientSettings::new(vec![0, 0], Duration::from_secs(1), Duration::from_secs(1))
        });
        let mut c = joined_at(asp, &[5, 6], t0);
        let acts = c.handle(Event::StepRequested, t0);
        assert_eq!(pushes(&acts), vec![(0, 5), (1, 6)], "{acts:?}");
    }

    #[test]
    fn refusals_that_say_later_are_bounded_in_attempts_and_time() {
        let t0 = Instant::now();
        let mut c = joined(vec![0], t0);
        let mut now = t0;
        let mut acts = c.handle(Event::StepRequested, now);
        let mut delays = Vec::new();
        let why = loop {
            match &acts[..] {
                [Action::Send { token, at, .. }] => {
                    delays.push(at.duration_since(now));
                    now = *at;
                    acts = c.handle(
                        Event::Refused {
                            token: *token,
                            shard: 0,
                            code: ErrorCode::Timeout,
                            message: "barrier".into(),
                        },
                        now,
                    );
                }
                [Action::GiveUp(why)] => break why.clone(),
                other => panic!("{other:?}"),
            }
        };
        assert!(
            matches!(why, GiveUp::Exhausted { attempts: 8, .. }),
            "{why}"
        );
        assert_eq!(delays[0], Duration::ZERO, "the first push goes at once");
        assert!(delays[1..].iter().all(|d| !d.is_zero()));
        assert!(delays.windows(2).all(|w| w[1] >= w[0]), "{delays:?}");
        assert!(!c.busy());
        // An unknown refusal ends the step at once, naming it.
        let s = sends(&c.handle(Event::StepRequested, now));
        let acts = c.handle(
            Event::Refused {
                token: s[0].0,
                shard: 0,
                code: ErrorCode::WrongLength,
                message: "3 values".into(),
            },
            now,
        );
        assert!(matches!(
            &acts[..],
            [Action::GiveUp(GiveUp::Refused {
                code: ErrorCode::WrongLength,
                ..
            })]
        ));
    }

    #[test]
    fn an_exchange_past_its_budget_gives_up_and_forgets_its_replies() {
        let t0 = Instant::now();
        let mut c = joined(vec![0, 1], t0);
        let budget = c.settings().budget;
        assert_eq!(budget, Duration::from_secs(50), "10 s + 2 x 20 s");
        let s = sends(&c.handle(Event::StepRequested, t0));
        c.handle(reply(s[0].0, 0, params(1, 1)), t0);
        assert!(c.handle(Event::Tick, t0 + budget).is_empty());
        let acts = c.handle(Event::Tick, t0 + budget + Duration::from_millis(1));
        assert!(
            matches!(&acts[..], [Action::GiveUp(GiveUp::OutOfTime { .. })]),
            "{acts:?}"
        );
        assert!(!c.busy());
        assert_eq!(
            c.versions(),
            &[Some(0), Some(0)],
            "back to what the trainer holds"
        );
        assert_eq!(c.start_step(), 0);
        // A late reply of the exchange given up changes nothing.
        let late = reply(s[1].0, 1, params(1, 1));
        assert!(c.handle(late, t0 + budget * 2).is_empty());
    }

    #[test]
    fn a_link_that_stays_down_gives_up_naming_it() {
        let t0 = Instant::now();
        let mut c = joined(vec![0, 1], t0);
        let s = sends(&c.handle(Event::StepRequested, t0));
        let mut acts = c.handle(lost(s[1].0, 1, "timed out"), t0);
        let mut dials = 0;
        let why = loop {
            match &acts[..] {
                [Action::Reconnect { link: 1, at, .. }] => {
                    dials += 1;
                    acts = c.handle(
                        Event::DialFailed {
                            link: 1,
                            error: "refused".into(),
                        },
                        *at,
                    );
                }
                [Action::GiveUp(why)] => break why.clone(),
                other => panic!("{other:?}"),
            }
        };
        assert!(matches!(why, GiveUp::Unreachable { link: 1, .. }), "{why}");
        assert!((5..=12).contains(&dials), "{dials} dials in 10 s");
    }

    /// A simulated cluster behind the core: each shard's version (the
    /// cluster's step), the last step of this worker it counted, and the
    /// requests and redials the core asked for, resolved in an order and
    /// with outcomes the property test picks.
    /// The (token, shard, step, total) of each norm total among `acts`.
    fn totals(acts: &[Action]) -> Vec<(Token, ShardId, u64, Option<f64>)> {
        acts.iter()
            .filter_map(|a| match a {
                Action::Total {
                    token,
                    shard,
                    step,
                    total,
                    ..
                } => Some((*token, *shard, *step, *total)),
                _ => None,
            })
            .collect()
    }

    fn share(token: Token, shard: ShardId, sum_sq: f64, total: Option<f64>) -> Event {
        Event::Share {
            token,
            shard,
            step: 0,
            sum_sq,
            total,
        }
    }

    #[test]
    fn the_total_of_every_shards_share_goes_to_each_shard_once_all_answered() {
        let t0 = Instant::now();
        // Three shards on two links.
        let mut c = joined(vec![0, 0, 1], t0);
        let s = sends(&c.handle(Event::StepRequested, t0));
        assert_eq!(s.len(), 3);
        assert!(c.handle(share(s[2].0, 2, 4.0, None), t0).is_empty());
        assert!(c.handle(share(s[0].0, 0, 0.5, None), t0).is_empty());
        // A late duplicate of a share changes nothing.
        assert!(c.handle(share(s[0].0, 0, 9.0, None), t0).is_empty());
        let acts = c.handle(share(s[1].0, 1, 0.25, None), t0);
        let t = totals(&acts);
        assert_eq!(t.len(), 3, "{acts:?}");
        // Summed in shard order: 0.5 + 0.25 + 4.0.
        assert!(t
            .iter()
            .all(|&(_, _, step, total)| step == 0 && total == Some(4.75)));
        let mut acts = Vec::new();
        for (token, shard, _, _) in t {
            acts = c.handle(reply(token, shard, params(1, 1)), t0);
        }
        let [Action::Deliver(d)] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert_eq!((d.pushed_step, d.next_step), (0, 1));
        assert_eq!(d.updates.len(), 3);
        // Three pushes and three totals.
        assert_eq!(d.round_trips, 6);
    }

    #[test]
    fn a_total_a_shard_applied_is_sent_instead_of_the_sum() {
        let t0 = Instant::now();
        let mut c = joined(vec![0, 1], t0);
        let s = sends(&c.handle(Event::StepRequested, t0));
        c.handle(share(s[0].0, 0, 1.0, Some(7.0)), t0);
        let t = totals(&c.handle(share(s[1].0, 1, 2.0, None), t0));
        assert_eq!(t.len(), 2);
        assert!(t.iter().all(|&(_, _, _, total)| total == Some(7.0)));
    }

    #[test]
    fn without_every_share_the_total_is_left_to_another_worker() {
        let t0 = Instant::now();
        let mut c = joined(vec![0, 1], t0);
        let s = sends(&c.handle(Event::StepRequested, t0));
        // Shard 0 applied the step without this worker: parameters, no share.
        c.handle(reply(s[0].0, 0, params(1, 1)), t0);
        let t = totals(&c.handle(share(s[1].0, 1, 2.0, None), t0));
        assert_eq!(t.len(), 1);
        assert_eq!((t[0].1, t[0].3), (1, None));
        let acts = c.handle(reply(t[0].0, 1, params(1, 1)), t0);
        assert!(matches!(acts[..], [Action::Deliver(_)]));
    }

    #[test]
    fn a_total_refused_for_later_is_sent_again_after_a_delay() {
        let t0 = Instant::now();
        let mut c = joined(vec![0, 1], t0);
        let s = sends(&c.handle(Event::StepRequested, t0));
        c.handle(share(s[0].0, 0, 1.0, None), t0);
        let t = totals(&c.handle(share(s[1].0, 1, 2.0, None), t0));
        let acts = c.handle(
            Event::Refused {
                token: t[1].0,
                shard: 1,
                code: ErrorCode::Timeout,
                message: "waiting".into(),
            },
            t0,
        );
        let [Action::Total {
            shard: 1,
            step: 0,
            total: Some(3.0),
            at,
            ..
        }] = acts[..]
        else {
            panic!("{acts:?}")
        };
        assert!(at > t0);
        // Any other refusal of a total ends the exchange, naming it.
        let t = totals(&acts);
        let acts = c.handle(
            Event::Refused {
                token: t[0].0,
                shard: 1,
                code: ErrorCode::WrongStep,
                message: "no share".into(),
            },
            t0,
        );
        let [Action::GiveUp(why)] = &acts[..] else {
            panic!("{acts:?}")
        };
        assert!(why.to_string().contains("norm total"), "{why}");
    }

    #[test]
    fn a_server_lost_during_the_totals_is_offered_pushed_and_shared_again() {
        let t0 = Instant::now();
        let mut c = joined(vec![0, 1], t0);
        let s = sends(&c.handle(Event::StepRequested, t0));
        c.handle(share(s[0].0, 0, 1.0, None), t0);
        let t = totals(&c.handle(share(s[1].0, 1, 2.0, None), t0));
        // Shard 0 applies; shard 1's server restarts under its total.
        c.handle(reply(t[0].0, 0, params(1, 1)), t0);
        let acts = c.handle(lost(t[1].0, 1, "reset"), t0);
        let [Action::Reconnect { link: 1, at, .. }] = acts[..] else {
            panic!("{acts:?}")
        };
        let acts = c.handle(
            Event::Reconnected {
                link: 1,
                redialed: true,
            },
            at,
        );
        let [Action::Offer {
            token, shard: 1, ..
        }] = acts[..]
        else {
            panic!("{acts:?}")
        };
        // The restarted shard has not applied the step: push it again.
        let acts = c.handle(reply(token, 1, params(0, 0)), at);
        let p = pushes(&acts);
        assert_eq!(p, vec![(1, 0)]);
        let token = sends(&acts)[0].0;
        // Its new share (summed the other way, say) makes a new total with
        // shard 0's.
        let t = totals(&c.handle(share(token, 1, 2.5, None), at));
        assert_eq!(t.len(), 1);
        assert_eq!((t[0].1, t[0].3), (1, Some(3.5)));
        let acts = c.handle(reply(t[0].0, 1, params(1, 1)), at);
        assert!(matches!(acts[..], [Action::Deliver(_)]));
    }

    mod sim {
        use super::*;

        #[derive(Debug, Clone)]
        pub enum Pending {
            Push {
                token: Token,
                shard: ShardId,
                step: u64,
                at: Instant,
            },
            Offer {
                token: Token,
                shard: ShardId,
                at: Instant,
            },
            Dial {
                link: LinkId,
                at: Instant,
            },
        }

        pub struct Sim {
            pub core: ClientCore,
            pub now: Instant,
            /// The cluster's version of each shard.
            pub version: Vec<u64>,
            /// The last step of this worker each shard counted.
            pub counted: Vec<Option<u64>>,
            pub pending: Vec<Pending>,
            /// Events already fed once (replayed as duplicates).
            pub fed: Vec<Event>,
            /// Per exchange: its step, its start, how it ended.
            pub started: Instant,
            pub pushed_step: Vec<u64>,
            /// Shards that said they applied the step being pushed.
            pub applied: Vec<bool>,
            pub requests: Vec<u32>,
            pub ended: Option<Result<Delivery, GiveUp>>,
            pub delivered_versions: Vec<u64>,
        }

        impl Sim {
            pub fn new(route: Vec<LinkId>) -> Self {
                let t0 = Instant::now();
                let n = route.len();
                let core = ClientCore::new(ClientSettings::new(
                    route,
                    Duration::from_secs(10),
                    Duration::from_secs(20),
                ));
                Self {
                    core,
                    now: t0,
                    version: vec![0; n],
                    counted: vec![None; n],
                    pending: Vec::new(),
                    fed: Vec::new(),
                    started: t0,
                    pushed_step: vec![0; n],
                    applied: vec![false; n],
                    requests: vec![0; n],
                    ended: None,
                    delivered_versions: vec![0; n],
                }
            }

            /// Feed `event` and check what comes out against the rules.
            pub fn feed(&mut self, event: Event) -> Result<(), String> {
                let later = matches!(
                    event,
                    Event::Refused {
                        code: ErrorCode::RateLimited | ErrorCode::Timeout,
                        ..
                    }
                );
                let acts = self.core.handle(event.clone(), self.now);
                if matches!(
                    event,
                    Event::Reply { .. } | Event::Refused { .. } | Event::ConnLost { .. }
                ) {
                    self.fed.push(event);
                }
                let budget = self.core.settings().budget;
                let max = self.core.settings().max_attempts;
                for a in acts {
                    match a {
                        Action::Send {
                            token,
                            shard,
                            step,
                            at,
                            ..
                        } => {
                            if self.applied[shard] && step <= self.pushed_step[shard] {
                                return Err(format!(
                                    "push of step {step} to shard {shard} after it applied step {}",
                                    self.pushed_step[shard]
                                ));
                            }
                            if step > self.version[shard] {
                                return Err(format!("push of step {step} from the future"));
                            }
                            self.request(shard, at, later, budget, max)?;
                            self.pending.push(Pending::Push {
                                token,
                                shard,
                                step,
                                at,
                            });
                        }
                        Action::Offer {
                            token, shard, at, ..
                        } => {
                            self.request(shard, at, later, budget, max)?;
                            self.pending.push(Pending::Offer { token, shard, at });
                        }
                        Action::Total { .. } => {
                            return Err("a norm total though no shard sent a share".into());
                        }
                        Action::Reconnect { link, at, .. } => {
                            if at < self.now {
                                return Err("a redial in the past".into());
                            }
                            self.pending.push(Pending::Dial { link, at });
                        }
                        Action::Deliver(d) => {
                            if self.ended.is_some() {
                                return Err("an exchange ended twice".into());
                            }
                            for (shard, v) in self.core.versions().iter().enumerate() {
                                let v = v.unwrap_or(0);
                                if v < self.delivered_versions[shard] {
                                    return Err(format!(
                                        "shard {shard} went back from version {} to {v}",
                                        self.delivered_versions[shard]
                                    ));
                                }
                                self.delivered_versions[shard] = v;
                            }
                            if d.updates.len() != self.version.len() {
                                return Err(format!(
                                    "{} updates for {} shards",
                                    d.updates.len(),
                                    self.version.len()
                                ));
                            }
                            self.ended = Some(Ok(d));
                        }
                        Action::GiveUp(why) => {
                            if self.ended.is_some() {
                                return Err("an exchange ended twice".into());
                            }
                            if why.to_string().is_empty() {
                                return Err("a give-up without a reason".into());
                            }
                            self.ended = Some(Err(why));
                        }
                    }
                }
                Ok(())
            }

            fn request(
                &mut self,
                shard: ShardId,
                at: Instant,
                later: bool,
                budget: Duration,
                max: u32,
            ) -> Result<(), String> {
                if later && at <= self.now {
                    return Err("a retry after a refusal that said later went at once".into());
                }
                if at > self.started + budget {
                    return Err("a request scheduled past the budget".into());
                }
                self.requests[shard] += 1;
                if self.requests[shard] > max {
                    return Err(format!(
                        "shard {shard} got {} requests",
                        self.requests[shard]
                    ));
                }
                Ok(())
            }

            pub fn begin(&mut self, event: Event) -> Result<(), String> {
                self.started = self.now;
                self.pushed_step = self.core.next_steps().to_vec();
                self.applied = vec![false; self.version.len()];
                self.requests = vec![0; self.version.len()];
                self.ended = None;
                self.feed(event)
            }

            /// Resolve pending item `i` with outcome `how` (0: the good
            /// answer).
            pub fn resolve(&mut self, i: usize, how: u8) -> Result<(), String> {
                let p = self.pending.remove(i);
                match p {
                    Pending::Push {
                        token,
                        shard,
                        step,
                        at,
                    } => {
                        self.now = self.now.max(at);
                        match how {
                            1 => self.refuse(token, shard, ErrorCode::RateLimited),
                            2 => self.refuse(token, shard, ErrorCode::Timeout),
                            3 => self.feed(lost(token, shard, "lost")),
                            4 => self.refuse(token, shard, ErrorCode::NotInitialized),
                            _ => {
                                let v = self.version[shard];
                                if step == v {
                                    self.counted[shard] = Some(step);
                                    self.version[shard] += 1;
                                } else if step < v && self.counted[shard] != Some(step) {
                                    return self.refuse(token, shard, ErrorCode::Fenced);
                                }
                                self.answer(token, shard)
                            }
                        }
                    }
                    Pending::Offer { token, shard, at } => {
                        self.now = self.now.max(at);
                        match how {
                            1 => self.refuse(token, shard, ErrorCode::RateLimited),
                            3 => self.feed(lost(token, shard, "lost")),
                            _ => self.answer(token, shard),
                        }
                    }
                    Pending::Dial { link, at } => {
                        self.now = self.now.max(at);
                        if how == 1 || how == 3 {
                            self.feed(Event::DialFailed {
                                link,
                                error: "refused".into(),
                            })
                        } else {
                            self.feed(Event::Reconnected {
                                link,
                                redialed: true,
                            })
                        }
                    }
                }
            }

            fn refuse(
                &mut self,
                token: Token,
                shard: ShardId,
                code: ErrorCode,
            ) -> Result<(), String> {
                self.feed(Event::Refused {
                    token,
                    shard,
                    code,
                    message: format!("{code:?}"),
                })
            }

            fn answer(&mut self, token: Token, shard: ShardId) -> Result<(), String> {
                let v = self.version[shard];
                // The shard tells the worker it applied the step pushed
                // (a reply to a request no longer awaited tells it nothing:
                // a retry then is a duplicate the shard answers).
                if v > self.pushed_step[shard] && self.core.awaited(shard, token) {
                    self.applied[shard] = true;
                }
                self.feed(Event::Reply {
                    token,
                    shard,
                    params: Params {
                        version: v,
                        next_step: v,
                        live_workers: 1,
                        update: ParamUpdate::Dense(vec![v as f32]),
                        sent: 4,
                        received: 4,
                    },
                })
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(400))]

        /// Random interleavings of replies, refusals, losses, redials,
        /// duplicates, a cluster that goes on without the worker (fencing)
        /// and server restarts: every exchange ends exactly once, within
        /// its attempts and budget, with versions that never go back and
        /// no push of a step a shard said it applied.
        #[test]
        fn every_exchange_ends_once_within_its_bounds(
            route in proptest::collection::vec(0usize..3, 1..5),
            exchanges in proptest::collection::vec(
                proptest::collection::vec((proptest::prelude::any::<u16>(), 0u8..12), 0..40),
                1..5,
            ),
        ) {
            let mut sim = sim::Sim::new(route);
            for (i, ops) in exchanges.into_iter().enumerate() {
                let start = if i == 0 { Event::JoinRequested } else { Event::StepRequested };
                sim.begin(start).map_err(proptest::test_runner::TestCaseError::fail)?;
                for (pick, how) in ops {
                    if sim.ended.is_some() {
                        break;
                    }
                    let r = match how {
                        // The cluster goes on without this worker.
                        9 => {
                            let s = pick as usize % sim.version.len();
                            sim.version[s] += 1 + u64::from(pick % 4);
                            Ok(())
                        }
                        // A duplicate or late reply.
                        10 if !sim.fed.is_empty() => {
                            let e = sim.fed[pick as usize % sim.fed.len()].clone();
                            let acts = sim.core.handle(e, sim.now);
                            if acts.is_empty() { Ok(()) } else { Err(format!("a stale event did {acts:?}")) }
                        }
                        _ if sim.pending.is_empty() => Ok(()),
                        _ => {
                            let i = pick as usize % sim.pending.len();
                            sim.resolve(i, how)
                        }
                    };
                    r.map_err(proptest::test_runner::TestCaseError::fail)?;
                }
                // Then everything answers well: the exchange must end.
                let mut rounds = 0;
                while sim.ended.is_none() {
                    rounds += 1;
                    proptest::prop_assert!(rounds < 1000, "no end after 1000 answers");
                    proptest::prop_assert!(!sim.pending.is_empty(), "the exchange waits for nothing");
                    sim.resolve(0, 0).map_err(proptest::test_runner::TestCaseError::fail)?;
                }
                if let Some(Ok(d)) = &sim.ended {
                    // The worker holds the cluster's step afterwards.
                    let cluster = sim.version.iter().copied().min().unwrap_or(0);
                    proptest::prop_assert!(d.next_step <= cluster);
                    sim.core.handle(Event::Applied, sim.now);
                }
                proptest::prop_assert!(!sim.core.busy());
            }
        }
    }
}
