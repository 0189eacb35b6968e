//! API keys at the front door: `--api-keys-file`, one key per line, each
//! with optional limits of its own. Only SHA-256 digests of keys are kept
//! in memory (and the file may hold digests only). The file is read again
//! whenever it changes, so keys are added and revoked without a restart;
//! a file that no longer parses leaves the last good table in force.
//!
//! A line: `KEY [name=NAME] [concurrency=N] [rpm=N]`, where KEY is the key
//! itself or `sha256:<64 hex digits>` (its digest); `#` starts a comment.
//! `concurrency` caps the key's requests in flight, `rpm` its requests per
//! minute (a bucket of `rpm` refilled at `rpm`/60 per second); 0 lifts a
//! cap; missing ones take `--key-max-concurrency` and `--key-rpm`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap};
use sha2::{Digest, Sha256};

type Hash = [u8; 32];

/// Caps of one key; 0 = none.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    pub concurrency: u32,
    pub rpm: u32,
}

/// One key: its name (for spans and logs; never the key), its caps and use.
pub struct Key {
    pub name: String,
    limits: Limits,
    in_flight: AtomicU32,
    /// Requests the minute's budget still allows, and when it was last refilled.
    bucket: Mutex<(f64, Instant)>,
}

/// Why a request was refused; the gateway answers 401 or 429.
#[derive(Debug, PartialEq)]
pub enum Refused {
    /// No `Authorization: Bearer` header (401).
    Missing,
    /// A key not in the file, or revoked (401).
    Invalid,
    /// The key's requests per minute are spent (429 with Retry-After).
    Rate { retry_after_s: u64 },
    /// The key's requests in flight are at its cap (429).
    Concurrency { limit: u32 },
}

impl Refused {
    /// Label for `pdmesh_gateway_auth_refused_total{reason}`.
    pub fn label(&self) -> &'static str {
        match self {
            Refused::Missing => "missing_key",
            Refused::Invalid => "invalid_key",
            Refused::Rate { .. } => "rate",
            Refused::Concurrency { .. } => "concurrency",
        }
    }
}

/// A request admitted under a key: counted in flight until dropped.
pub struct Admitted(Arc<Key>);

impl Admitted {
    pub fn name(&self) -> &str {
        &self.0.name
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The keys in force and where they come from.
pub struct Keys {
    file: PathBuf,
    defaults: Limits,
    table: RwLock<(String, HashMap<Hash, Arc<Key>>)>,
    /// The last file text that did not parse (not parsed again until it changes).
    last_bad: Mutex<String>,
    pub reload_errors: AtomicU64,
    pub refused: [AtomicU64; 4],
}

impl Keys {
    /// Read `file` (an error names the line, never a key).
    pub fn load(file: &Path, defaults: Limits) -> Result<Keys, String> {
        let text = read(file)?;
        let table = parse(&text, defaults, &HashMap::new())?;
        Ok(Keys {
            file: file.to_path_buf(),
            defaults,
            table: RwLock::new((text, table)),
            last_bad: Mutex::default(),
            reload_errors: AtomicU64::new(0),
            refused: Default::default(),
        })
    }

    /// Keys loaded now.
    pub fn count(&self) -> usize {
        self.table.read().unwrap_or_else(|e| e.into_inner()).1.len()
    }

    /// Read the file again if it changed; keys that stay keep their use
    /// (requests in flight, the minute's budget). Returns whether it changed.
    pub fn reload(&self) -> Result<bool, String> {
        let text = read(&self.file)?;
        let mut t = self.table.write().unwrap_or_else(|e| e.into_inner());
        let mut bad = self.last_bad.lock().unwrap_or_else(|e| e.into_inner());
        if t.0 == text || *bad == text {
            return Ok(false);
        }
        match parse(&text, self.defaults, &t.1) {
            Ok(table) => {
                *t = (text, table);
                Ok(true)
            }
            Err(e) => {
                *bad = text;
                self.reload_errors.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Follow the file every `every`, until the process ends.
    pub fn follow(self: Arc<Self>, every: Duration) {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                match self.reload() {
                    Ok(true) => eprintln!("pdmesh-gateway: API keys reloaded: {} key(s)", self.count()),
                    Ok(false) => {}
                    Err(e) => eprintln!("pdmesh-gateway: API keys not reloaded, the last good ones stay: {e}"),
                }
            }
        });
    }

    /// The key of `headers`' bearer token, if known (a refusal is counted).
    pub fn verify(&self, headers: &HeaderMap) -> Result<Arc<Key>, Refused> {
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim)
            .filter(|t| !t.is_empty());
        let r = match token {
            None => Err(Refused::Missing),
            Some(t) => {
                let hash: Hash = Sha256::digest(t.as_bytes()).into();
                self.table.read().unwrap_or_else(|e| e.into_inner()).1.get(&hash).cloned().ok_or(Refused::Invalid)
            }
        };
        self.counted(r)
    }

    /// Verify the key and take one request of its limits.
    pub fn admit(&self, headers: &HeaderMap) -> Result<Admitted, Refused> {
        let key = self.verify(headers)?;
        self.counted(key.take(Instant::now()))
    }

    fn counted<T>(&self, r: Result<T, Refused>) -> Result<T, Refused> {
        if let Err(e) = &r {
            let i = match e {
                Refused::Missing => 0,
                Refused::Invalid => 1,
                Refused::Rate { .. } => 2,
                Refused::Concurrency { .. } => 3,
            };
            self.refused[i].fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// (reason, count) of refused requests, for the metrics.
    pub fn refused_counts(&self) -> Vec<(String, u64)> {
        let labels =
            [Refused::Missing, Refused::Invalid, Refused::Rate { retry_after_s: 0 }, Refused::Concurrency { limit: 0 }];
        labels.iter().zip(&self.refused).map(|(l, n)| (l.label().to_string(), n.load(Ordering::Relaxed))).collect()
    }
}

impl Key {
    fn new(name: String, limits: Limits) -> Key {
        Key { name, limits, in_flight: AtomicU32::new(0), bucket: Mutex::new((limits.rpm as f64, Instant::now())) }
    }

    /// One request under this key's caps, at `now`.
    fn take(self: Arc<Self>, now: Instant) -> Result<Admitted, Refused> {
        let cap = self.limits.concurrency;
        let n = self.in_flight.fetch_add(1, Ordering::Relaxed);
        let admitted = Admitted(self.clone());
        if cap > 0 && n >= cap {
            return Err(Refused::Concurrency { limit: cap });
        }
        if self.limits.rpm > 0 {
            let rpm = self.limits.rpm as f64;
            let mut b = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
            b.0 = (b.0 + now.saturating_duration_since(b.1).as_secs_f64() * rpm / 60.0).min(rpm);
            b.1 = now;
            if b.0 < 1.0 {
                let retry_after_s = ((1.0 - b.0) * 60.0 / rpm).ceil().max(1.0) as u64;
                return Err(Refused::Rate { retry_after_s });
            }
            b.0 -= 1.0;
        }
        Ok(admitted)
    }
}

fn read(file: &Path) -> Result<String, String> {
    std::fs::read_to_string(file).map_err(|e| format!("cannot read --api-keys-file {}: {e}", file.display()))
}

/// The table of `text`; keys already in `old` keep their state if their
/// limits are unchanged.
fn parse(text: &str, defaults: Limits, old: &HashMap<Hash, Arc<Key>>) -> Result<HashMap<Hash, Arc<Key>>, String> {
    let mut table = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| format!("API keys file, line {}: {why}", i + 1);
        let mut words = line.split_whitespace();
        let key = words.next().expect("line is not empty");
        let hash = match key.strip_prefix("sha256:") {
            Some(hex) => from_hex(hex).ok_or_else(|| bad("sha256: must be followed by 64 hex digits"))?,
            None => Sha256::digest(key.as_bytes()).into(),
        };
        let mut name = format!("sha256:{}", to_hex(&hash[..4]));
        let mut limits = defaults;
        for w in words {
            let (k, v) = w.split_once('=').ok_or_else(|| bad(&format!("{w:?} is not NAME=VALUE")))?;
            let num = || v.parse::<u32>().map_err(|_| bad(&format!("{k} takes a whole number, got {v:?}")));
            match k {
                "name" => name = v.to_string(),
                "concurrency" => limits.concurrency = num()?,
                "rpm" => limits.rpm = num()?,
                _ => return Err(bad(&format!("unknown setting {k:?} (name, concurrency, rpm)"))),
            }
        }
        let key = match old.get(&hash) {
            Some(k) if k.limits == limits && k.name == name => k.clone(),
            _ => Arc::new(Key::new(name, limits)),
        };
        if table.insert(hash, key).is_some() {
            return Err(bad("the same key appears twice"));
        }
    }
    Ok(table)
}

fn from_hex(s: &str) -> Option<Hash> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(key: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, format!("Bearer {key}").parse().unwrap());
        h
    }

    fn keys(text: &str, defaults: Limits) -> (Keys, tempfile_path::Tmp) {
        let t = tempfile_path::Tmp::new(text);
        (Keys::load(&t.0, defaults).unwrap(), t)
    }

    mod tempfile_path {
        pub struct Tmp(pub std::path::PathBuf);
        impl Tmp {
            pub fn new(text: &str) -> Tmp {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "pdmesh-keys-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::write(&p, text).unwrap();
                Tmp(p)
            }
        }
        impl Drop for Tmp {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    const NONE: Limits = Limits { concurrency: 0, rpm: 0 };

    #[test]
    fn plain_and_hashed_keys_verify_and_others_do_not() {
        let digest = to_hex(&Sha256::digest(b"k2"));
        let (k, _t) = keys(&format!("# team A\nk1 name=alice\nsha256:{digest}  # bob\n"), NONE);
        assert_eq!(k.count(), 2);
        assert_eq!(k.admit(&bearer("k1")).unwrap().name(), "alice");
        assert!(k.admit(&bearer("k2")).unwrap().name().starts_with("sha256:"));
        assert_eq!(k.admit(&bearer("k3")).err(), Some(Refused::Invalid));
        assert_eq!(k.admit(&HeaderMap::new()).err(), Some(Refused::Missing));
        let mut basic = HeaderMap::new();
        basic.insert(header::AUTHORIZATION, "Basic azE6".parse().unwrap());
        assert_eq!(k.admit(&basic).err(), Some(Refused::Missing));
    }

    #[test]
    fn bad_lines_are_named_without_the_key() {
        for (text, want) in [
            ("secret-key rpm=x\n", "line 1: rpm takes a whole number"),
            ("a\nsha256:zz\n", "line 2: sha256: must be followed by 64 hex digits"),
            ("secret-key colour=red\n", "unknown setting \"colour\""),
            ("k\nk\n", "line 2: the same key appears twice"),
        ] {
            let t = tempfile_path::Tmp::new(text);
            let e = Keys::load(&t.0, NONE).err().unwrap();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains("secret-key"), "{e}");
        }
    }

    #[test]
    fn concurrency_cap_holds_until_a_request_ends() {
        let (k, _t) = keys("k concurrency=2\n", NONE);
        let a = k.admit(&bearer("k")).unwrap();
        let _b = k.admit(&bearer("k")).unwrap();
        assert_eq!(k.admit(&bearer("k")).err(), Some(Refused::Concurrency { limit: 2 }));
        drop(a);
        assert!(k.admit(&bearer("k")).is_ok());
        assert_eq!(k.refused_counts()[3], ("concurrency".to_string(), 1));
    }

    #[test]
    fn the_minute_budget_refills_and_says_when() {
        let (k, _t) = keys("k\n", Limits { concurrency: 0, rpm: 2 });
        let key = k.verify(&bearer("k")).unwrap();
        let t0 = Instant::now();
        assert!(key.clone().take(t0).is_ok());
        assert!(key.clone().take(t0).is_ok());
        assert_eq!(key.clone().take(t0).err(), Some(Refused::Rate { retry_after_s: 30 }));
        assert!(key.clone().take(t0 + Duration::from_secs(31)).is_ok());
    }

    #[test]
    fn reload_revokes_and_keeps_the_use_of_keys_that_stay() {
        let t = tempfile_path::Tmp::new("k1 concurrency=1\nk2\n");
        let k = Keys::load(&t.0, NONE).unwrap();
        let held = k.admit(&bearer("k1")).unwrap();
        std::fs::write(&t.0, "k1 concurrency=1\n").unwrap();
        assert_eq!(k.reload(), Ok(true));
        assert_eq!(k.admit(&bearer("k2")).err(), Some(Refused::Invalid), "revoked");
        assert_eq!(k.admit(&bearer("k1")).err(), Some(Refused::Concurrency { limit: 1 }), "still in flight");
        drop(held);
        std::fs::write(&t.0, "k1 rpm=nope\n").unwrap();
        assert!(k.reload().is_err());
        assert!(k.admit(&bearer("k1")).is_ok(), "a bad file leaves the last good table");
        assert_eq!(k.reload(), Ok(false), "the same bad file is reported once");
        assert_eq!(k.reload_errors.load(Ordering::Relaxed), 1);
    }
}
