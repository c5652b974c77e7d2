//! The cluster's certificates: one private CA, a server certificate, and one
//! client certificate per worker rank.
//!
//! Every process of a Stratus cluster trusts exactly one certificate
//! authority, the cluster CA ([`ClusterCa`]). Parameter servers present a
//! certificate the CA issued for their DNS names / IP addresses
//! ([`ClusterCa::issue_server`], serverAuth); each worker presents a client
//! certificate the CA issued for its rank ([`ClusterCa::issue_worker`],
//! clientAuth). Servers require that client certificate (mutual TLS, see
//! [`crate::transport`]), so the rank a server attributes to a connection is
//! the rank the CA vouched for, not whatever the peer claims in a message.
//!
//! # Where the rank lives
//!
//! The one canonical carrier of a worker's rank is a DNS subject alternative
//! name `rank-<rank>.workers.stratus` (decimal, no leading zeros; see
//! [`worker_dns_name`]). [`rank_from_cert_der`] reads the rank from there and
//! nowhere else. The subject common name `stratus-worker-<rank>` is only for
//! people reading logs and `openssl x509` output; a certificate whose common
//! name names a different rank than its SAN is refused as ambiguous, and so is
//! one with several rank names, or with any other name under
//! `.workers.stratus`.
//!
//! # Files
//!
//! [`ensure_cluster_pki`] creates whatever is missing under a [`PkiPaths`]
//! layout and keeps what is already there and still valid
//! ([`Existing::Check`]), or keeps every file that is there as it is
//! ([`Existing::Keep`], what a server's start does), so it can run on every
//! start. Private keys are written owner-readable only (mode 0600).
//!
//! ```
//! use ps_net::pki::{rank_from_cert_der, ClusterCa};
//! let ca = ClusterCa::generate("stratus test CA").unwrap();
//! let server = ca.issue_server(&["localhost".into(), "127.0.0.1".into()]).unwrap();
//! let worker = ca.issue_worker(7).unwrap();
//! assert_eq!(rank_from_cert_der(&worker.cert_der().unwrap()).unwrap(), 7);
//! assert!(rank_from_cert_der(&server.cert_der().unwrap()).is_err());
//! ```
//!
//! ```no_run
//! use ps_net::pki::{ensure_cluster_pki, Existing, PkiPaths};
//! let paths = PkiPaths::under("certs".as_ref());
//! let report = ensure_cluster_pki(&paths, &["ps-0.internal".into()], 8, Existing::Check).unwrap();
//! println!("wrote {} files, kept {}", report.written.len(), report.kept.len());
//! ```

use std::collections::BTreeSet;
use std::fmt;
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use time::{Duration, OffsetDateTime};
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;

/// DNS domain under which worker rank names live.
pub const WORKER_DOMAIN: &str = "workers.stratus";

/// Prefix of a worker certificate's subject common name (informational).
pub const WORKER_CN_PREFIX: &str = "stratus-worker-";

/// Placeholder in [`PkiPaths::worker_cert`] / [`PkiPaths::worker_key`].
pub const RANK_PLACEHOLDER: &str = "{rank}";

/// How long a new CA is valid.
const CA_VALIDITY: Duration = Duration::days(3650);
/// How long a new server or worker certificate is valid (never past the CA).
const LEAF_VALIDITY: Duration = Duration::days(3650);
/// Backdating of `not_before`, so peers with slightly slow clocks accept new
/// certificates.
const CLOCK_SKEW: Duration = Duration::days(1);

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    BadFile { path: PathBuf, message: String },
    #[error("invalid certificate authority: {0}")]
    BadCa(String),
    #[error("invalid certificate name {name:?}: {message}")]
    BadName { name: String, message: String },
    #[error("certificate generation failed: {0}")]
    Generate(String),
    #[error("cannot parse certificate: {0}")]
    Parse(String),
    #[error("certificate carries no worker rank (expected one DNS name rank-<n>.{WORKER_DOMAIN})")]
    NoRank,
    #[error("certificate carries an ambiguous worker rank: {0}")]
    AmbiguousRank(String),
    #[error("certificate is not issued for client authentication (no clientAuth usage)")]
    NotClientCert,
    #[error("worker certificate path template {template:?} lacks the {{rank}} placeholder")]
    Template { template: String },
}

/// The DNS name that carries `rank` in a worker certificate.
pub fn worker_dns_name(rank: u32) -> String {
    format!("rank-{rank}.{WORKER_DOMAIN}")
}

/// The (informational) subject common name of a worker certificate.
pub fn worker_common_name(rank: u32) -> String {
    format!("{WORKER_CN_PREFIX}{rank}")
}

/// A certificate and its private key, PEM encoded.
#[derive(Clone, PartialEq, Eq)]
pub struct CertPair {
    pub cert_pem: String,
    pub key_pem: String,
}

impl fmt::Debug for CertPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertPair")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

impl CertPair {
    /// Write the pair, creating parent directories. The key file is created
    /// owner-readable only (0600) and made so if it already existed.
    pub fn write(&self, cert: &Path, key: &Path) -> Result<(), PkiError> {
        write_file(cert, &self.cert_pem, false)?;
        write_file(key, &self.key_pem, true)
    }

    /// Read a pair written by [`CertPair::write`] (or any PEM files).
    pub fn read(cert: &Path, key: &Path) -> Result<Self, PkiError> {
        Ok(Self {
            cert_pem: read_file(cert)?,
            key_pem: read_file(key)?,
        })
    }

    /// The first certificate of `cert_pem`, DER encoded.
    pub fn cert_der(&self) -> Result<CertificateDer<'static>, PkiError> {
        first_cert_der(&self.cert_pem)
    }
}

/// The cluster's certificate authority: its certificate and signing key.
pub struct ClusterCa {
    cert_pem: String,
    key_pem: String,
    cert_der: CertificateDer<'static>,
    not_after: OffsetDateTime,
    issuer: Issuer<'static, KeyPair>,
}

impl fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCa")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .field("not_after", &self.not_after)
            .finish()
    }
}

impl ClusterCa {
    /// A new self-signed CA (ECDSA P-256, valid ten years) that may sign
    /// end-entity certificates only (path length 0).
    pub fn generate(common_name: &str) -> Result<Self, PkiError> {
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = now - CLOCK_SKEW;
        params.not_after = now + CA_VALIDITY;
        let key = KeyPair::generate().map_err(gen_err)?;
        let cert = params.self_signed(&key).map_err(gen_err)?;
        Ok(Self {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_der: cert.der().clone(),
            not_after: params.not_after,
            issuer: Issuer::new(params, key),
        })
    }

    /// Load a CA from its PEM certificate and key. Refuses a certificate that
    /// is not a CA or a key that does not belong to it.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, PkiError> {
        let cert_der = first_cert_der(cert_pem)?;
        let key = KeyPair::from_pem(key_pem)
            .map_err(|e| PkiError::BadCa(format!("unusable private key: {e}")))?;
        let not_after = {
            let cert = parse_cert(&cert_der)?;
            if !cert.is_ca() {
                return Err(PkiError::BadCa(
                    "certificate is not a CA (basicConstraints CA:TRUE missing)".into(),
                ));
            }
            if cert.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
                return Err(PkiError::BadCa(
                    "private key does not match the CA certificate".into(),
                ));
            }
            cert.validity().not_after.to_datetime()
        };
        let issuer =
            Issuer::from_ca_cert_der(&cert_der, key).map_err(|e| PkiError::BadCa(e.to_string()))?;
        Ok(Self {
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
            cert_der,
            not_after,
            issuer,
        })
    }

    /// The CA certificate, PEM encoded (what every process trusts).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA private key, PEM encoded (keep it off worker machines).
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// When the CA certificate expires.
    pub fn not_after(&self) -> OffsetDateTime {
        self.not_after
    }

    /// A server certificate (serverAuth) for the given DNS names and IP
    /// addresses; the first name is also its common name.
    pub fn issue_server(&self, names: &[String]) -> Result<CertPair, PkiError> {
        if names.is_empty() {
            return Err(PkiError::BadName {
                name: String::new(),
                message: "a server certificate needs at least one DNS name or IP address".into(),
            });
        }
        let sans = names
            .iter()
            .map(|name| san_for(name))
            .collect::<Result<Vec<_>, _>>()?;
        self.issue(&names[0], sans, vec![ExtendedKeyUsagePurpose::ServerAuth])
    }

    /// A worker certificate carrying `rank` as the DNS name
    /// `rank-<rank>.workers.stratus`, with common name
    /// `stratus-worker-<rank>`. It is a client certificate (clientAuth)
    /// towards the servers, and the server certificate (serverAuth) of the
    /// worker's peer cache endpoint, where other ranks reach it by that name.
    pub fn issue_worker(&self, rank: u32) -> Result<CertPair, PkiError> {
        let san = san_for(&worker_dns_name(rank))?;
        self.issue(
            &worker_common_name(rank),
            vec![san],
            vec![
                ExtendedKeyUsagePurpose::ClientAuth,
                ExtendedKeyUsagePurpose::ServerAuth,
            ],
        )
    }

    fn issue(
        &self,
        common_name: &str,
        sans: Vec<SanType>,
        usages: Vec<ExtendedKeyUsagePurpose>,
    ) -> Result<CertPair, PkiError> {
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.subject_alt_names = sans;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = usages;
        params.use_authority_key_identifier_extension = true;
        params.not_before = now - CLOCK_SKEW;
        params.not_after = (now + LEAF_VALIDITY).min(self.not_after);
        let key = KeyPair::generate().map_err(gen_err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(gen_err)?;
        Ok(CertPair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Why `pair` is not a usable certificate from this CA for `role`, if it
    /// is not: wrong signer, expired, key mismatch, wrong rank or names.
    fn check_leaf(&self, pair: &CertPair, role: &Role<'_>) -> Result<(), String> {
        let der = pair.cert_der().map_err(|e| e.to_string())?;
        let cert = parse_cert(&der).map_err(|e| e.to_string())?;
        let ca = parse_cert(&self.cert_der).map_err(|e| e.to_string())?;
        cert.verify_signature(Some(ca.public_key()))
            .map_err(|_| "not signed by the cluster CA".to_string())?;
        if !cert.validity().is_valid() {
            return Err(format!(
                "not valid now (valid {} to {})",
                cert.validity().not_before,
                cert.validity().not_after
            ));
        }
        let key = KeyPair::from_pem(&pair.key_pem).map_err(|e| format!("unusable key: {e}"))?;
        if cert.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err("key does not match the certificate".into());
        }
        match role {
            Role::Worker(rank) => match rank_from_cert_der(&der) {
                Ok(_) if !has_server_auth(&cert)? => {
                    Err("issued without the serverAuth usage the peer cache endpoint needs".into())
                }
                Ok(r) if r == *rank => Ok(()),
                Ok(r) => Err(format!("carries rank {r}, expected {rank}")),
                Err(e) => Err(e.to_string()),
            },
            Role::Server(names) => {
                let want = names.iter().map(|n| name_key(n)).collect::<BTreeSet<_>>();
                let have = cert_names(&cert).map_err(|e| e.to_string())?;
                let lacking: Vec<&NameKey> = want.difference(&have).collect();
                if lacking.is_empty() {
                    Ok(())
                } else {
                    Err(format!("lacks the server names {lacking:?}"))
                }
            }
        }
    }
}

enum Role<'a> {
    Server(&'a [String]),
    Worker(u32),
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum NameKey {
    Dns(String),
    Ip(IpAddr),
}

/// DNS and IP subject alternative names of `cert`.
fn cert_names(cert: &X509Certificate<'_>) -> Result<BTreeSet<NameKey>, PkiError> {
    let mut names = BTreeSet::new();
    let san = cert
        .subject_alternative_name()
        .map_err(|e| PkiError::Parse(e.to_string()))?;
    for name in san.iter().flat_map(|s| s.value.general_names.iter()) {
        match name {
            GeneralName::DNSName(n) => {
                names.insert(NameKey::Dns(n.to_ascii_lowercase()));
            }
            GeneralName::IPAddress(b) => {
                let ip = match b.len() {
                    4 => IpAddr::from(<[u8; 4]>::try_from(*b).expect("length checked")),
                    16 => IpAddr::from(<[u8; 16]>::try_from(*b).expect("length checked")),
                    _ => continue,
                };
                names.insert(NameKey::Ip(ip));
            }
            _ => {}
        }
    }
    Ok(names)
}

/// The worker rank a certificate was issued for.
///
/// Reads only the canonical carrier, the DNS subject alternative name
/// `rank-<rank>.workers.stratus`. Refuses a certificate with no such name,
/// with more than one, with a malformed name under `.workers.stratus`, with a
/// `stratus-worker-<n>` common name that disagrees, or without the clientAuth
/// extended key usage. This does not check the signature: call it on
/// certificates a TLS verifier already accepted.
pub fn rank_from_cert_der(der: &[u8]) -> Result<u32, PkiError> {
    let cert = parse_cert(der)?;
    let suffix = format!(".{WORKER_DOMAIN}");
    let mut ranks = Vec::new();
    let san = cert
        .subject_alternative_name()
        .map_err(|e| PkiError::Parse(e.to_string()))?;
    for name in san.iter().flat_map(|s| s.value.general_names.iter()) {
        let GeneralName::DNSName(name) = name else {
            continue;
        };
        let lower = name.to_ascii_lowercase();
        let Some(label) = lower.strip_suffix(&suffix) else {
            continue;
        };
        let rank = label
            .strip_prefix("rank-")
            .and_then(parse_canonical_u32)
            .ok_or_else(|| PkiError::AmbiguousRank(format!("malformed worker name {name:?}")))?;
        ranks.push(rank);
    }
    let rank = match ranks.as_slice() {
        [] => return Err(PkiError::NoRank),
        [rank] => *rank,
        many => {
            return Err(PkiError::AmbiguousRank(format!(
                "{} rank names ({many:?})",
                many.len()
            )))
        }
    };
    for cn in cert.subject().iter_common_name() {
        let Ok(cn) = cn.as_str() else { continue };
        if let Some(tail) = cn.strip_prefix(WORKER_CN_PREFIX) {
            if parse_canonical_u32(tail) != Some(rank) {
                return Err(PkiError::AmbiguousRank(format!(
                    "common name {cn:?} disagrees with rank {rank} of the DNS name"
                )));
            }
        }
    }
    let client_auth = cert
        .extended_key_usage()
        .map_err(|e| PkiError::Parse(e.to_string()))?
        .is_some_and(|eku| eku.value.client_auth);
    if !client_auth {
        return Err(PkiError::NotClientCert);
    }
    Ok(rank)
}

/// Whether a certificate may serve TLS (serverAuth usage).
fn has_server_auth(cert: &X509Certificate<'_>) -> Result<bool, String> {
    Ok(cert
        .extended_key_usage()
        .map_err(|e| e.to_string())?
        .is_some_and(|eku| eku.value.server_auth))
}

/// Decimal digits without sign or leading zeros ("0" itself is fine).
fn parse_canonical_u32(s: &str) -> Option<u32> {
    let canonical =
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    if canonical {
        s.parse().ok()
    } else {
        None
    }
}

/// Where the cluster's PEM files live. `worker_cert` and `worker_key` are
/// templates containing `{rank}`, e.g. `"certs/worker-{rank}.pem"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PkiPaths {
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub worker_cert: String,
    pub worker_key: String,
}

impl PkiPaths {
    /// The conventional layout in `dir`: `ca.pem`, `ca.key`, `server.pem`,
    /// `server.key`, `worker-{rank}.pem`, `worker-{rank}.key`.
    pub fn under(dir: &Path) -> Self {
        let template = |name: &str| dir.join(name).to_string_lossy().into_owned();
        Self {
            ca_cert: dir.join("ca.pem"),
            ca_key: dir.join("ca.key"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            worker_cert: template("worker-{rank}.pem"),
            worker_key: template("worker-{rank}.key"),
        }
    }

    /// The certificate and key paths of worker `rank`.
    pub fn worker_paths(&self, rank: u32) -> (PathBuf, PathBuf) {
        let fill = |t: &str| PathBuf::from(t.replace(RANK_PLACEHOLDER, &rank.to_string()));
        (fill(&self.worker_cert), fill(&self.worker_key))
    }
}

/// What [`ensure_cluster_pki`] did, file by file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PkiReport {
    /// Files created or replaced.
    pub written: Vec<PathBuf>,
    /// Files that were present and valid, left untouched.
    pub kept: Vec<PathBuf>,
}

/// How [`ensure_cluster_pki`] treats files that are already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Keep a pair that is still good and issue again one that is not
    /// (`ps-server certs`).
    Check,
    /// Keep every file that is there, as it is, and create only what is
    /// missing (a server's start with `tls.generate_if_missing`).
    Keep,
    /// Replace everything, CA included (`ps-server certs --force`).
    Replace,
}

/// Make sure the cluster's CA, server certificate and worker certificates for
/// ranks `0..workers` exist under `paths`.
///
/// With [`Existing::Check`]:
///
/// - The CA is reused when both of its files exist, else created. A reused
///   CA must load and must not have expired (the error names the file).
/// - The server and each worker pair is kept when both files exist and the
///   certificate is still good: signed by this CA, currently valid, matching
///   its key, and issued for the same rank / for every one of
///   `server_names` (names it carries beyond those are fine). Otherwise it
///   is (re)issued. A newly created CA reissues every pair.
/// - A server certificate issued again keeps the names the one it replaces
///   carried, so names added once (`ps-server certs --name`) stay.
///
/// With [`Existing::Keep`] no existing file is touched: a pair with a file
/// missing is issued with the CA that is there (its key is then needed), and
/// a CA is created only when no file of the cluster exists yet.
///
/// [`Existing::Replace`] replaces everything, CA included, with
/// `server_names` alone.
pub fn ensure_cluster_pki(
    paths: &PkiPaths,
    server_names: &[String],
    workers: u32,
    existing: Existing,
) -> Result<PkiReport, PkiError> {
    for template in [&paths.worker_cert, &paths.worker_key] {
        if !template.contains(RANK_PLACEHOLDER) {
            return Err(PkiError::Template {
                template: template.clone(),
            });
        }
    }
    let leaves: Vec<(PathBuf, PathBuf, Role<'_>)> = std::iter::once((
        paths.server_cert.clone(),
        paths.server_key.clone(),
        Role::Server(server_names),
    ))
    .chain((0..workers).map(|rank| {
        let (cert, key) = paths.worker_paths(rank);
        (cert, key, Role::Worker(rank))
    }))
    .collect();
    if existing == Existing::Keep {
        return create_missing(paths, &leaves);
    }
    let mut report = PkiReport::default();
    let reuse_ca = existing == Existing::Check && paths.ca_cert.exists() && paths.ca_key.exists();
    let ca = if reuse_ca {
        let ca = load_ca(paths)?;
        report
            .kept
            .extend([paths.ca_cert.clone(), paths.ca_key.clone()]);
        ca
    } else {
        new_ca(paths, &mut report)?
    };
    let keep_names = existing == Existing::Check;
    for (cert, key, role) in &leaves {
        let both = cert.exists() && key.exists();
        if reuse_ca && both {
            let pair = CertPair::read(cert, key)?;
            match ca.check_leaf(&pair, role) {
                Ok(()) => {
                    report.kept.extend([cert.clone(), key.clone()]);
                    continue;
                }
                Err(why) => tracing::warn!("{}: {why}; issuing a new certificate", cert.display()),
            }
        }
        issue_leaf(&ca, cert, key, role, keep_names, &mut report)?;
    }
    Ok(report)
}

/// [`Existing::Keep`]: create only the missing files.
fn create_missing(
    paths: &PkiPaths,
    leaves: &[(PathBuf, PathBuf, Role<'_>)],
) -> Result<PkiReport, PkiError> {
    let mut report = PkiReport::default();
    let missing: Vec<&(PathBuf, PathBuf, Role<'_>)> = leaves
        .iter()
        .filter(|(cert, key, _)| !(cert.exists() && key.exists()))
        .collect();
    let ca = if paths.ca_cert.exists() {
        report.kept.push(paths.ca_cert.clone());
        if paths.ca_key.exists() {
            report.kept.push(paths.ca_key.clone());
        }
        if missing.is_empty() {
            None
        } else if paths.ca_key.exists() {
            Some(load_ca(paths)?)
        } else {
            return Err(PkiError::BadFile {
                path: paths.ca_key.clone(),
                message: format!(
                    "the CA key is needed to issue {} and is not there (issue it where the CA key is, with `ps-server certs`)",
                    missing[0].0.display()
                ),
            });
        }
    } else {
        let existing: Vec<&PathBuf> = std::iter::once(&paths.ca_key)
            .chain(leaves.iter().flat_map(|(cert, key, _)| [cert, key]))
            .filter(|p| p.exists())
            .collect();
        if let Some(found) = existing.first() {
            return Err(PkiError::BadFile {
                path: paths.ca_cert.clone(),
                message: format!(
                    "the CA certificate is missing but {} is there: a new CA would not match it (restore the CA, or replace everything with `ps-server certs --force`)",
                    found.display()
                ),
            });
        }
        Some(new_ca(paths, &mut report)?)
    };
    for (cert, key, role) in leaves {
        if !missing.iter().any(|(c, _, _)| c == cert) {
            report.kept.extend([cert.clone(), key.clone()]);
            continue;
        }
        if let Some(ca) = &ca {
            issue_leaf(ca, cert, key, role, true, &mut report)?;
        }
    }
    Ok(report)
}

fn load_ca(paths: &PkiPaths) -> Result<ClusterCa, PkiError> {
    let cert_pem = read_file(&paths.ca_cert)?;
    let key_pem = read_file(&paths.ca_key)?;
    let ca = ClusterCa::from_pem(&cert_pem, &key_pem).map_err(|e| PkiError::BadFile {
        path: paths.ca_cert.clone(),
        message: format!(
            "{e} (key {}; pass force to replace the CA)",
            paths.ca_key.display()
        ),
    })?;
    if ca.not_after <= OffsetDateTime::now_utc() {
        return Err(PkiError::BadFile {
            path: paths.ca_cert.clone(),
            message: format!(
                "the cluster CA expired on {}; pass force to replace the cluster's certificates",
                ca.not_after
            ),
        });
    }
    Ok(ca)
}

fn new_ca(paths: &PkiPaths, report: &mut PkiReport) -> Result<ClusterCa, PkiError> {
    let ca = ClusterCa::generate("Stratus cluster CA")?;
    CertPair {
        cert_pem: ca.cert_pem.clone(),
        key_pem: ca.key_pem.clone(),
    }
    .write(&paths.ca_cert, &paths.ca_key)?;
    report
        .written
        .extend([paths.ca_cert.clone(), paths.ca_key.clone()]);
    Ok(ca)
}

/// Issue the pair for `role`; a server certificate also carries the names
/// of the certificate at `cert` when `keep_names` and one is readable there.
fn issue_leaf(
    ca: &ClusterCa,
    cert: &Path,
    key: &Path,
    role: &Role<'_>,
    keep_names: bool,
    report: &mut PkiReport,
) -> Result<(), PkiError> {
    let pair = match role {
        Role::Server(names) => {
            let mut all = names.to_vec();
            if keep_names {
                for name in names_in_cert_file(cert) {
                    if !all.iter().any(|n| name_key(n) == name_key(&name)) {
                        all.push(name);
                    }
                }
            }
            ca.issue_server(&all)
        }
        Role::Worker(rank) => ca.issue_worker(*rank),
    }
    .map_err(|e| PkiError::BadFile {
        path: cert.to_path_buf(),
        message: e.to_string(),
    })?;
    pair.write(cert, key)?;
    report
        .written
        .extend([cert.to_path_buf(), key.to_path_buf()]);
    Ok(())
}

/// The DNS names and IP addresses of the certificate in `path`, if it can
/// be read (else none).
fn names_in_cert_file(path: &Path) -> Vec<String> {
    let Ok(pem) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    let Ok(der) = first_cert_der(&pem) else {
        return Vec::new();
    };
    let Ok(cert) = parse_cert(&der) else {
        return Vec::new();
    };
    cert_names(&cert)
        .map(|names| {
            names
                .into_iter()
                .map(|n| match n {
                    NameKey::Dns(d) => d,
                    NameKey::Ip(ip) => ip.to_string(),
                })
                .collect()
        })
        .unwrap_or_default()
}

fn name_key(name: &str) -> NameKey {
    match name.parse::<IpAddr>() {
        Ok(ip) => NameKey::Ip(ip),
        Err(_) => NameKey::Dns(name.to_ascii_lowercase()),
    }
}

fn san_for(name: &str) -> Result<SanType, PkiError> {
    match name.parse::<IpAddr>() {
        Ok(ip) => Ok(SanType::IpAddress(ip)),
        Err(_) => name
            .to_string()
            .try_into()
            .map(SanType::DnsName)
            .map_err(|e: rcgen::Error| PkiError::BadName {
                name: name.to_string(),
                message: e.to_string(),
            }),
    }
}

fn first_cert_der(pem: &str) -> Result<CertificateDer<'static>, PkiError> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .ok_or_else(|| PkiError::Parse("no certificate in PEM".into()))?
        .map_err(|e| PkiError::Parse(format!("bad certificate PEM: {e}")))
}

fn parse_cert(der: &[u8]) -> Result<X509Certificate<'_>, PkiError> {
    let (rest, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|e| PkiError::Parse(e.to_string()))?;
    if !rest.is_empty() {
        return Err(PkiError::Parse(format!(
            "{} trailing bytes after the certificate",
            rest.len()
        )));
    }
    Ok(cert)
}

fn gen_err(e: rcgen::Error) -> PkiError {
    PkiError::Generate(e.to_string())
}

fn read_file(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|source| PkiError::Io {
        action: "read",
        path: path.to_path_buf(),
        source,
    })
}

fn write_file(path: &Path, text: &str, private: bool) -> Result<(), PkiError> {
    let io = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| PkiError::Io {
            action,
            path,
            source,
        }
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io("create directory", dir))?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(io("write", path))?;
    // A key file that already existed keeps its old mode through open():
    // tighten it before writing the new key into it.
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io("set permissions on", path))?;
    }
    #[cfg(not(unix))]
    let _ = private;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(io("write", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca() -> ClusterCa {
        ClusterCa::generate("test CA").unwrap()
    }

    #[test]
    fn worker_rank_round_trips() {
        let ca = ca();
        for rank in [0, 1, 42, u32::MAX] {
            let pair = ca.issue_worker(rank).unwrap();
            assert_eq!(rank_from_cert_der(&pair.cert_der().unwrap()).unwrap(), rank);
        }
    }

    #[test]
    fn server_cert_is_not_a_worker_identity() {
        let pair = ca()
            .issue_server(&["localhost".into(), "127.0.0.1".into()])
            .unwrap();
        let err = rank_from_cert_der(&pair.cert_der().unwrap()).unwrap_err();
        assert!(matches!(err, PkiError::NoRank), "{err}");
    }

    #[test]
    fn ca_cert_is_not_a_worker_identity() {
        let ca = ca();
        let der = first_cert_der(ca.cert_pem()).unwrap();
        assert!(matches!(rank_from_cert_der(&der), Err(PkiError::NoRank)));
    }

    #[test]
    fn rank_parsing_is_strict() {
        assert_eq!(parse_canonical_u32("0"), Some(0));
        assert_eq!(parse_canonical_u32("17"), Some(17));
        for bad in ["", "01", "+1", "-1", "1a", "4294967296", " 1"] {
            assert_eq!(parse_canonical_u32(bad), None, "{bad:?}");
        }
    }

    /// A client certificate from the CA with arbitrary names and common name.
    fn custom_worker(ca: &ClusterCa, cn: &str, dns: &[&str]) -> Vec<u8> {
        let sans = dns.iter().map(|d| san_for(d).unwrap()).collect();
        let pair = ca
            .issue(cn, sans, vec![ExtendedKeyUsagePurpose::ClientAuth])
            .unwrap();
        pair.cert_der().unwrap().to_vec()
    }

    #[test]
    fn ambiguous_ranks_are_refused() {
        let ca = ca();
        let two = custom_worker(
            &ca,
            "x",
            &["rank-1.workers.stratus", "rank-2.workers.stratus"],
        );
        assert!(matches!(
            rank_from_cert_der(&two),
            Err(PkiError::AmbiguousRank(_))
        ));
        let padded = custom_worker(&ca, "x", &["rank-01.workers.stratus"]);
        assert!(matches!(
            rank_from_cert_der(&padded),
            Err(PkiError::AmbiguousRank(_))
        ));
        let wild = custom_worker(&ca, "x", &["*.workers.stratus"]);
        assert!(matches!(
            rank_from_cert_der(&wild),
            Err(PkiError::AmbiguousRank(_))
        ));
        let cn = custom_worker(&ca, "stratus-worker-3", &["rank-4.workers.stratus"]);
        assert!(matches!(
            rank_from_cert_der(&cn),
            Err(PkiError::AmbiguousRank(_))
        ));
        // The common name is informational: any other CN is fine.
        let plain = custom_worker(&ca, "someone", &["rank-4.workers.stratus", "host.example"]);
        assert_eq!(rank_from_cert_der(&plain).unwrap(), 4);
        assert!(rank_from_cert_der(b"not a certificate").is_err());
        // A rank name on a server certificate is not a worker identity.
        let sans = vec![san_for(&worker_dns_name(4)).unwrap()];
        let server = ca
            .issue("x", sans, vec![ExtendedKeyUsagePurpose::ServerAuth])
            .unwrap();
        let err = rank_from_cert_der(&server.cert_der().unwrap()).unwrap_err();
        assert!(matches!(err, PkiError::NotClientCert), "{err}");
    }

    #[test]
    fn ca_round_trips_through_pem_and_still_signs() {
        let ca = ca();
        let again = ClusterCa::from_pem(ca.cert_pem(), ca.key_pem()).unwrap();
        let pair = again.issue_worker(5).unwrap();
        assert!(ca.check_leaf(&pair, &Role::Worker(5)).is_ok());
        // A worker certificate issued for client authentication only (before
        // the peer cache tier) is issued again.
        let sans = vec![san_for(&worker_dns_name(5)).unwrap()];
        let client_only = ca
            .issue(
                &worker_common_name(5),
                sans,
                vec![ExtendedKeyUsagePurpose::ClientAuth],
            )
            .unwrap();
        let why = ca.check_leaf(&client_only, &Role::Worker(5)).unwrap_err();
        assert!(why.contains("serverAuth"), "{why}");
        assert!(ca.check_leaf(&pair, &Role::Worker(6)).is_err());
        let other = ClusterCa::generate("test CA").unwrap();
        assert!(other.check_leaf(&pair, &Role::Worker(5)).is_err());
        // A key from elsewhere, or a leaf certificate, is not a CA.
        assert!(ClusterCa::from_pem(ca.cert_pem(), other.key_pem()).is_err());
        assert!(ClusterCa::from_pem(&pair.cert_pem, &pair.key_pem).is_err());
    }

    #[test]
    fn worker_paths_fill_the_template() {
        let paths = PkiPaths::under(Path::new("certs"));
        let (cert, key) = paths.worker_paths(12);
        assert_eq!(cert, Path::new("certs/worker-12.pem"));
        assert_eq!(key, Path::new("certs/worker-12.key"));
    }

    #[test]
    fn ensure_writes_once_keeps_then_forces() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PkiPaths::under(&dir.path().join("nested/certs"));
        let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        let all = 2 + 2 + 2 * 3;

        let first = ensure_cluster_pki(&paths, &names, 3, Existing::Check).unwrap();
        assert_eq!(first.written.len(), all);
        assert!(first.kept.is_empty());
        for path in &first.written {
            assert!(path.is_file(), "{}", path.display());
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            for key in [&paths.ca_key, &paths.server_key, &paths.worker_paths(2).1] {
                let mode = std::fs::metadata(key).unwrap().permissions().mode();
                assert_eq!(mode & 0o777, 0o600, "{}", key.display());
            }
        }
        let (w1, k1) = paths.worker_paths(1);
        let pair = CertPair::read(&w1, &k1).unwrap();
        assert_eq!(rank_from_cert_der(&pair.cert_der().unwrap()).unwrap(), 1);

        let second = ensure_cluster_pki(&paths, &names, 3, Existing::Check).unwrap();
        assert!(second.written.is_empty(), "{second:?}");
        assert_eq!(second.kept.len(), all);
        assert_eq!(CertPair::read(&w1, &k1).unwrap(), pair);

        // One more worker, and a lost worker key: only those are written.
        std::fs::remove_file(&k1).unwrap();
        let grow = ensure_cluster_pki(&paths, &names, 4, Existing::Check).unwrap();
        let (w3, k3) = paths.worker_paths(3);
        assert_eq!(grow.written, vec![w1.clone(), k1.clone(), w3, k3]);

        // New server names reissue the server certificate only.
        let more = vec!["localhost".to_string(), "ps-0.internal".to_string()];
        let renamed = ensure_cluster_pki(&paths, &more, 4, Existing::Check).unwrap();
        assert_eq!(
            renamed.written,
            vec![paths.server_cert.clone(), paths.server_key.clone()]
        );

        let ca_before = std::fs::read_to_string(&paths.ca_cert).unwrap();
        let forced = ensure_cluster_pki(&paths, &more, 4, Existing::Replace).unwrap();
        assert_eq!(forced.written.len(), 4 + 2 * 4);
        assert!(forced.kept.is_empty());
        assert_ne!(std::fs::read_to_string(&paths.ca_cert).unwrap(), ca_before);
        let after = CertPair::read(&w1, &k1).unwrap();
        assert_ne!(after, pair);
        assert_eq!(rank_from_cert_der(&after.cert_der().unwrap()).unwrap(), 1);
    }

    /// Every file of the layout, by path, with its contents.
    fn snapshot(paths: &PkiPaths, workers: u32) -> Vec<(PathBuf, String)> {
        let mut files = vec![
            paths.ca_cert.clone(),
            paths.ca_key.clone(),
            paths.server_cert.clone(),
            paths.server_key.clone(),
        ];
        for rank in 0..workers {
            let (cert, key) = paths.worker_paths(rank);
            files.extend([cert, key]);
        }
        files
            .into_iter()
            .map(|p| {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                (p, text)
            })
            .collect()
    }

    #[test]
    fn extra_names_stay_and_a_start_creates_only_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PkiPaths::under(dir.path());
        let base = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        let mut with_extra = base.clone();
        with_extra.push("ps-0.example".to_string());
        // `ps-server certs --name ps-0.example`, then a server's first start
        // (which knows only the names of the config).
        ensure_cluster_pki(&paths, &with_extra, 2, Existing::Check).unwrap();
        let before = snapshot(&paths, 2);
        let start = ensure_cluster_pki(&paths, &base, 2, Existing::Keep).unwrap();
        assert!(start.written.is_empty(), "{start:?}");
        assert_eq!(start.kept.len(), 2 + 2 + 2 * 2);
        assert_eq!(snapshot(&paths, 2), before);
        // `ps-server certs` without the --name keeps the certificate too.
        let again = ensure_cluster_pki(&paths, &base, 2, Existing::Check).unwrap();
        assert!(again.written.is_empty(), "{again:?}");
        assert_eq!(snapshot(&paths, 2), before);
        // A new name reissues the server certificate with the old names kept.
        let mut renamed = base.clone();
        renamed.push("ps-1.example".to_string());
        let report = ensure_cluster_pki(&paths, &renamed, 2, Existing::Check).unwrap();
        assert_eq!(
            report.written,
            vec![paths.server_cert.clone(), paths.server_key.clone()]
        );
        let names = names_in_cert_file(&paths.server_cert);
        for name in ["localhost", "127.0.0.1", "ps-0.example", "ps-1.example"] {
            assert!(names.iter().any(|n| n == name), "{name} not in {names:?}");
        }

        // A start with a worker key lost issues that pair only, and keeps
        // the names of the server certificate.
        let before = snapshot(&paths, 3);
        let (w1, k1) = paths.worker_paths(1);
        std::fs::remove_file(&k1).unwrap();
        let start = ensure_cluster_pki(&paths, &base, 3, Existing::Keep).unwrap();
        let (w2, k2) = paths.worker_paths(2);
        assert_eq!(start.written, vec![w1.clone(), k1.clone(), w2, k2]);
        let after = snapshot(&paths, 3);
        for ((path, old), (_, new)) in before.iter().zip(&after) {
            if ![&w1, &k1].contains(&path) && !path.to_string_lossy().contains("worker-2") {
                assert_eq!(old, new, "{} changed", path.display());
            }
        }
        let pair = CertPair::read(&w1, &k1).unwrap();
        assert_eq!(rank_from_cert_der(&pair.cert_der().unwrap()).unwrap(), 1);
        let ca = load_ca(&paths).unwrap();
        assert!(ca.check_leaf(&pair, &Role::Worker(1)).is_ok());

        // Without the CA key, a start that has everything needs nothing...
        std::fs::remove_file(&paths.ca_key).unwrap();
        let before = snapshot(&paths, 3);
        let start = ensure_cluster_pki(&paths, &base, 3, Existing::Keep).unwrap();
        assert!(start.written.is_empty(), "{start:?}");
        assert_eq!(snapshot(&paths, 3), before);
        // ...and one that misses a certificate says which key it lacks,
        // instead of making a CA of its own.
        std::fs::remove_file(&w1).unwrap();
        let err = ensure_cluster_pki(&paths, &base, 3, Existing::Keep).unwrap_err();
        assert!(err.to_string().contains("ca.key"), "{err}");
        assert!(!paths.ca_key.exists());
        // Certificates without their CA certificate are an error too.
        std::fs::remove_file(&paths.ca_cert).unwrap();
        let err = ensure_cluster_pki(&paths, &base, 3, Existing::Keep).unwrap_err();
        assert!(err.to_string().contains("ca.pem"), "{err}");

        // An empty directory: a start creates everything.
        let fresh = tempfile::tempdir().unwrap();
        let paths = PkiPaths::under(fresh.path());
        let start = ensure_cluster_pki(&paths, &base, 2, Existing::Keep).unwrap();
        assert_eq!(start.written.len(), 2 + 2 + 2 * 2);
        assert!(start.kept.is_empty());
    }

    #[test]
    fn a_new_ca_reissues_every_pair() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PkiPaths::under(dir.path());
        let names = vec!["localhost".to_string()];
        ensure_cluster_pki(&paths, &names, 2, Existing::Check).unwrap();
        std::fs::remove_file(&paths.ca_key).unwrap();
        let report = ensure_cluster_pki(&paths, &names, 2, Existing::Check).unwrap();
        assert!(report.kept.is_empty(), "{report:?}");
        assert_eq!(report.written.len(), 4 + 2 * 2);
    }

    #[test]
    fn errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let paths = PkiPaths::under(dir.path());
        std::fs::write(&paths.ca_cert, "garbage").unwrap();
        std::fs::write(&paths.ca_key, "garbage").unwrap();
        let err =
            ensure_cluster_pki(&paths, &["localhost".into()], 1, Existing::Check).unwrap_err();
        assert!(err.to_string().contains("ca.pem"), "{err}");

        let mut bad = PkiPaths::under(dir.path());
        bad.worker_key = dir.path().join("worker.key").display().to_string();
        let err =
            ensure_cluster_pki(&bad, &["localhost".into()], 1, Existing::Replace).unwrap_err();
        assert!(matches!(err, PkiError::Template { .. }), "{err}");

        let missing = dir.path().join("nope.pem");
        let err = CertPair::read(&missing, &missing).unwrap_err();
        assert!(err.to_string().contains("nope.pem"), "{err}");
    }
}
