//! The autoscaling policy: targets, bounds per kind, how long a signal must
//! hold before a change, cooldowns, and the host's room. Read from TOML;
//! anything out of range is refused at start with the field's name.

use serde::Deserialize;

use crate::Kind;

/// Targets the planner holds the mesh to (p90s over the sampling window).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Targets {
    /// Time to first token, p90, seconds.
    pub ttft_p90_s: f64,
    /// Time between tokens of a stream, p90, seconds.
    pub inter_token_p90_s: f64,
    /// Wait in a prefill queue before compute, p90, seconds.
    pub queue_wait_p90_s: f64,
    /// Share of the decode workers' KV blocks in use above which decode
    /// scales up (0-1).
    pub kv_use_high: f64,
    /// Requests in flight per router above which routers scale up.
    pub router_in_flight: f64,
}

impl Default for Targets {
    fn default() -> Targets {
        Targets {
            ttft_p90_s: 1.0,
            inter_token_p90_s: 0.1,
            queue_wait_p90_s: 0.5,
            kv_use_high: 0.85,
            router_in_flight: 256.0,
        }
    }
}

/// One kind's replica bounds and what a replica costs its host.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Bounds {
    pub min: usize,
    pub max: usize,
    /// Cores one replica needs (for the host's room; 0 = it needs none to speak of).
    pub cores: usize,
}

impl Default for Bounds {
    fn default() -> Bounds {
        Bounds { min: 1, max: 1, cores: 1 }
    }
}

/// Hysteresis: how long a signal must hold, and how long after a change
/// the planner waits before the next.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Timing {
    /// How often signals are sampled, seconds.
    pub interval_s: f64,
    /// The p90s and rates are over this many seconds of the past.
    pub window_s: f64,
    /// A target missed this long brings a scale-up.
    pub up_after_s: f64,
    /// Load low enough for one replica fewer this long brings a scale-down.
    pub down_after_s: f64,
    /// After a scale-up of a kind, no other scale-up of it for this long.
    pub up_cooldown_s: f64,
    /// After any change of a kind, no scale-down of it for this long.
    pub down_cooldown_s: f64,
}

impl Default for Timing {
    fn default() -> Timing {
        Timing {
            interval_s: 2.0,
            window_s: 10.0,
            up_after_s: 4.0,
            down_after_s: 60.0,
            up_cooldown_s: 10.0,
            down_cooldown_s: 60.0,
        }
    }
}

/// The host the replicas share (one machine; on Kubernetes the cluster
/// has the room and `cores` stays 0).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Host {
    /// Cores for prefill, decode and router replicas in all; 0 = no limit.
    pub cores: usize,
}

/// The whole policy. Kinds not named are not scaled.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    pub targets: Targets,
    pub timing: Timing,
    pub host: Host,
    pub prefill: Option<Bounds>,
    pub decode: Option<Bounds>,
    pub router: Option<Bounds>,
}

impl Policy {
    /// Parse and check a policy; the error names the field.
    pub fn parse(text: &str) -> Result<Policy, String> {
        let p: Policy = toml::from_str(text).map_err(|e| format!("policy: {}", e.to_string().trim_end()))?;
        p.check()?;
        Ok(p)
    }

    /// Read and parse the policy at `path`.
    pub fn load(path: &std::path::Path) -> Result<Policy, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("policy {}: {e}", path.display()))?;
        Policy::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The bounds of `kind`, if the policy scales it.
    pub fn bounds(&self, kind: Kind) -> Option<&Bounds> {
        match kind {
            Kind::Prefill => self.prefill.as_ref(),
            Kind::Decode => self.decode.as_ref(),
            Kind::Router => self.router.as_ref(),
        }
    }

    fn check(&self) -> Result<(), String> {
        let t = &self.targets;
        for (name, v) in [
            ("targets.ttft_p90_s", t.ttft_p90_s),
            ("targets.inter_token_p90_s", t.inter_token_p90_s),
            ("targets.queue_wait_p90_s", t.queue_wait_p90_s),
            ("targets.router_in_flight", t.router_in_flight),
            ("timing.interval_s", self.timing.interval_s),
            ("timing.window_s", self.timing.window_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("policy: {name} must be a positive number, not {v}"));
            }
        }
        if !(t.kv_use_high > 0.0 && t.kv_use_high <= 1.0) {
            return Err(format!("policy: targets.kv_use_high must be in (0, 1], not {}", t.kv_use_high));
        }
        let w = &self.timing;
        for (name, v) in [
            ("timing.up_after_s", w.up_after_s),
            ("timing.down_after_s", w.down_after_s),
            ("timing.up_cooldown_s", w.up_cooldown_s),
            ("timing.down_cooldown_s", w.down_cooldown_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("policy: {name} must be 0 or more seconds, not {v}"));
            }
        }
        for kind in Kind::ALL {
            let Some(b) = self.bounds(kind) else { continue };
            if b.min > b.max {
                return Err(format!("policy: {kind}.min ({}) is above {kind}.max ({})", b.min, b.max));
            }
            if b.max == 0 || b.max > crate::MAX_REPLICAS {
                return Err(format!("policy: {kind}.max must be 1 to {}, not {}", crate::MAX_REPLICAS, b.max));
            }
            if self.host.cores > 0 && b.min * b.cores > self.host.cores {
                return Err(format!(
                    "policy: {kind}.min ({}) replicas of {} cores do not fit host.cores ({})",
                    b.min, b.cores, self.host.cores
                ));
            }
        }
        if Kind::ALL.iter().all(|k| self.bounds(*k).is_none()) {
            return Err("policy: it names no kind to scale (give [prefill], [decode] or [router])".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_reads_with_defaults_for_what_it_leaves_out() {
        let p = Policy::parse("[targets]\nttft_p90_s = 2.0\n[prefill]\nmin = 1\nmax = 3\n").unwrap();
        assert_eq!(p.targets.ttft_p90_s, 2.0);
        assert_eq!(p.targets.queue_wait_p90_s, 0.5);
        assert_eq!(p.bounds(Kind::Prefill), Some(&Bounds { min: 1, max: 3, cores: 1 }));
        assert!(p.bounds(Kind::Decode).is_none());
    }

    #[test]
    fn the_shipped_example_policy_is_the_defaults_with_bounds_1_to_2() {
        let p = Policy::parse(include_str!("../../../infra/autoscale.toml")).unwrap();
        let two = Bounds { min: 1, max: 2, cores: 1 };
        let want = Policy { prefill: Some(two.clone()), decode: Some(two), ..Policy::default() };
        assert_eq!(p, want);
    }

    #[test]
    fn bad_policies_are_refused_naming_the_field() {
        let cases = [
            ("[prefill]\nmin = 3\nmax = 2\n", "prefill.min (3) is above prefill.max (2)"),
            ("[encoder]\nmin = 1\n", "unknown field `encoder`"),
            ("[targets]\nttft_p90_s = -1.0\n[decode]\nmax = 2\n", "targets.ttft_p90_s must be a positive number"),
            ("[decode]\nmax = 2\nmx = 3\n", "unknown field `mx`"),
            ("[timing]\ndown_after_s = -5.0\n[decode]\nmax = 2\n", "timing.down_after_s"),
            ("[host]\ncores = 2\n[decode]\nmin = 3\nmax = 4\n", "do not fit host.cores (2)"),
            ("[targets]\nkv_use_high = 1.5\n[decode]\nmax = 2\n", "targets.kv_use_high"),
            ("", "names no kind"),
            ("[prefill]\nmax = \"two\"\n", "max"),
        ];
        for (text, want) in cases {
            let e = Policy::parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let e = Policy::load(std::path::Path::new("/nonexistent/policy.toml")).unwrap_err();
        assert!(e.contains("/nonexistent/policy.toml"), "{e}");
    }
}
