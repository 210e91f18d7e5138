//! TLS trust shared by the worker and the publisher: the system's root
//! certificates plus an optional extra PEM bundle (`WORKER_CA_FILE`, `PUBLISHER_CA_FILE`), one
//! crypto provider (ring) for every TLS client in the process, and a reason in plain words when
//! a peer's certificate is refused. Wiring this into lapin, sqlx and reqwest stays with each
//! binary: this crate must not pull in those clients.
//!
//! System roots come from the operating system's store (`rustls-native-certs`), not from a list
//! compiled into the binary (`webpki-roots`): the image's `ca-certificates` package and a
//! platform team's own CAs installed with `update-ca-certificates` are honoured, and the list is
//! updated with the OS rather than by rebuilding the worker.

use std::error::Error as StdError;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::{CertificateError, RootCertStore};

/// A bad extra CA bundle: start-up stops with the variable that named it.
#[derive(Debug, thiserror::Error)]
pub enum CaFileError {
    // The io error is part of the message and not a `source`, so a chain printer shows it once.
    #[error("{var}={path}: cannot read the CA file: {error}")]
    Read {
        var: &'static str,
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{var}={path}: {reason}")]
    Invalid {
        var: &'static str,
        path: PathBuf,
        reason: String,
    },
}

/// The trust of one process: system roots plus the extra bundle, and the rustls client
/// configuration built from them. Cheap to clone.
#[derive(Clone)]
pub struct Trust {
    ca_file: Option<PathBuf>,
    /// The extra bundle's text (lapin takes PEM), validated.
    extra_pem: Option<Arc<str>>,
    client: Arc<rustls::ClientConfig>,
}

impl fmt::Debug for Trust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Trust")
            .field("ca_file", &self.ca_file)
            .finish_non_exhaustive()
    }
}

/// Makes ring the process-wide rustls provider. Clients that do not take a configuration from
/// [`Trust`] (and reqwest's builder, which asks for the process default) need one; calling it
/// again is harmless.
pub fn install_default_provider() {
    // Err means a provider is already installed: ring, since no other is compiled in.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl Trust {
    /// The system roots only.
    pub fn system() -> Trust {
        Trust::build(None, None, Vec::new())
    }

    /// The system roots plus the certificates of `ca_file` (PEM, one or more `CERTIFICATE`
    /// blocks), which `var` named. A file that is missing, unreadable or holds no certificate
    /// is an error: a typo must not silently leave a private CA untrusted.
    pub fn load(var: &'static str, ca_file: Option<&Path>) -> Result<Trust, CaFileError> {
        let Some(path) = ca_file else {
            return Ok(Trust::system());
        };
        let invalid = |reason: String| CaFileError::Invalid {
            var,
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|error| CaFileError::Read {
            var,
            path: path.to_path_buf(),
            error,
        })?;
        let certs = CertificateDer::pem_slice_iter(text.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(format!("not a PEM file: {e}")))?;
        if certs.is_empty() {
            return Err(invalid(
                "no certificate in it (expected PEM blocks \"-----BEGIN CERTIFICATE-----\")".into(),
            ));
        }
        let mut check = RootCertStore::empty();
        for (i, cert) in certs.iter().enumerate() {
            check
                .add(cert.clone())
                .map_err(|e| invalid(format!("certificate {} is not usable: {e}", i + 1)))?;
        }
        Ok(Trust::build(
            Some(path.to_path_buf()),
            Some(Arc::from(text)),
            certs,
        ))
    }

    fn build(
        ca_file: Option<PathBuf>,
        extra_pem: Option<Arc<str>>,
        extra: Vec<CertificateDer<'static>>,
    ) -> Trust {
        install_default_provider();
        let mut roots = RootCertStore::empty();
        // Unreadable system certificates are skipped, as every TLS client does: the rest (and
        // the extra bundle) still work, and a peer they do not cover is refused by name.
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        roots.add_parsable_certificates(extra);
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        Trust {
            ca_file,
            extra_pem,
            client: Arc::new(client),
        }
    }

    /// The extra CA file, when one is configured.
    pub fn ca_file(&self) -> Option<&Path> {
        self.ca_file.as_deref()
    }

    /// The extra bundle as PEM text, when one is configured.
    pub fn extra_pem(&self) -> Option<&str> {
        self.extra_pem.as_deref()
    }

    /// A rustls client configuration trusting the system roots and the extra bundle (for
    /// reqwest's `tls_backend_preconfigured`, which takes it by value).
    pub fn client_config(&self) -> rustls::ClientConfig {
        (*self.client).clone()
    }
}

/// Why a TLS handshake failed, when `error` (or any error it wraps) is one: the peer's
/// certificate was refused (unknown issuer, name mismatch, expired...) or the peer did not speak
/// TLS as expected. `None` for anything else (refused connection, timeout, DNS...).
///
/// Walks the `source()` chain and also looks inside `std::io::Error`s, whose `source()` skips
/// the error they wrap (that is how rustls errors travel through the clients' I/O layers).
pub fn handshake_failure(error: &(dyn StdError + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(describe(tls));
        }
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if let Some(found) = handshake_failure(inner) {
                return Some(found);
            }
        }
        next = e.source();
    }
    None
}

/// A short verdict first (what an operator searches for), then rustls' own detail.
fn describe(error: &rustls::Error) -> String {
    let verdict = match error {
        rustls::Error::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer => {
                "unknown issuer: the server's certificate is not signed by a trusted CA \
                 (system roots plus the CA file, if one is set)"
            }
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                "name mismatch: the server's certificate is not valid for the host name in the URL"
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "expired: the server's certificate is past its validity"
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "not yet valid: the server's certificate starts in the future (or this clock is wrong)"
            }
            CertificateError::Revoked => "revoked: the server's certificate was revoked",
            _ => "certificate refused",
        },
        rustls::Error::AlertReceived(_) => "the server refused the TLS handshake",
        rustls::Error::InvalidMessage(_) => {
            "the peer does not speak TLS here (a plain port behind an amqps:// or https:// URL?)"
        }
        _ => "TLS handshake failed",
    };
    format!("{verdict} ({error})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_empty_ca_file_names_the_variable() {
        let err = Trust::load("WORKER_CA_FILE", Some(Path::new("/nonexistent/ca.pem")))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("WORKER_CA_FILE=/nonexistent/ca.pem"),
            "{err}"
        );
        let dir = std::env::temp_dir().join(format!("tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = Trust::load("PUBLISHER_CA_FILE", Some(&empty))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("PUBLISHER_CA_FILE=") && err.contains("no certificate"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_certificate_refusal_is_found_inside_io_errors() {
        let tls = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, tls);
        let reason = handshake_failure(&io).expect("found");
        assert!(reason.starts_with("unknown issuer"), "{reason}");
        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(handshake_failure(&plain).is_none());
    }
}
