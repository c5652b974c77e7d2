//! The Stratus parameter server.
//!
//! * [`core`]: `ShardCore`, every policy of one shard as a sans-IO state
//!   machine (barrier, parked replies, staleness, recovery, checkpoints).
//! * [`membership`]: who is in the cluster, as a sans-IO state machine.
//! * [`optimizer`]: the fused, parallel update kernels.
//! * [`actor`]: `ShardActor`, the actix actor that drives a shard core.
//! * [`checkpoint`]: shard checkpoints in an object store.
//! * [`net`]: the QUIC endpoint of a server process; it only moves bytes.

pub mod actor;
pub mod checkpoint;
pub mod core;
pub mod membership;
pub mod net;
pub mod observe;
pub mod optimizer;
