//! `meshctl up --tls`: a development certificate authority made at start,
//! and a certificate per instance signed by it, so that the services speak
//! mutual TLS to each other. Each certificate's common name is the
//! instance's identity, `<kind>/<id>`; its names are `localhost`,
//! 127.0.0.1 and ::1 (the mesh runs on this machine). The files live in
//! the TLS folder: `ca.pem` (and `ca.key`, readable by the owner only),
//! `<id>.pem`/`<id>.key` per instance, and `client.pem`/`client.key`, the
//! identity `meshctl/client` for command-line clients and tests.
//!
//! This is for development and tests. In production, give each service
//! `--tls-ca`, `--tls-cert` and `--tls-key` from your own PKI (docs/reference/services.md).

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose};

pub struct DevCa {
    dir: PathBuf,
    cert: rcgen::Certificate,
    key: KeyPair,
}

/// The three files of one identity.
pub struct Issued {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Issued {
    /// The flags that give a service this identity.
    pub fn args(&self) -> Vec<String> {
        let p = |p: &Path| p.display().to_string();
        vec!["--tls-ca".into(), p(&self.ca), "--tls-cert".into(), p(&self.cert), "--tls-key".into(), p(&self.key)]
    }
}

fn write(path: &Path, text: &str, private: bool) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true).mode(if private { 0o600 } else { 0o644 });
    let mut f = o.open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    std::io::Write::write_all(&mut f, text.as_bytes()).map_err(|e| format!("{}: {e}", path.display()))
}

impl DevCa {
    /// A new CA in `dir` (made if missing), and the command-line client's identity.
    pub fn create(dir: &Path) -> Result<DevCa, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let err = |e: rcgen::Error| format!("development CA: {e}");
        let key = KeyPair::generate().map_err(err)?;
        let mut p = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, "pdmesh development CA");
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = p.self_signed(&key).map_err(err)?;
        write(&dir.join("ca.pem"), &cert.pem(), false)?;
        write(&dir.join("ca.key"), &key.serialize_pem(), true)?;
        let ca = DevCa { dir: dir.to_path_buf(), cert, key };
        ca.issue("meshctl/client", "client")?;
        Ok(ca)
    }

    /// A certificate for `identity` (`<kind>/<id>`), written as `<file>.pem` and `<file>.key`.
    pub fn issue(&self, identity: &str, file: &str) -> Result<Issued, String> {
        let err = |e: rcgen::Error| format!("certificate for {identity}: {e}");
        let key = KeyPair::generate().map_err(err)?;
        let names = vec!["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
        let mut p = CertificateParams::new(names).map_err(err)?;
        p.distinguished_name.push(DnType::CommonName, identity);
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = p.signed_by(&key, &self.cert, &self.key).map_err(err)?;
        let issued = Issued {
            ca: self.dir.join("ca.pem"),
            cert: self.dir.join(format!("{file}.pem")),
            key: self.dir.join(format!("{file}.key")),
        };
        write(&issued.cert, &cert.pem(), false)?;
        write(&issued.key, &key.serialize_pem(), true)?;
        Ok(issued)
    }
}
