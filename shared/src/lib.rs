//! Pieces shared by the Stratus parameter server and its workers.
//!
//! Everything here is plain data and plain functions: configuration (with
//! the layer lists of layered models and the data plane's settings),
//! sparse-gradient kernels, the shard map, the sampler, bucket URLs and the
//! link model. The wire protocol, the QUIC transport and the cluster's
//! certificates are in `ps-net`; actors and sockets live in `ps-server` and
//! `ps-worker` and only move data between these pieces.

pub mod adam;
pub mod bucket;
pub mod config;
pub mod hash;
pub mod link;
pub mod overrides;
pub mod rng;
pub mod sampler;
pub mod shard;
pub mod sparse;
pub mod sync;
pub mod telemetry;
