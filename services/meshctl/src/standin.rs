//! The gateway's stand-in. meshctl holds the gateway's listening socket
//! and hands it to each gateway process, so a client that connects while
//! none runs waits in the socket's queue for the next one. That is right
//! for a restart moments away, and wrong when none is coming (it exited
//! with `--no-restart`, its crash loop was given up, or its restart is
//! seconds off): the kernel accepts the connection, nobody ever reads it,
//! and the client waits for its own timeout with no error — a request no
//! deadline of the mesh can end, because no process of the mesh saw it.
//! Meanwhile meshctl answers those clients itself: 503, `Retry-After`, at
//! once.

use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A gateway due within this long is waited for (clients queue for it);
/// otherwise the stand-in answers.
pub const DUE_WITHIN: Duration = Duration::from_secs(1);

/// What a client is told while no gateway runs.
const MESSAGE: &str = "no gateway process is running on this mesh now; retry later";
/// Its error code.
pub const CODE: &str = "gateway_down";
/// Seconds a client is asked to wait before trying again.
const RETRY_AFTER_S: u32 = 5;

/// Answering on the gateway's socket until dropped.
pub struct StandIn(JoinHandle<()>);

impl StandIn {
    /// Accept on a copy of `socket` (the socket itself stays open for the
    /// next gateway process; connections not yet accepted wait for it).
    pub fn start(socket: &std::net::TcpListener) -> std::io::Result<StandIn> {
        let copy = socket.try_clone()?;
        copy.set_nonblocking(true)?;
        let listener = TcpListener::from_std(copy)?;
        let response = pdmesh_core::refusal::unavailable(MESSAGE, CODE, RETRY_AFTER_S);
        Ok(StandIn(tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((tcp, _)) => {
                        let response = response.clone();
                        tokio::spawn(async move { pdmesh_core::refusal::answer_and_close(tcp, &response).await });
                    }
                    // Out of descriptors and the like: wait a moment rather than spin.
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        })))
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.0.abort();
    }
}
