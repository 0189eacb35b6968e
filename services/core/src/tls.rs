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

/// Mutual TLS between the mesh's services (gRPC only; the admin HTTP
/// endpoints and the gateway's OpenAI port stay plain HTTP). With all three
/// files, every gRPC server asks for a client certificate signed by the
/// CA and checks it, and every gRPC client presents its own and checks the
/// server's. An instance's identity is its certificate's common name,
/// `<kind>/<instance id>` (`decode/decode-0`).
#[derive(clap::Args, Debug, Clone, Default, serde::Serialize)]
pub struct MeshTlsArgs {
    /// CA certificate (PEM) that signs every certificate of the mesh; with
    /// --tls-cert and --tls-key it turns on mutual TLS for gRPC.
    #[arg(long, env = "PDMESH_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This instance's certificate (PEM), whose common name is
    /// `<kind>/<instance id>`.
    #[arg(long, env = "PDMESH_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "PDMESH_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
}

/// The mesh's TLS material of this process (PEM text).
pub struct MeshTls {
    ca: String,
    cert: String,
    key: String,
    /// The common name of this process's own certificate.
    pub identity: String,
}

static MESH_TLS: std::sync::OnceLock<MeshTls> = std::sync::OnceLock::new();

impl MeshTlsArgs {
    /// Read the three files (all or none may be given).
    pub fn load(&self) -> Result<Option<MeshTls>, String> {
        let (ca, cert, key) = match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (None, None, None) => return Ok(None),
            (Some(a), Some(c), Some(k)) => (a, c, k),
            _ => return Err("mesh TLS needs all of --tls-ca, --tls-cert and --tls-key".into()),
        };
        let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
        let identity = certs(cert)?.first().and_then(|c| common_name(c.as_ref())).ok_or_else(|| {
            format!("{}: the certificate has no common name (its identity, `<kind>/<id>`)", cert.display())
        })?;
        certs(ca)?;
        Ok(Some(MeshTls { ca: read(ca)?, cert: read(cert)?, key: read(key)?, identity }))
    }

    /// Load the files and use them for every gRPC server and client of this
    /// process; `expected` is the identity the certificate must carry.
    /// Returns whether mesh TLS is on.
    pub fn install(&self, expected: &str) -> Result<bool, String> {
        let Some(t) = self.load()? else { return Ok(false) };
        if t.identity != expected {
            return Err(format!("the TLS certificate is for {}, this is {expected}", t.identity));
        }
        let _ = MESH_TLS.set(t);
        Ok(true)
    }

    /// The files from `PDMESH_TLS_CA`, `PDMESH_TLS_CERT` and `PDMESH_TLS_KEY`
    /// (command-line clients such as `meshctl generate`).
    pub fn from_env() -> MeshTlsArgs {
        let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
        MeshTlsArgs { tls_ca: var("PDMESH_TLS_CA"), tls_cert: var("PDMESH_TLS_CERT"), tls_key: var("PDMESH_TLS_KEY") }
    }

    /// Install the files from the environment whatever their identity (a
    /// client only); whether mesh TLS is on.
    pub fn install_client_from_env() -> Result<bool, String> {
        let Some(t) = MeshTlsArgs::from_env().load()? else { return Ok(false) };
        let _ = MESH_TLS.set(t);
        Ok(true)
    }
}

/// This process's mesh TLS, once installed.
pub fn mesh() -> Option<&'static MeshTls> {
    MESH_TLS.get()
}

impl MeshTls {
    pub fn server(&self) -> tonic::transport::ServerTlsConfig {
        use tonic::transport::{Certificate, Identity};
        tonic::transport::ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .client_ca_root(Certificate::from_pem(&self.ca))
    }

    pub fn client(&self) -> tonic::transport::ClientTlsConfig {
        use tonic::transport::{Certificate, Identity};
        tonic::transport::ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .identity(Identity::from_pem(&self.cert, &self.key))
    }
}

/// The caller's identity under mesh TLS: its certificate's common name
/// (`<kind>/<instance id>`), checked by the TLS handshake against the
/// mesh's CA. `None` without TLS.
pub fn peer_identity<T>(req: &tonic::Request<T>) -> Option<String> {
    let certs = req.peer_certs()?;
    common_name(certs.first()?.as_ref())
}

/// One DER element: its tag, its contents, and what follows it.
fn der(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = b.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        (rest[..n].iter().fold(0usize, |a, &x| a << 8 | x as usize), &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// The subject's common name (OID 2.5.4.3) of an X.509 certificate (DER).
pub fn common_name(cert: &[u8]) -> Option<String> {
    let (_, certificate, _) = der(cert)?;
    let (_, tbs, _) = der(certificate)?;
    let mut rest = tbs;
    // version [0] (optional), serial, signature, issuer, validity, subject
    let (tag, _, r) = der(rest)?;
    if tag == 0xa0 {
        rest = r;
    }
    for _ in 0..4 {
        rest = der(rest)?.2;
    }
    let (_, subject, _) = der(rest)?;
    let mut rdns = subject;
    while let Some((_, set, more)) = der(rdns) {
        let (_, attr, _) = der(set)?;
        let (_, oid, value) = der(attr)?;
        if oid == [0x55, 0x04, 0x03] {
            return String::from_utf8(der(value)?.1.to_vec()).ok();
        }
        rdns = more;
    }
    None
}

#[cfg(test)]
mod mesh_tests {
    #[test]
    fn the_common_name_is_read_from_a_certificate() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
        p.distinguished_name.push(rcgen::DnType::OrganizationName, "pdmesh");
        p.distinguished_name.push(rcgen::DnType::CommonName, "decode/decode-0");
        let cert = p.self_signed(&key).unwrap();
        assert_eq!(super::common_name(cert.der()).as_deref(), Some("decode/decode-0"));
        assert_eq!(super::common_name(&cert.der()[..40]), None);
        assert_eq!(super::common_name(&[]), None);
    }
}
