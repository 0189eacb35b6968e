//! A small fork-join thread pool tuned for many short parallel loops.
//!
//! A decode step at batch 1 launches a few hundred parallel loops that each
//! last tens of microseconds, so waking sleeping threads through the OS on
//! every loop (what a general work-stealing pool does) would cost more than
//! the work. Workers here spin briefly on an epoch counter after each loop
//! and only then park on a condition variable, so back-to-back loops within
//! one forward pass never sleep, and an idle process does not burn CPU.
//!
//! Replicas that share a host divide its cores: [`PoolShare::set`] lowers
//! (or raises, up to the threads started) how many threads a loop runs
//! on. The threads left out park until the share grows again: they
//! neither spin nor wake for loops, so another process gets their cores.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// How many spin iterations a worker waits for the next loop before parking
/// (about 3 ms; `PDMESH_POOL_SPIN_ITERS` overrides it — lower it when
/// several engine processes share few cores, so idle spinning does not take
/// time from the others).
const SPIN_ITERS: u32 = 1 << 16;

fn spin_iters() -> u32 {
    static V: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("PDMESH_POOL_SPIN_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(SPIN_ITERS))
}

type Job<'a> = &'a (dyn Fn(usize) + Sync);

/// A step whose threads waited this share of their runnable time for a
/// CPU marks the host crowded ...
pub const CROWDED_SHARE: f64 = 0.2;
/// ... for this long.
pub const CROWDED_FOR: std::time::Duration = std::time::Duration::from_secs(5);

/// [`CROWDED_SHARE`], or `PDMESH_POOL_CROWDED_SHARE` (above 1: never crowded).
fn crowded_share() -> f64 {
    static V: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("PDMESH_POOL_CROWDED_SHARE").ok().and_then(|v| v.parse().ok()).unwrap_or(CROWDED_SHARE)
    })
}

/// Low bits of the epoch word that hold a loop's thread count.
const PARTICIPANT_BITS: u32 = 8;
const PARTICIPANT_MASK: u64 = (1 << PARTICIPANT_BITS) - 1;

struct Shared {
    /// The current job, valid until the loop's `busy` count drops to zero.
    job: Mutex<Option<Job<'static>>>,
    /// The loop count in the high bits, and the threads the current loop
    /// runs on in the low [`PARTICIPANT_BITS`]: one word, so a worker reads
    /// a loop and whether it is in it together (it never joins a loop that
    /// began before it looked, and ended without it).
    epoch: AtomicU64,
    next: AtomicUsize,
    n_tasks: AtomicUsize,
    /// Workers that have not yet finished the current epoch.
    busy: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    /// Workers parked (or about to park) on `wake`: `run` signals the
    /// condition variable, a system call, only when this is not zero.
    sleepers: AtomicUsize,
    /// Each worker's kernel thread id, once it has started (Linux only).
    os_ids: Mutex<Vec<u32>>,
    /// Threads a loop may run on now, the caller included (1..=threads).
    active: AtomicUsize,
    /// Workers left out of the share wait here for it to grow.
    resize: Condvar,
    /// Until when (ns after `born`) the host is crowded: workers park right
    /// after a loop instead of spinning, and the caller yields while it
    /// waits for them.
    crowded_until: AtomicU64,
    born: std::time::Instant,
    /// Loops begun, however many threads ran them: the engine's progress,
    /// which a worker's watchdog reads (see [`PoolShare::loops`]).
    loops: AtomicU64,
}

impl Shared {
    fn crowded(&self) -> bool {
        (self.born.elapsed().as_nanos() as u64) < self.crowded_until.load(Ordering::Relaxed)
    }
}

/// Fork-join pool: `run(n, f)` calls `f(0..n)` on the caller and the workers.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises callers: one parallel loop at a time per pool.
    run_lock: Mutex<()>,
}

impl Pool {
    /// A pool that runs loops on `threads` threads in all (the caller counts
    /// as one, so `threads - 1` workers are spawned). `threads == 0` means the
    /// machine's available parallelism.
    pub fn new(threads: usize) -> Pool {
        let threads =
            if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let threads = threads.min(PARTICIPANT_MASK as usize);
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            epoch: AtomicU64::new(0),
            next: AtomicUsize::new(0),
            n_tasks: AtomicUsize::new(0),
            busy: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            os_ids: Mutex::new(Vec::new()),
            active: AtomicUsize::new(threads),
            crowded_until: AtomicU64::new(0),
            born: std::time::Instant::now(),
            resize: Condvar::new(),
            loops: AtomicU64::new(0),
        });
        let workers = (1..threads)
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("pdmesh-kernel-{i}"))
                    .spawn(move || {
                        if let Some(id) = os_thread_id() {
                            shared.os_ids.lock().unwrap_or_else(|e| e.into_inner()).push(id);
                        }
                        worker_loop(&shared, i)
                    })
                    .expect("spawning a kernel worker thread")
            })
            .collect();
        Pool { shared, workers, run_lock: Mutex::new(()) }
    }

    /// Number of threads a loop runs on now (caller included): the share.
    pub fn threads(&self) -> usize {
        self.shared.active.load(Ordering::Relaxed).clamp(1, self.workers.len() + 1)
    }

    /// A handle that sets how many of the pool's threads a loop runs on,
    /// from any thread (an admin endpoint, while loops run).
    pub fn share(&self) -> PoolShare {
        PoolShare { shared: self.shared.clone(), started: self.workers.len() + 1 }
    }

    /// The kernel's ids of the worker threads that have started (not the
    /// caller's), for reading their scheduler statistics; empty off Linux.
    pub fn os_thread_ids(&self) -> Vec<u32> {
        self.shared.os_ids.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Calls `f(i)` for every `i in 0..n_tasks`, spread over the pool's
    /// threads, and returns when all calls have returned. A panic in any call
    /// is re-raised here after the loop has drained.
    pub fn run<F: Fn(usize) + Sync>(&self, n_tasks: usize, f: F) {
        if n_tasks == 0 {
            return;
        }
        self.shared.loops.fetch_add(1, Ordering::Relaxed);
        let participants = self.threads();
        if n_tasks == 1 || participants == 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let job: Job<'_> = &f;
        // SAFETY: the reference is only used until `busy` drops to zero,
        // which this function waits for before returning, so it never
        // outlives `f`.
        let job: Job<'static> = unsafe { std::mem::transmute::<Job<'_>, Job<'static>>(job) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(job);
        s.next.store(0, Ordering::Relaxed);
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.busy.store(participants - 1, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        // SeqCst pairs with the worker's `sleepers` increment and epoch
        // re-check: either it sees the new epoch, or this sees it asleep.
        // Only this caller (under `run_lock`) writes the word.
        let next = ((s.epoch.load(Ordering::Relaxed) >> PARTICIPANT_BITS) + 1) << PARTICIPANT_BITS;
        s.epoch.store(next | participants as u64, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) != 0 {
            let _l = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        // The share shrank since this loop counted its threads: the ones it
        // counted may be parked as left out.
        if s.active.load(Ordering::SeqCst) < participants {
            let _l = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.resize.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| drain(s, job)));
        // On a crowded host a worker may be off its CPU: give the CPU away
        // while waiting instead of spinning out the time slice.
        let crowded = s.crowded();
        let mut spins = 0u32;
        while s.busy.load(Ordering::Acquire) != 0 {
            spins += 1;
            if crowded && spins > 256 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a kernel task panicked on a worker thread");
        }
    }
}

/// The calling thread's id as the kernel knows it (`/proc/thread-self`
/// names `<pid>/task/<tid>`), or None where there is no procfs.
pub fn os_thread_id() -> Option<u32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

fn drain(s: &Shared, job: Job<'_>) {
    let n = s.n_tasks.load(Ordering::Relaxed);
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        job(i);
    }
}

/// Worker `index` (1-based; the caller is 0) runs the loops that include it.
fn worker_loop(s: &Shared, index: usize) {
    let mut seen = 0u64;
    while next_loop(s, index, &mut seen) {
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(job) = job {
            if catch_unwind(AssertUnwindSafe(|| drain(s, job))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.busy.fetch_sub(1, Ordering::Release);
    }
}

/// Wait for the next loop that includes worker `index` (true), or the
/// pool's end (false). In the share, spin first, then park on `wake`; left
/// out of it, park on `resize` at once (the caller of a loop begun before
/// the share shrank wakes it there).
fn next_loop(s: &Shared, index: usize, seen: &mut u64) -> bool {
    let spin = if s.crowded() { 0 } else { spin_iters() };
    let mut spins = 0u32;
    loop {
        if s.shutdown.load(Ordering::Acquire) {
            return false;
        }
        let word = s.epoch.load(Ordering::Acquire);
        if word != *seen {
            *seen = word;
            if (index as u64) < word & PARTICIPANT_MASK {
                return true;
            }
            continue;
        }
        let left_out = index >= s.active.load(Ordering::Acquire);
        if !left_out && spins < spin {
            spins += 1;
            std::hint::spin_loop();
            continue;
        }
        let guard = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
        if left_out {
            if s.epoch.load(Ordering::SeqCst) == *seen
                && index >= s.active.load(Ordering::SeqCst)
                && !s.shutdown.load(Ordering::Acquire)
            {
                drop(s.resize.wait(guard).unwrap_or_else(|e| e.into_inner()));
            }
            continue;
        }
        s.sleepers.fetch_add(1, Ordering::SeqCst);
        if s.epoch.load(Ordering::SeqCst) == *seen && !s.shutdown.load(Ordering::Acquire) {
            drop(s.wake.wait(guard).unwrap_or_else(|e| e.into_inner()));
        } else {
            drop(guard);
        }
        s.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _l = self.shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
            self.shared.resize.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Sets a pool's share of its host: how many of its threads a loop runs on.
#[derive(Clone)]
pub struct PoolShare {
    shared: Arc<Shared>,
    started: usize,
}

impl PoolShare {
    /// Run loops on `threads` threads (clamped to 1..=the threads the pool
    /// started with); the threads now.
    pub fn set(&self, threads: usize) -> usize {
        let n = threads.clamp(1, self.started);
        let _l = self.shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.active.store(n, Ordering::SeqCst);
        self.shared.resize.notify_all();
        n
    }

    /// The threads a loop runs on now, and the most it may.
    pub fn get(&self) -> (usize, usize) {
        (self.shared.active.load(Ordering::Relaxed), self.started)
    }

    /// The pool's threads waited for a CPU this share of their runnable
    /// time over the last step: from [`CROWDED_SHARE`] up, the host has
    /// more runnable threads than cores, and for [`CROWDED_FOR`] the pool
    /// stops spinning (its threads park after each loop; the caller yields
    /// while it waits), so it does not take the cores others wait for.
    pub fn note_cpu_wait(&self, share: f64) {
        if share >= crowded_share() {
            let until = self.shared.born.elapsed() + CROWDED_FOR;
            self.shared.crowded_until.store(until.as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// Whether the pool holds back from spinning now.
    pub fn crowded(&self) -> bool {
        self.shared.crowded()
    }

    /// Parallel loops begun so far: it moves many times per engine step,
    /// so a count that stands still means the step is stuck.
    pub fn loops(&self) -> u64 {
        self.shared.loops.load(Ordering::Relaxed)
    }
}

/// A raw pointer that parallel tasks may share to write disjoint parts of one
/// output buffer. Each user must guarantee that tasks touch disjoint indices.
#[derive(Clone, Copy)]
pub struct SyncPtr<T>(pub *mut T);
// SAFETY: a SyncPtr is only an address; its users write disjoint indices, as the type requires.
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: a SyncPtr is only an address; its users write disjoint indices, as the type requires.
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    pub fn new(s: &mut [T]) -> Self {
        SyncPtr(s.as_mut_ptr())
    }
    /// # Safety
    /// `off..off+len` must be in bounds and not aliased by another task.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, off: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(off), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_exactly_once() {
        let pool = Pool::new(3);
        for n in [1usize, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
        }
    }

    #[test]
    fn a_smaller_share_runs_loops_on_fewer_threads_and_grows_back() {
        let pool = Pool::new(4);
        let share = pool.share();
        let threads_seen = |pool: &Pool| {
            let ids = Mutex::new(std::collections::HashSet::new());
            for _ in 0..50 {
                pool.run(64, |_| {
                    ids.lock().unwrap().insert(std::thread::current().id());
                    std::thread::sleep(std::time::Duration::from_micros(50));
                });
            }
            ids.into_inner().unwrap().len()
        };
        assert_eq!(threads_seen(&pool), 4);
        assert_eq!(share.set(2), 2);
        assert_eq!(pool.threads(), 2);
        assert_eq!(threads_seen(&pool), 2);
        assert_eq!(share.set(1), 1);
        assert_eq!(threads_seen(&pool), 1);
        assert_eq!(share.set(9), 4, "never more than it started");
        assert_eq!(threads_seen(&pool), 4);
        // Changing the share while loops run loses no task.
        let count = AtomicUsize::new(0);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                for i in 0..200 {
                    share.set(1 + i % 4);
                }
            });
            for _ in 0..200 {
                pool.run(32, |_| {
                    count.fetch_add(1, Ordering::Relaxed);
                });
            }
        });
        assert_eq!(count.load(Ordering::Relaxed), 200 * 32);
    }

    #[test]
    fn a_step_that_waited_for_cpus_stops_the_spinning_and_loops_still_run() {
        let pool = Pool::new(3);
        let share = pool.share();
        share.note_cpu_wait(0.05);
        assert!(!share.crowded(), "5% wait is not crowding");
        share.note_cpu_wait(0.6);
        assert!(share.crowded());
        let count = AtomicUsize::new(0);
        for _ in 0..100 {
            pool.run(16, |_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(count.load(Ordering::Relaxed), 1600);
        share.note_cpu_wait(0.0);
        assert!(share.crowded(), "for CROWDED_FOR after the last crowded step");
    }

    #[test]
    fn panic_in_task_is_reraised_and_pool_survives() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(64, |i| {
                if i == 40 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(10, |_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 10);
    }
}
