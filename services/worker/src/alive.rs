//! Whether a worker's engine loop still runs (it takes the worker out of
//! service when it stops), whether it still makes progress (a loop that is
//! stuck, or a process frozen mid-step, serves nobody however healthy its
//! other threads look), and the test-only faults that stop or stall it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often an idle loop wakes to say it is alive (it beats on each turn).
pub const IDLE_BEAT: Duration = Duration::from_millis(200);

/// Whether a worker's engine loop (its own thread) still runs, and how long
/// it has gone without progress. The loop holds the [`AliveGuard`]; when
/// the thread ends — a panic, or any exit while the worker serves — the
/// flag drops.
#[derive(Clone)]
pub struct LoopAlive {
    alive: Arc<AtomicBool>,
    progress: Arc<Progress>,
}

/// Held by the engine loop's thread for as long as it runs.
pub struct AliveGuard {
    alive: Arc<AtomicBool>,
    progress: Arc<Progress>,
}

/// The loop's progress: its turns (each one beats; an idle loop turns every
/// [`IDLE_BEAT`]) and the kernel pool's loops (many per step), so a long
/// step that computes is not mistaken for a stuck one.
struct Progress {
    beats: AtomicU64,
    pool: Option<pdmesh_engine::PoolShare>,
    /// The count last seen, and when it was first seen at that value.
    seen: Mutex<(u64, Instant)>,
}

impl Progress {
    fn count(&self) -> u64 {
        self.beats.load(Ordering::Relaxed) + self.pool.as_ref().map_or(0, |p| p.loops())
    }
}

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Relaxed);
    }
}

impl AliveGuard {
    /// One turn of the loop.
    pub fn beat(&self) {
        self.progress.beats.fetch_add(1, Ordering::Relaxed);
    }
}

impl LoopAlive {
    /// A running loop's flag and the guard its thread keeps. `pool`: the
    /// engine's kernel pool, whose loops count as progress within a step.
    pub fn start(pool: Option<pdmesh_engine::PoolShare>) -> (LoopAlive, AliveGuard) {
        let alive = Arc::new(AtomicBool::new(true));
        let progress =
            Arc::new(Progress { beats: AtomicU64::new(0), pool, seen: Mutex::new((u64::MAX, Instant::now())) });
        (LoopAlive { alive: alive.clone(), progress: progress.clone() }, AliveGuard { alive, progress })
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Relaxed)
    }

    /// How long the loop has gone without progress, as far as the callers
    /// of this (the Load RPC, the health gate: several times a second) have
    /// seen: zero when it moved since the last look.
    pub fn stalled(&self) -> Duration {
        let now = self.progress.count();
        let mut g = self.progress.seen.lock().unwrap_or_else(|e| e.into_inner());
        if g.0 != now {
            *g = (now, Instant::now());
        }
        g.1.elapsed()
    }

    /// Resolves once the loop has stopped (checked every 100 ms).
    pub async fn stopped(&self) {
        while self.is_alive() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Test-only fault (`--enable-fault-injection`): the engine loop panics at
/// its next turn, as a bug in a kernel would make it.
pub fn loop_panic_fault() {
    if pdmesh_core::faults::get("engine.loop_panic") > 0 {
        panic!("fault injected: engine.loop_panic");
    }
}

/// Test-only fault (`--enable-fault-injection`): `engine.loop_stall_ms`
/// stops the engine loop that long at its next turn, once, while the
/// worker's other threads answer as usual (a stuck page fault, a hung
/// driver call).
pub fn loop_stall_fault() {
    let ms = pdmesh_core::faults::get("engine.loop_stall_ms");
    if ms > 0 && pdmesh_core::faults::set("engine.loop_stall_ms", 0).is_ok() {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_that_beats_is_not_stalled_and_one_that_stops_is() {
        let (alive, guard) = LoopAlive::start(None);
        assert!(alive.stalled() < Duration::from_millis(50));
        std::thread::sleep(Duration::from_millis(120));
        guard.beat();
        assert!(alive.stalled() < Duration::from_millis(50), "it moved since the last look");
        std::thread::sleep(Duration::from_millis(120));
        assert!(alive.stalled() >= Duration::from_millis(100), "no beat since");
        drop(guard);
        assert!(!alive.is_alive());
    }
}
