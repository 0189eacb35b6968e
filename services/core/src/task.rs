//! A spawned task that lives as long as its handle: one home for the
//! pollers and side tasks every service keeps.

/// Aborts its task when dropped.
pub struct AbortOnDrop<T>(pub tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Spawn `f`; it is aborted when the returned handle drops.
pub fn spawn_owned<F>(f: F) -> AbortOnDrop<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    AbortOnDrop(tokio::spawn(f))
}
