//! TLS client settings from PEM files (rustls with the ring provider): the
//! roots to trust (a CA file, a folder of them, or the system's), and an
//! optional client certificate for servers that ask for one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Where a TLS client's trust and identity come from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// A PEM file of CA certificates to trust.
    pub ca_file: Option<PathBuf>,
    /// A folder of PEM CA certificates to trust. With neither, the
    /// system's roots are trusted.
    pub ca_dir: Option<PathBuf>,
    /// A client certificate chain (PEM) and its key (PEM), for mutual TLS.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    /// Verify the server as this name instead of the host it is reached at.
    pub server_name: Option<String>,
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let iter = CertificateDer::pem_file_iter(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let certs: Vec<_> = iter.collect::<Result<_, _>>().map_err(|e| format!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

impl ClientTls {
    /// The roots: the CA file and folder if given, else the system's.
    fn roots(&self) -> Result<rustls::RootCertStore, String> {
        let mut roots = rustls::RootCertStore::empty();
        let mut given = Vec::new();
        if let Some(f) = &self.ca_file {
            given.extend(certs(f)?);
        }
        if let Some(d) = &self.ca_dir {
            let rd = std::fs::read_dir(d).map_err(|e| format!("{}: {e}", d.display()))?;
            for e in rd.flatten().filter(|e| e.path().is_file()) {
                given.extend(certs(&e.path())?);
            }
        }
        if self.ca_file.is_none() && self.ca_dir.is_none() {
            given = rustls_native_certs::load_native_certs().certs;
        }
        for c in given {
            roots.add(c).map_err(|e| format!("a CA certificate was refused: {e}"))?;
        }
        if roots.is_empty() {
            return Err("no CA certificate to trust: give one".into());
        }
        Ok(roots)
    }

    /// The rustls client configuration.
    pub fn config(&self) -> Result<rustls::ClientConfig, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(self.roots()?);
        match (&self.client_cert, &self.client_key) {
            (Some(c), Some(k)) => {
                let key = PrivateKeyDer::from_pem_file(k).map_err(|e| format!("{}: {e}", k.display()))?;
                builder.with_client_auth_cert(certs(c)?, key).map_err(|e| format!("client certificate: {e}"))
            }
            (None, None) => Ok(builder.with_no_client_auth()),
            _ => Err("a client certificate needs both the certificate and its key".into()),
        }
    }
}
