//! A whole HTTP/1.1 503 for a connection its server cannot serve — the
//! gateway over its connection cap, `meshctl up` while no gateway runs —
//! written on the raw connection, which is then closed. The body is
//! OpenAI's error shape, as the gateway's other errors.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The response: 503, `Retry-After`, `Connection: close` and the error
/// body with `message` and `code` (type `service_unavailable`).
pub fn unavailable(message: &str, code: &str, retry_after_s: u32) -> String {
    let body = serde_json::json!({
        "error": { "message": message, "type": "service_unavailable", "param": null, "code": code }
    })
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: {retry_after_s}\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Answer `tcp` with `response` and close it. What the client sent first
/// is read, and the close waits for the client's, so the answer is not
/// lost to a reset; a client that neither sends nor reads is given about
/// two seconds in all.
pub async fn answer_and_close(mut tcp: TcpStream, response: &str) {
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_millis(200), tcp.read(&mut buf)).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), tcp.write_all(response.as_bytes())).await;
    let _ = tcp.shutdown().await;
    let drained = async { while matches!(tcp.read(&mut buf).await, Ok(n) if n > 0) {} };
    let _ = tokio::time::timeout(Duration::from_secs(1), drained).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_response_is_whole_http_with_an_openai_error() {
        let r = unavailable("no room", "too_many_connections", 1);
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
        assert!(head.contains("retry-after: 1\r\n") && head.contains("connection: close"), "{head}");
        let len: usize = head.lines().find_map(|l| l.strip_prefix("content-length: ")).unwrap().parse().unwrap();
        assert_eq!(len, body.len());
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
        assert_eq!(v["error"]["type"], "service_unavailable");
    }

    #[tokio::test]
    async fn a_client_reads_the_whole_answer_then_sees_the_close() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (tcp, _) = l.accept().await.unwrap();
            answer_and_close(tcp, &unavailable("down", "gateway_down", 5)).await;
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}").await.unwrap();
        let mut got = String::new();
        tokio::time::timeout(Duration::from_secs(5), c.read_to_string(&mut got)).await.unwrap().unwrap();
        assert!(got.starts_with("HTTP/1.1 503 ") && got.ends_with("}"), "{got}");
        drop(c);
        server.await.unwrap();
    }
}
