//! `pdmesh-bench kv`: move one prompt's KV (default 512 tokens of
//! SmolLM2: 32 blocks, 11.8 MB) from this process into another one, with
//! NIXL (UCX, arena registered once) and with the TCP transport (a
//! `Decode/WriteKv` gRPC stream in 1 MiB chunks), beside a plain memcpy of
//! the same bytes; median of `--rounds` each. Prints JSON.
//!
//! The other process is this binary again (`pdmesh-bench kv --target`),
//! which registers its arena, serves WriteKv, and prints its NIXL metadata.
//!
//! With `--vram` both buffers are in GPU memory (GPU 0 of each process;
//! NIXL registers them as VRAM, UCX's cuda_copy/cuda_ipc move them), the
//! baseline is a device-to-device copy, and the target reads back what
//! arrived so the report says whether the bytes match. TCP is not run then.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use pdmesh_engine::TransferArena;
use pdmesh_proto::decode::v1 as dpb;
use pdmesh_worker::kv::{self, Nixl};
use serde_json::json;
use tonic::{Request, Response, Status, Streaming};

#[derive(clap::Args)]
pub struct Args {
    /// Prompt tokens whose KV is moved.
    #[arg(long, default_value_t = 512)]
    pub tokens: usize,
    /// Repetitions of each method (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub rounds: usize,
    /// Bytes per gRPC message on the TCP transport.
    #[arg(long, default_value_t = 1 << 20)]
    pub chunk_bytes: usize,
    #[command(flatten)]
    pub transport: kv::TransportArgs,
    #[command(flatten)]
    pub cache: pdmesh_model::CacheArgs,
    /// Move GPU memory into GPU memory (NIXL's VRAM path), against a
    /// device-to-device copy; needs a GPU and NIXL.
    #[arg(long)]
    pub vram: bool,
    /// Internal: run as the receiving process.
    #[arg(long, hide = true)]
    pub target: bool,
}

/// SmolLM2-135M's KV block: 30 layers x (K, V) x 3 heads x 64 dims x 16 positions x f16.
const BLOCK_BYTES: usize = 30 * 2 * 3 * 64 * 16 * 2;

struct Sink {
    buf: std::sync::Mutex<Vec<u8>>,
}

#[tonic::async_trait]
impl dpb::decode_server::Decode for Sink {
    type GenerateStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<dpb::GenerateResponse, Status>> + Send>>;
    async fn generate(&self, _r: Request<dpb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        Err(Status::unimplemented("kvbench target"))
    }
    async fn write_kv(&self, req: Request<Streaming<dpb::KvChunk>>) -> Result<Response<dpb::WriteKvResponse>, Status> {
        let mut s = req.into_inner();
        let mut off = 0usize;
        while let Some(c) = s.message().await? {
            let mut buf = self.buf.lock().unwrap_or_else(|e| e.into_inner());
            let end = (off + c.data.len()).min(buf.len());
            buf[off..end].copy_from_slice(&c.data[..end - off]);
            off = end;
        }
        Ok(Response::new(dpb::WriteKvResponse { bytes: off as u64 }))
    }
    async fn load(&self, _r: Request<dpb::LoadRequest>) -> Result<Response<dpb::LoadResponse>, Status> {
        Err(Status::unimplemented("kvbench target"))
    }
    async fn hand_over(&self, _r: Request<dpb::HandOverRequest>) -> Result<Response<dpb::HandOverResponse>, Status> {
        Err(Status::unimplemented("kvbench target"))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

async fn target(a: &Args) -> Result<(), String> {
    let n = a.tokens.div_ceil(16) * BLOCK_BYTES;
    let sink = std::sync::Arc::new(Sink { buf: std::sync::Mutex::new(vec![0u8; n]) });
    let vram = if a.vram { Some(crate::vram::VramBuf::new(n, None)?) } else { None };
    let arena = match &vram {
        Some(v) => v.arena(),
        None => host(sink.buf.lock().map(|b| b.as_ptr() as usize).unwrap_or(0), n),
    };
    let addr = arena.addr;
    let nixl = match kv::choose(&a.transport, a.cache.python())? {
        Some(_) => Some(Nixl::start("kvbench-target", arena)?),
        None => None,
    };
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let grpc = l.local_addr().map_err(|e| e.to_string())?;
    let md = nixl.as_ref().map(|x| x.metadata()).transpose()?.unwrap_or_default();
    println!(
        "{}",
        json!({ "md": md.iter().map(|b| format!("{b:02x}")).collect::<String>(), "addr": addr, "len": n, "grpc": grpc.to_string() })
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let svc = dpb::decode_server::DecodeServer::from_arc(sink).max_decoding_message_size(64 << 20);
    let routes = tonic::service::Routes::new(svc);
    // Serve (and drive NIXL progress) until the parent closes our stdin.
    let stop = async {
        let _ = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            let _ = std::io::stdin().lock().read_line(&mut line);
        })
        .await;
    };
    if let Some(x) = nixl {
        let x = std::sync::Arc::new(x);
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        kv::spawn_progress(x.clone(), || true, |_| {}, flag.clone());
        pdmesh_core::grpc::serve_routes(routes, l, Default::default(), stop).await.map_err(|e| e.to_string())?;
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
    } else {
        pdmesh_core::grpc::serve_routes(routes, l, Default::default(), stop).await.map_err(|e| e.to_string())?;
    }
    // What arrived in VRAM, for the parent to compare with what it sent.
    if let Some(v) = vram {
        println!("{}", json!({ "checksum": checksum(&v.read()?) }));
    }
    Ok(())
}

/// A position-dependent checksum of `bytes` (FNV-1a).
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100000001b3))
}

pub async fn run(a: Args) -> Result<(), String> {
    if a.target {
        return target(&a).await;
    }
    let blocks = a.tokens.div_ceil(16);
    let n = blocks * BLOCK_BYTES;
    // Source bytes: a pattern, not zeros (zero pages could flatter a copy).
    let src: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
    let vram = if a.vram { Some(crate::vram::VramBuf::new(n, Some(&src))?) } else { None };
    let mut child = std::process::Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
        .args(["kv", "--target", "--tokens", &a.tokens.to_string()])
        .args(a.vram.then_some("--vram"))
        .args(["--kv-transport", if a.transport.kv_transport == kv::TransportChoice::Tcp { "tcp" } else { "auto" }])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    let mut from_target = std::io::BufReader::new(child.stdout.take().ok_or("no stdout")?);
    from_target.read_line(&mut line).map_err(|e| e.to_string())?;
    let info: serde_json::Value = serde_json::from_str(&line).map_err(|e| format!("target said {line:?}: {e}"))?;
    let mut report = serde_json::Map::new();
    report.insert("bytes".into(), json!(n));
    report.insert("tokens".into(), json!(a.tokens));
    report.insert("blocks".into(), json!(blocks));
    // The baseline: a copy within this process's memory (host or GPU).
    let (base_name, base) = match &vram {
        Some(v) => ("d2d_copy", median(v.d2d_times(a.rounds)?)),
        None => ("memcpy", median(host_copy_times(&src, a.rounds))),
    };
    report.insert(base_name.into(), json!({ "median_s": base, "gb_per_s": n as f64 / base / 1e9 }));
    let local = vram.as_ref().map(|v| v.arena()).unwrap_or_else(|| host(src.as_ptr() as usize, n));
    let nixl = nixl_rate(&a, &info, local, blocks, base)?;
    report.insert("nixl".into(), nixl);
    if a.vram {
        report.insert("tcp".into(), json!({ "skipped": "--vram: TCP stages through host memory" }));
        drop(child.stdin.take());
        let mut done = String::new();
        from_target.read_line(&mut done).map_err(|e| e.to_string())?;
        let got = serde_json::from_str::<serde_json::Value>(&done).ok().and_then(|v| v["checksum"].as_u64());
        report.insert("bytes_match".into(), json!(got == Some(checksum(&src))));
        let _ = child.wait();
        report.insert("rounds".into(), json!(a.rounds));
        println!("{}", serde_json::to_string_pretty(&serde_json::Value::Object(report)).unwrap_or_default());
        return Ok(());
    }
    let memcpy = base;

    let ch = pdmesh_core::grpc::lazy_channel(info["grpc"].as_str().unwrap_or_default())?;
    let mut client = dpb::decode_client::DecodeClient::new(ch).max_encoding_message_size(64 << 20);
    let mut t = Vec::new();
    for i in 0..a.rounds + 1 {
        let t0 = Instant::now();
        let chunks: Vec<dpb::KvChunk> =
            src.chunks(a.chunk_bytes.max(1)).map(|c| dpb::KvChunk { data: c.to_vec(), ..Default::default() }).collect();
        let r = client.write_kv(tokio_stream::iter(chunks)).await.map_err(|e| e.to_string())?;
        if r.into_inner().bytes as usize != n {
            return Err("the TCP target received a different byte count".into());
        }
        if i > 0 {
            t.push(t0.elapsed().as_secs_f64());
        }
    }
    let s = median(t);
    report.insert(
        "tcp".into(),
        json!({ "median_s": s, "gb_per_s": n as f64 / s / 1e9, "vs_baseline": memcpy / s, "chunk_bytes": a.chunk_bytes }),
    );
    drop(child.stdin.take());
    let _ = child.wait();
    let nixl_s = report.get("nixl").and_then(|v| v["median_s"].as_f64());
    report.insert("integrity".into(), integrity(&src, a.rounds, nixl_s, s));
    report.insert("rounds".into(), json!(a.rounds));
    println!("{}", serde_json::to_string_pretty(&serde_json::Value::Object(report)).unwrap_or_default());
    Ok(())
}

/// What the KV checksums cost: CRC-32C of every block of `src`, median of
/// `rounds`. The sender takes them as the prompt finishes (off the transfer
/// path); the receiver's check of the same bytes is on it, so its share of
/// each transport's transfer time is the overhead.
fn integrity(src: &[u8], rounds: usize, nixl_s: Option<f64>, tcp_s: f64) -> serde_json::Value {
    let t: Vec<f64> = (0..rounds.max(1))
        .map(|_| {
            let t0 = Instant::now();
            std::hint::black_box(pdmesh_engine::kv::block_checksums(std::hint::black_box(src), BLOCK_BYTES));
            t0.elapsed().as_secs_f64()
        })
        .collect();
    let c = median(t);
    json!({
        "crc32c_median_s": c,
        "gb_per_s": src.len() as f64 / c / 1e9,
        "receiver_check_vs_nixl": nixl_s.map(|n| c / n),
        "receiver_check_vs_tcp": c / tcp_s,
    })
}

/// Seconds of each of `rounds` copies of `src` within host memory.
fn host_copy_times(src: &[u8], rounds: usize) -> Vec<f64> {
    let mut dst = vec![0u8; src.len()];
    (0..rounds)
        .map(|_| {
            let t0 = Instant::now();
            dst.copy_from_slice(std::hint::black_box(src));
            std::hint::black_box(&dst);
            t0.elapsed().as_secs_f64()
        })
        .collect()
}

/// NIXL WRITEs of `local` into the target's arena, timed (the first, which
/// also connects, left out), against `base` seconds for the same bytes.
fn nixl_rate(
    a: &Args,
    info: &serde_json::Value,
    local: TransferArena,
    blocks: usize,
    base: f64,
) -> Result<serde_json::Value, String> {
    let md_hex = info["md"].as_str().unwrap_or_default();
    if md_hex.is_empty() || kv::choose(&a.transport, a.cache.python())?.is_none() {
        return Ok(json!({ "skipped": "NIXL not available" }));
    }
    let md: Vec<u8> =
        (0..md_hex.len() / 2).map(|i| u8::from_str_radix(&md_hex[2 * i..2 * i + 2], 16).unwrap_or(0)).collect();
    let nixl = Nixl::start("kvbench-source", local)?;
    let pieces: Vec<(usize, usize, usize)> =
        (0..blocks).map(|b| (b * BLOCK_BYTES, b * BLOCK_BYTES, BLOCK_BYTES)).collect();
    let far = TransferArena {
        addr: info["addr"].as_u64().unwrap_or(0) as usize,
        len: info["len"].as_u64().unwrap_or(0) as usize,
        gpu: local.gpu,
    };
    let mut t = Vec::new();
    for i in 0..a.rounds + 1 {
        let t0 = Instant::now();
        nixl.write("target", &md, far, &pieces, "kvbench", Duration::from_secs(10))?;
        if i > 0 {
            t.push(t0.elapsed().as_secs_f64());
        }
    }
    let s = median(t);
    let n = blocks * BLOCK_BYTES;
    Ok(
        json!({ "median_s": s, "gb_per_s": n as f64 / s / 1e9, "vs_baseline": base / s, "memory": if local.gpu.is_some() { "vram" } else { "host" } }),
    )
}

/// A buffer of host memory as NIXL registers it.
fn host(addr: usize, len: usize) -> TransferArena {
    TransferArena { addr, len, gpu: None }
}
