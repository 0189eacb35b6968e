//! Process shutdown: resolves on Ctrl-C or SIGTERM (what `meshctl` and
//! orchestrators send to drain a service).

pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return ctrl_c.await.unwrap_or(()),
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}
