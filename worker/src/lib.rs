//! The Stratus worker.
//!
//! * [`api`]: train your own candle model (its `Var`s and a closure).
//! * [`balance`]: throughput balancing: the rate a worker reports and the splits it learns.
//! * [`launch`]: a worker process: `ps-worker train`'s flags, signals, exit codes.
//! * [`model`]: the candle model seen through the flat parameter space.
//! * [`kernels`]: hand-written CPU kernels and the layered models' executor.
//! * [`gpt`]: the GPT preset (a decoder-only transformer on token windows).
//! * [`layers`]: forward passes of the layered models (ResNets, batch norm).
//! * [`devcheck`]: the same models on two devices, compared (`gpu-check`).
//! * [`loader`]: the `Loader`, batches prefetched from the bucket in sample order.
//! * [`cache`]: the loader's memory and disk tiers and their placement policy.
//! * [`peers`]: the peer cache tier, the cluster's caches serving each other.
//! * [`trainer`]: `TrainerActor`, forward/backward and gradient compression.
//! * [`moments`]: Adam's moments kept on the worker (`optimizer.moments = "worker"`).
//! * [`client`]: `ClientCore`, the sans-IO client: retries, redials, recovery, fencing.
//! * [`comm`]: `CommActor`, pushes and pulls over QUIC (drives the `ClientCore`).
//! * [`node`]: node-local aggregation, several ranks sharing one push.
//! * [`run`]: one worker's whole training run, or a node's ranks.
//! * [`simulate`]: `train --simulate`: a slow bucket ([`simstore`]) and slow links.
//! * [`countstore`]: a bucket wrapper that counts GETs and bytes.

pub mod api;
pub mod balance;
pub mod cache;
pub mod client;
pub mod comm;
pub mod countstore;
pub mod devcheck;
pub mod gpt;
pub mod kernels;
pub mod launch;
pub mod layers;
pub mod loader;
pub mod makeup;
pub mod model;
pub mod moments;
pub mod node;
pub mod observe;
pub mod peers;
pub mod run;
pub mod simstore;
pub mod simulate;
pub mod trainer;
mod wrapstore;
