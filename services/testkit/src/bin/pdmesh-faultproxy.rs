//! A TCP proxy that breaks a link on command, for gray-failure drills
//! (`scripts/faults.sh`): the kernels here have no netem and no iptables,
//! so the network's failures are made in user space. Loopback only.
//!
//!   pdmesh-faultproxy LISTEN UPSTREAM CONTROL
//!
//! Forwards every connection to LISTEN on to UPSTREAM. One line on a
//! connection to CONTROL sets the mode for every connection, open or new,
//! and is answered `ok MODE`:
//!
//! - `pass`: forward as is;
//! - `delay MS`: hold each chunk MS milliseconds before forwarding it;
//! - `blackhole`: forward nothing and read nothing (the peers' sends fill
//!   the buffers and stall, as over a link that drops every packet); new
//!   connections are accepted and hang. `pass` heals it: what was buffered flows;
//! - `reset`: close every connection at once, and each new one on arrival
//!   (the peers see the connection end, as when a process's port closes).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Pass,
    Delay(u64),
    Blackhole,
    Reset,
}

fn parse(line: &str) -> Option<Mode> {
    let mut w = line.split_whitespace();
    match (w.next()?, w.next()) {
        ("pass", None) => Some(Mode::Pass),
        ("blackhole", None) => Some(Mode::Blackhole),
        ("reset", None) => Some(Mode::Reset),
        ("delay", Some(ms)) => ms.parse().ok().map(Mode::Delay),
        _ => None,
    }
}

fn loopback(a: &str) -> Result<SocketAddr, String> {
    let addr: SocketAddr = a.parse().map_err(|e| format!("{a}: {e}"))?;
    if !addr.ip().is_loopback() {
        return Err(format!("{a}: loopback addresses only"));
    }
    Ok(addr)
}

/// Wait until `mode` lets bytes through; false when the link is reset.
async fn open(mode: &mut watch::Receiver<Mode>) -> bool {
    loop {
        let m = *mode.borrow_and_update();
        match m {
            Mode::Reset => return false,
            Mode::Blackhole => {
                if mode.changed().await.is_err() {
                    return false;
                }
            }
            Mode::Pass | Mode::Delay(_) => return true,
        }
    }
}

/// Copy `from` to `to` under the mode, until either side closes or a reset.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        if !open(&mut mode).await {
            return;
        }
        let n = tokio::select! {
            r = from.read(&mut buf) => match r { Ok(0) | Err(_) => return, Ok(n) => n },
            // A change of mode while waiting for bytes: look again.
            _ = mode.changed() => continue,
        };
        let now = *mode.borrow();
        if let Mode::Delay(ms) = now {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if !open(&mut mode).await || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

async fn serve(client: TcpStream, upstream: SocketAddr, mut mode: watch::Receiver<Mode>) {
    if !open(&mut mode).await {
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = tokio::spawn(pump(cr, sw, mode.clone()));
    let down = tokio::spawn(pump(sr, cw, mode));
    let _ = tokio::join!(up, down);
}

async fn control(listener: TcpListener, tx: watch::Sender<Mode>) {
    while let Ok((s, _)) = listener.accept().await {
        let (r, mut w) = s.into_split();
        let mut line = String::new();
        if BufReader::new(r).read_line(&mut line).await.is_err() {
            continue;
        }
        let answer = match parse(&line) {
            Some(m) => {
                tx.send_replace(m);
                eprintln!("pdmesh-faultproxy: {m:?}");
                format!("ok {}\n", line.trim())
            }
            None => format!("error: unknown mode {:?} (pass, delay MS, blackhole, reset)\n", line.trim()),
        };
        let _ = w.write_all(answer.as_bytes()).await;
    }
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [listen, upstream, ctl] = args.as_slice() else {
        return Err("usage: pdmesh-faultproxy LISTEN UPSTREAM CONTROL (loopback addresses)".into());
    };
    let (listen, upstream, ctl) = (loopback(listen)?, loopback(upstream)?, loopback(ctl)?);
    let listener = TcpListener::bind(listen).await.map_err(|e| format!("{listen}: {e}"))?;
    let ctl = TcpListener::bind(ctl).await.map_err(|e| format!("{ctl}: {e}"))?;
    let (tx, rx) = watch::channel(Mode::Pass);
    tokio::spawn(control(ctl, tx));
    loop {
        let (client, _) = listener.accept().await.map_err(|e| e.to_string())?;
        tokio::spawn(serve(client, upstream, rx.clone()));
    }
}
