//! Test-only fault injection: named numeric switches a test sets at run
//! time over the admin endpoint (`PUT /faults/<name>/<value>`), read by the
//! code paths they slow or break. Off unless the process was started with
//! `--enable-fault-injection`; then every set is logged to stderr.
//!
//! Switches read today: `prefill.transfer_delay_ms` (the prefill waits this
//! long after claiming a ticket before writing the KV: a stalled transfer),
//! `prefill.queue_hold_ms` (each prompt stays queued at least this long) and
//! `gateway.slow_client_ms` (each SSE chunk is handed to the client this
//! much later: a slow reader) and `prefill.kv_corrupt` (the next N KV
//! transfers each get one byte flipped after their checksums were taken:
//! corruption in flight, over either transport; see [`take`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

static ENABLED: AtomicBool = AtomicBool::new(false);
static SWITCHES: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);

pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Set a switch; refused when injection is off.
pub fn set(name: &str, value: u64) -> Result<(), &'static str> {
    if !enabled() {
        return Err("fault injection is off (start with --enable-fault-injection)");
    }
    eprintln!("fault injection: {name} = {value}");
    SWITCHES.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).insert(name.into(), value);
    Ok(())
}

/// A switch's value (0 when unset or injection is off).
pub fn get(name: &str) -> u64 {
    if !enabled() {
        return 0;
    }
    SWITCHES.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|m| m.get(name).copied()).unwrap_or(0)
}

/// Use up one count of a switch: true (and the switch one lower) when it
/// was above 0. For faults that hit the next N events.
pub fn take(name: &str) -> bool {
    if !enabled() {
        return false;
    }
    let mut g = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    match g.as_mut().and_then(|m| m.get_mut(name)) {
        Some(n) if *n > 0 => {
            *n -= 1;
            true
        }
        _ => false,
    }
}
