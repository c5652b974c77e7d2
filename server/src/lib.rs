//! The Stratus parameter server.
//!
//! * [`shard`]: one shard's parameters, optimizer state and BSP barrier (plain struct).
//! * [`optimizer`]: the fused, parallel update kernels.
//! * [`actor`]: `ShardActor`, the actix actor around a shard.
//! * [`net`]: the QUIC endpoint of a server process.

pub mod actor;
pub mod checkpoint;
pub mod net;
pub mod optimizer;
pub mod shard;
