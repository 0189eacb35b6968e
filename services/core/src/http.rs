//! A minimal blocking HTTP/1.1 client for admin endpoints (/health,
//! /metrics, /statusz) and meshctl's control endpoint — what `meshctl` and
//! tests need, without an HTTP client dependency.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// `GET http://addr/path`: (status code, body). Bounded by `timeout` for
/// connect, write and each read.
pub fn get(addr: &str, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    request("GET", addr, path, "", timeout)
}

/// `GET http://addr/path` asking for OpenMetrics (what Prometheus asks for:
/// histograms then carry trace-id exemplars).
pub fn get_openmetrics(addr: &str, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    request("GET", addr, path, "Accept: application/openmetrics-text; version=1.0.0\r\n", timeout)
}

/// `PUT http://addr/path` with an empty body: (status code, body).
pub fn put(addr: &str, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    request("PUT", addr, path, "", timeout)
}

/// `POST http://addr/path` with a JSON body: (status code, body).
pub fn post_json(addr: &str, path: &str, body: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    send("POST", addr, path, "Content-Type: application/json\r\n", body, timeout)
}

fn request(method: &str, addr: &str, path: &str, headers: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    send(method, addr, path, headers, "", timeout)
}

fn send(
    method: &str,
    addr: &str,
    path: &str,
    headers: &str,
    body: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let sa = addr.to_socket_addrs()?.next().ok_or_else(|| std::io::Error::other(format!("cannot resolve {addr}")))?;
    let mut s = TcpStream::connect_timeout(&sa, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let n = body.len();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Content-Length: {n}\r\nConnection: close\r\n\r\n{body}"
    )?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp)?;
    let resp = String::from_utf8_lossy(&resp);
    let code = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((code, body))
}

/// The value of an unlabelled sample (or the first sample whose name and
/// labels start with `name`) in Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (k, v) = l.rsplit_once(' ')?;
        (k == name).then(|| v.parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn metric_finds_exact_samples() {
        let t = "# HELP a x\na 3\na_total 4\nb{outcome=\"ok\"} 5\n";
        assert_eq!(super::metric(t, "a"), Some(3.0));
        assert_eq!(super::metric(t, "b{outcome=\"ok\"}"), Some(5.0));
        assert_eq!(super::metric(t, "c"), None);
    }
}
