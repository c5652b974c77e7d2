//! The Stratus data tools behind the `ps-data` binary.
//!
//! * `ps-data synthetic|mnist|import|text|images|index`: datasets written
//!   into a bucket (the writers and importers of `ps-dataset`'s `tools`
//!   feature).
//! * [`plot`]: PNG charts of a run's per-epoch metrics (`ps-data plot`).
//!
//! The training binaries (`ps-server`, `ps-worker`) do not depend on this
//! crate, so none of the importers' parsers or the chart fonts are built
//! into them.

pub mod plot;
