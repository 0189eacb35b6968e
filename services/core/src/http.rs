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
    Ok(parse_response(&resp))
}

/// (status code, body) of a whole HTTP/1.1 response; a chunked body (Go
/// servers such as Jaeger and Prometheus send long answers so) is joined.
fn parse_response(resp: &[u8]) -> (u16, String) {
    let split = resp.windows(4).position(|w| w == b"\r\n\r\n");
    let (head, body) = match split {
        Some(i) => (String::from_utf8_lossy(&resp[..i]), &resp[i + 4..]),
        None => (String::from_utf8_lossy(resp), &resp[resp.len()..]),
    };
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let chunked = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked")
        })
    });
    let body = if chunked { dechunk(body) } else { body.to_vec() };
    (code, String::from_utf8_lossy(&body).into_owned())
}

/// The data of a chunked body: `<hex size>\r\n<data>\r\n` ... `0\r\n\r\n`.
fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&rest[..eol]);
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        let data = &rest[eol + 2..];
        if n == 0 || data.len() < n {
            break;
        }
        out.extend_from_slice(&data[..n]);
        rest = data[n..].strip_prefix(b"\r\n").unwrap_or(&data[n..]);
    }
    out
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

    #[test]
    fn chunked_bodies_are_joined_and_plain_ones_kept() {
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n3\r\n1}\n\r\n0\r\n\r\n";
        assert_eq!(super::parse_response(chunked), (200, "{\"a\":1}\n".to_string()));
        let plain = b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nno\n";
        assert_eq!(super::parse_response(plain), (404, "no\n".to_string()));
    }
}
