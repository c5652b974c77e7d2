//! What the parameter servers and the workers say to each other and how:
//! the wire [`protocol`], the QUIC [`transport`] and the same-host
//! path beside it ([`local`]), the cluster's certificates
//! ([`pki`]), and the binaries' edge ([`cli`]: logging, exit codes, stop
//! signals), which maps the transport's and the certificates' errors to exit
//! codes.
//!
//! `ps-dataset` does not depend on this crate: reading and writing datasets
//! needs neither QUIC nor certificates.

pub mod cli;
pub mod local;
pub mod peer;
pub mod pki;
pub mod protocol;
pub mod transport;
