//! Pieces shared by the Stratus parameter server and its workers.
//!
//! Everything here is plain data and plain functions: configuration, the wire
//! protocol, sparse-gradient kernels, the shard map, bucket URLs, the
//! cluster's certificates and the QUIC transport helpers. Actors and sockets
//! live in `ps-server` and `ps-worker` and only move data between these pieces.

pub mod bucket;
pub mod cli;
pub mod config;
pub mod countstore;
pub mod dataplane;
pub mod hash;
pub mod layers;
pub mod link;
pub mod pki;
pub mod protocol;
pub mod rng;
pub mod sampler;
pub mod shard;
pub mod simstore;
pub mod simulate;
pub mod sparse;
pub mod telemetry;
pub mod transport;
mod wrapstore;
