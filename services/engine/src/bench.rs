//! `pdmesh-engine bench`: prefill and decode throughput and peak memory,
//! printed as JSON. The shapes follow llama.cpp's llama-bench (pp512) and
//! llama-batched-bench (128-token prompts) so the numbers compare directly.

use std::time::Instant;

use serde::Serialize;

use crate::engine::Engine;
use crate::error::Result;
use crate::sampler::SamplingParams;
use crate::tokenizer::Tokenizer;

#[derive(Debug, Serialize)]
pub struct DecodePoint {
    pub batch: usize,
    pub steps: usize,
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
}

#[derive(Debug, Serialize)]
pub struct BenchReport {
    /// The CPU kernels' instruction set, or the GPU that ran the forward pass.
    pub backend: String,
    pub threads: usize,
    pub weights_mb: f64,
    pub prefill_tokens: usize,
    pub prefill_tokens_per_s: f64,
    pub prefill_runs_s: Vec<f64>,
    pub decode_prompt_tokens: usize,
    pub decode: Vec<DecodePoint>,
    pub kv_mb_in_use_peak: f64,
    pub peak_rss_mb: f64,
    /// The matrix-product kernel each decode batch size ran (CPU only).
    pub kernels: Vec<(usize, &'static str)>,
    /// Memory read bandwidth with `threads` threads, GB/s (CPU only).
    pub read_gb_per_s: f64,
    /// Every batch-1 step reads all weights: their bytes at that
    /// bandwidth, in ms, and the measured batch-1 step's share of it.
    pub batch1_floor_ms: f64,
    pub batch1_share_of_floor: Option<f64>,
}

/// Memory read bandwidth with `threads` threads summing disjoint parts of a
/// 512 MiB buffer (best of 3 passes), in GB/s.
pub fn read_bandwidth(threads: usize) -> f64 {
    let words = (512usize << 20) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let threads = threads.max(1);
    let part = words.div_ceil(threads);
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> =
                buf.chunks(part).map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    (words * 8) as f64 / best / 1e9
}

/// Peak resident set size of this process (VmHWM), in MiB.
pub fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// `n` tokens of ordinary English text (deterministic).
pub fn prompt_tokens(tok: &Tokenizer, n: usize) -> Result<Vec<u32>> {
    let para = "The history of computing is a story of people finding new ways to make machines do arithmetic, \
        remember what they computed, and share it with each other. Early engineers built relays and valves; \
        later ones etched transistors by the billion onto slivers of silicon. ";
    let mut ids = Vec::new();
    let mut i = 0;
    while ids.len() < n {
        ids.extend(tok.encode(&format!("{para}Chapter {i}. "), false)?);
        i += 1;
    }
    ids.truncate(n);
    Ok(ids)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(
    engine: &mut Engine,
    tok: &Tokenizer,
    prefill_len: usize,
    batches: &[usize],
    steps: usize,
    decode_prompt: usize,
) -> Result<BenchReport> {
    let params = SamplingParams { max_tokens: steps + 2, ignore_eos: true, ..Default::default() };
    // Prefill: one prompt of `prefill_len` tokens, median of 3 (after a warm-up).
    let prompt = prompt_tokens(tok, prefill_len)?;
    let mut runs = Vec::new();
    for i in 0..4 {
        let id = engine.add_sequence(prompt.clone(), SamplingParams::greedy(1))?;
        let t = Instant::now();
        engine.prefill(&[id])?;
        if i > 0 {
            runs.push(t.elapsed().as_secs_f64());
        }
        engine.release(id)?;
    }
    let prefill_s = median(&mut runs.clone());

    let decode_prompt = decode_prompt.max(1);
    let mut decode = Vec::new();
    let mut kv_peak = 0usize;
    for &b in batches {
        let ids: Vec<_> = (0..b)
            .map(|i| {
                let mut p = prompt_tokens(tok, decode_prompt + i)?;
                p.drain(..i);
                engine.add_sequence(p, params.clone())
            })
            .collect::<Result<_>>()?;
        engine.prefill(&ids)?;
        engine.decode(&ids)?; // warm-up step
        let t = Instant::now();
        for _ in 0..steps {
            engine.decode(&ids)?;
        }
        let dt = t.elapsed().as_secs_f64();
        kv_peak = kv_peak.max(engine.kv.used());
        for id in ids {
            engine.release(id)?;
        }
        decode.push(DecodePoint {
            batch: b,
            steps,
            tokens_per_s: (b * steps) as f64 / dt,
            ms_per_step: dt * 1000.0 / steps as f64,
        });
    }
    let cpu = !engine.on_gpu();
    let be = engine.model.backend;
    let kernels =
        if cpu { batches.iter().map(|&b| (b, pdmesh_kernels::matmul::kernel_for(be, b))).collect() } else { vec![] };
    let read_gb_per_s = if cpu { read_bandwidth(engine.threads()) } else { 0.0 };
    let weights_mb = engine.model.weight_bytes() as f64 / 1e6;
    let batch1_floor_ms = if cpu { weights_mb / read_gb_per_s } else { 0.0 };
    let batch1_share_of_floor =
        decode.iter().find(|d| d.batch == 1).filter(|_| cpu).map(|d| batch1_floor_ms / d.ms_per_step);
    Ok(BenchReport {
        backend: if engine.on_gpu() { engine.backend_note.clone() } else { engine.model.backend.name().to_string() },
        threads: engine.threads(),
        weights_mb: engine.model.weight_bytes() as f64 / 1e6,
        prefill_tokens: prefill_len,
        prefill_tokens_per_s: prefill_len as f64 / prefill_s,
        prefill_runs_s: runs,
        decode_prompt_tokens: decode_prompt,
        decode,
        kv_mb_in_use_peak: (kv_peak * engine.kv.layout.block_bytes()) as f64 / 1e6,
        peak_rss_mb: peak_rss_mb(),
        kernels,
        read_gb_per_s,
        batch1_floor_ms,
        batch1_share_of_floor,
    })
}
