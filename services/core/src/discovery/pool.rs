//! Model pools: a mesh serving several models runs one set of tokenizer,
//! kvbroker, prefill, decode and router instances per model, and one
//! gateway in front of them all. Each set is a pool named after its model;
//! in the registry a pool's kinds are `KIND@POOL` (`decode@gemma3-270m`),
//! so a router only ever sees its own model's workers, and prefix hashes
//! never meet another model's. A mesh of one model has no pool: its kinds
//! are plain (`decode`).

use std::sync::Arc;

use super::{check_name, BoxFuture, Discovery, DiscoveryError, Instance, Listing, Registration};

/// Meta key of a pooled instance's model pool.
pub const META_MODEL: &str = "model";

/// The registry name of `kind` in `pool` (plain `kind` without a pool).
pub fn pooled_kind(kind: &str, pool: Option<&str>) -> String {
    match pool {
        Some(p) => format!("{kind}@{p}"),
        None => kind.to_string(),
    }
}

/// `decode@gemma3-270m` split into `decode` and its pool.
pub fn split_kind(s: &str) -> (&str, Option<&str>) {
    match s.split_once('@') {
        Some((k, p)) => (k, Some(p)),
        None => (s, None),
    }
}

/// A pool name: letters, digits, '-', '_' and '.'.
pub fn check_pool(pool: &str) -> Result<(), String> {
    match check_name(pool) {
        Ok(()) if !pool.contains('@') => Ok(()),
        _ => Err(format!("invalid model pool name {pool:?}: use letters, digits, '-', '_' and '.'")),
    }
}

/// `d` as one pool sees it: what it registers and lists is that pool's.
pub fn pooled(d: Arc<dyn Discovery>, pool: &str) -> Arc<dyn Discovery> {
    Arc::new(Pooled { inner: d, pool: pool.to_string() })
}

struct Pooled {
    inner: Arc<dyn Discovery>,
    pool: String,
}

impl Discovery for Pooled {
    fn register(&self, mut instance: Instance) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        instance.service = pooled_kind(&instance.service, Some(&self.pool));
        instance.meta.insert(META_MODEL.to_string(), self.pool.clone());
        self.inner.register(instance)
    }

    fn changes(&self, service: &str, index: u64) -> BoxFuture<'_, Result<Listing, DiscoveryError>> {
        let service = service.to_string();
        Box::pin(async move {
            let mut l = self.inner.changes(&pooled_kind(&service, Some(&self.pool)), index).await?;
            for i in &mut l.instances {
                i.service = service.clone();
            }
            Ok(l)
        })
    }

    fn describe(&self) -> String {
        format!("{} (model pool {})", self.inner.describe(), self.pool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::FileRegistry;

    #[tokio::test]
    async fn pools_see_only_their_own_instances() {
        let dir = std::env::temp_dir().join(format!("pdmesh-pool-test-{}", std::process::id()));
        let raw: Arc<dyn Discovery> = Arc::new(FileRegistry::new(&dir, std::time::Duration::from_secs(10)));
        let (a, b) = (pooled(raw.clone(), "a"), pooled(raw.clone(), "b"));
        let inst = |id: &str| Instance {
            service: "decode".into(),
            id: id.into(),
            grpc_addr: "127.0.0.1:1".into(),
            http_addr: None,
            meta: Default::default(),
        };
        let _ra = a.register(inst("decode@a-0")).await.unwrap();
        let _rb = b.register(inst("decode@b-0")).await.unwrap();
        let seen = a.healthy("decode").await.unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!((seen[0].id.as_str(), seen[0].service.as_str()), ("decode@a-0", "decode"));
        assert_eq!(seen[0].meta.get(META_MODEL).map(String::as_str), Some("a"));
        assert!(raw.healthy("decode").await.unwrap().is_empty(), "a pooled instance is not a plain one");
        assert_eq!(raw.healthy("decode@b").await.unwrap()[0].id, "decode@b-0");
        assert_eq!(split_kind("decode@b"), ("decode", Some("b")));
        assert!(check_pool("gemma3-270m").is_ok() && check_pool("a@b").is_err() && check_pool("a/b").is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
