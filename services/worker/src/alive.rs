//! Whether a worker's engine loop still runs (it takes the worker out of
//! service when it stops), and the test-only fault that stops it.

use std::time::Duration;

/// Whether a worker's engine loop (its own thread) still runs. The loop
/// holds the [`AliveGuard`]; when the thread ends — a panic, or any exit
/// while the worker serves — the flag drops.
#[derive(Clone)]
pub struct LoopAlive(std::sync::Arc<std::sync::atomic::AtomicBool>);

/// Held by the engine loop's thread for as long as it runs.
pub struct AliveGuard(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

impl LoopAlive {
    /// A running loop's flag and the guard its thread keeps.
    pub fn start() -> (LoopAlive, AliveGuard) {
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        (LoopAlive(flag.clone()), AliveGuard(flag))
    }

    pub fn is_alive(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
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
