//! Every CUDA kernel on a real GPU against the CPU reference
//! (pdmesh-kernels, pdmesh-engine's KV layout), within stated tolerances.
//! Without a GPU each test prints why and is counted as skipped
//! (`pdmesh_testkit::skip`), never as passed.
//!
//! Tolerances: bit-exact where the GPU does the same integer or f16 work
//! (embeddings, Q8 quantisation, the KV write, argmax, the residual add);
//! relative 1e-5 for RMSNorm and SiLU, 1e-4 for RoPE (the GPU's sincosf)
//! and for matvec (another summation order over the blocks), 2e-3 for
//! attention (its exp and summation order over positions), 1e-3 for the
//! f16 GEMM (f16 inputs; the reference multiplies the same f16 values).
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use pdmesh_cuda::gpu::{AttentionRows, Gpu, Knobs, KvShape, WeightType, Q8_BLOCK_BYTES};
use pdmesh_engine::{KvCache, KvLayout};
use pdmesh_kernels::quant::{self, BlockQ4_1, BlockQ8, BlockQ8_0, QK};
use pdmesh_kernels::rng::Rng;

fn gpu(test: &str) -> Option<Gpu> {
    match Gpu::open(0, Knobs::default()) {
        Ok(g) => Some(g),
        Err(why) => {
            pdmesh_testkit::skip(test, &why.to_string());
            None
        }
    }
}

fn close(got: &[f32], want: &[f32], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= rel * w.abs().max(1.0), "{what}: element {i}: {g} against {w}");
    }
}

fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: plain-old-data blocks, read as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }.to_vec()
}

#[test]
fn gpu_embeddings_norm_silu_and_add_match_the_cpu() {
    let Some(g) = gpu("gpu_embeddings_norm_silu_and_add_match_the_cpu") else { return };
    let (rows, cols) = (64, 576);
    let mut rng = Rng::new(11);
    let table = rng.normal_vec(rows * cols);
    let mut q4 = vec![BlockQ4_1::default(); rows * cols / QK];
    quant::quantize_q4_1(&table, &mut q4);
    let tokens = [3i32, 0, 63, 3];
    let (dt, dtok) = (g.upload(&bytes(&q4)).unwrap(), g.upload(&tokens).unwrap());
    let mut out = g.zeros::<f32>(tokens.len() * cols).unwrap();
    g.embed(&dt, WeightType::Q4_1, &dtok, &mut out, tokens.len(), cols).unwrap();
    let got = g.download(&out).unwrap();
    let nb = cols / QK;
    for (i, t) in tokens.iter().enumerate() {
        let mut want = vec![0f32; cols];
        quant::dequantize_q4_1(&q4[*t as usize * nb..(*t as usize + 1) * nb], &mut want);
        assert_eq!(&got[i * cols..(i + 1) * cols], &want[..], "embedding of token {t}");
    }
    // RMSNorm.
    let x = rng.normal_vec(3 * cols);
    let w = rng.normal_vec(cols);
    let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let mut dn = g.zeros::<f32>(x.len()).unwrap();
    g.rms_norm(&dx, &dw, &mut dn, 3, cols, 1e-5).unwrap();
    let mut want = vec![0f32; x.len()];
    pdmesh_kernels::norm::rms_norm(&x, &w, 1e-5, &mut want);
    close(&g.download(&dn).unwrap(), &want, 1e-5, "rms_norm");
    // SiLU gate and the residual add.
    let (a, b) = (rng.normal_vec(1536), rng.normal_vec(1536));
    let (mut da, db) = (g.upload(&a).unwrap(), g.upload(&b).unwrap());
    g.silu_mul(&mut da, &db, a.len()).unwrap();
    let mut want = a.clone();
    pdmesh_kernels::activation::silu_mul(&mut want, &b);
    close(&g.download(&da).unwrap(), &want, 1e-5, "silu_mul");
    let mut da = g.upload(&a).unwrap();
    g.add_into(&mut da, &db, a.len()).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(g.download(&da).unwrap(), want, "add_into");
}

#[test]
fn gpu_quantize_and_matvec_match_the_cpu() {
    let Some(g) = gpu("gpu_quantize_and_matvec_match_the_cpu") else { return };
    let (rows, cols) = (1536, 576);
    let mut rng = Rng::new(12);
    let w = rng.normal_vec(rows * cols);
    for n_tok in [1usize, 3, 8, 11] {
        let x: Vec<f32> = rng.normal_vec(n_tok * cols).iter().map(|v| v * 2.0).collect();
        let mut xq = vec![BlockQ8::default(); n_tok * cols / QK];
        quant::quantize_q8(&x, &mut xq);
        let dx = g.upload(&x).unwrap();
        let mut dq = g.zeros::<u8>(xq.len() * Q8_BLOCK_BYTES).unwrap();
        g.quantize_q8(&dx, &mut dq, x.len()).unwrap();
        assert_eq!(g.download(&dq).unwrap(), bytes(&xq), "quantize_q8 is bit-exact ({n_tok} tokens)");
        for ty in [WeightType::Q4_1, WeightType::Q8_0] {
            let (wb, want) = reference_matvec(&w, rows, cols, &xq, n_tok, ty);
            let dw = g.upload(&wb).unwrap();
            let mut dy = g.zeros::<f32>(n_tok * rows).unwrap();
            g.matvec(&dw, ty, &dq, &mut dy, rows, cols, n_tok).unwrap();
            close(&g.download(&dy).unwrap(), &want, 1e-4, &format!("matvec {ty:?}, {n_tok} tokens"));
        }
    }
}

/// The weights' bytes and the CPU's products `[token][row]`.
fn reference_matvec(
    w: &[f32],
    rows: usize,
    cols: usize,
    xq: &[BlockQ8],
    n_tok: usize,
    ty: WeightType,
) -> (Vec<u8>, Vec<f32>) {
    let nb = cols / QK;
    match ty {
        WeightType::Q4_1 => {
            let mut b = vec![BlockQ4_1::default(); rows * nb];
            quant::quantize_q4_1(w, &mut b);
            (bytes(&b), products(&b, nb, xq, n_tok, pdmesh_kernels::dot::scalar::dot_q4_1::<1>))
        }
        WeightType::Q8_0 => {
            let mut b = vec![BlockQ8_0 { d: 0, qs: [0; QK] }; rows * nb];
            quant::quantize_q8_0(w, &mut b);
            (bytes(&b), products(&b, nb, xq, n_tok, pdmesh_kernels::dot::scalar::dot_q8_0::<1>))
        }
        other => unreachable!(
            "{other:?} weights are tested from random blocks (gpu_k_quant_matvec_and_dequant_match_the_cpu)"
        ),
    }
}

/// The 5-bit types and the K-quants: random blocks (finite scales), their
/// f16 dequantization equal to the CPU's values rounded once, and the
/// matvec against the f64 products of those values and the activations.
#[test]
fn gpu_k_quant_matvec_and_dequant_match_the_cpu() {
    use pdmesh_kernels::formats::TensorType;
    use pdmesh_kernels::matmul::QData;
    let Some(g) = gpu("gpu_k_quant_matvec_and_dequant_match_the_cpu") else { return };
    let (rows, cols, n_tok) = (96, 512, 5);
    let mut rng = Rng::new(14);
    let types = [
        (WeightType::Q5_0, TensorType::Q5_0, &[0usize][..]),
        (WeightType::Q5_1, TensorType::Q5_1, &[0, 2][..]),
        (WeightType::Q2K, TensorType::Q2K, &[80, 82][..]),
        (WeightType::Q3K, TensorType::Q3K, &[108][..]),
        (WeightType::Q4K, TensorType::Q4K, &[0, 2][..]),
        (WeightType::Q5K, TensorType::Q5K, &[0, 2][..]),
        (WeightType::Q6K, TensorType::Q6K, &[208][..]),
    ];
    let x: Vec<f32> = rng.normal_vec(n_tok * cols).iter().map(|v| v * 2.0).collect();
    let mut xq = vec![BlockQ8::default(); n_tok * cols / QK];
    quant::quantize_q8(&x, &mut xq);
    let dq = g.upload(&bytes(&xq)).unwrap();
    for (ty, tt, f16_at) in types {
        let (per, size) = (tt.block().0 as usize, tt.block().1 as usize);
        let nb = rows * cols / per;
        let mut raw: Vec<u8> = (0..nb * size).map(|_| (rng.next_u64() >> 56) as u8).collect();
        for b in 0..nb {
            for &at in f16_at {
                let v = half::f16::from_f32(rng.normal() * 0.05).to_bits().to_le_bytes();
                raw[b * size + at..b * size + at + 2].copy_from_slice(&v);
            }
        }
        let mut store = vec![0u64; raw.len().div_ceil(8)];
        // SAFETY: `store` holds at least `raw.len()` bytes.
        let view = unsafe { std::slice::from_raw_parts_mut(store.as_mut_ptr().cast::<u8>(), raw.len()) };
        view.copy_from_slice(&raw);
        let mut wf = vec![0f32; rows * cols];
        QData::from_bytes(tt, view).unwrap().dequantize(0, &mut wf);
        let dw = g.upload(&raw).unwrap();
        let f16 = g.download(&g.dequant_f16(&dw, ty, rows * cols).unwrap()).unwrap();
        let want16: Vec<u16> = wf.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect();
        assert_eq!(f16, want16, "dequant {ty:?}");
        let mut want = vec![0f32; n_tok * rows];
        for t in 0..n_tok {
            for r in 0..rows {
                want[t * rows + r] = (0..cols)
                    .map(|c| {
                        let b = &xq[(t * cols + c) / QK];
                        wf[r * cols + c] as f64 * b.d as f64 * b.qs[c % QK] as f64
                    })
                    .sum::<f64>() as f32;
            }
        }
        let mut dy = g.zeros::<f32>(n_tok * rows).unwrap();
        g.matvec(&dw, ty, &dq, &mut dy, rows, cols, n_tok).unwrap();
        close(&g.download(&dy).unwrap(), &want, 1e-4, &format!("matvec {ty:?}"));
    }
}

/// Every weight row (of `nb` blocks) dotted with every token's activations, `[token][row]`.
fn products<B>(
    w: &[B],
    nb: usize,
    xq: &[BlockQ8],
    n_tok: usize,
    dot: fn(&[B], [&[BlockQ8]; 1]) -> [f32; 1],
) -> Vec<f32> {
    let rows = w.len() / nb;
    let mut out = vec![0f32; n_tok * rows];
    for t in 0..n_tok {
        for r in 0..rows {
            out[t * rows + r] = dot(&w[r * nb..(r + 1) * nb], [&xq[t * nb..(t + 1) * nb]])[0];
        }
    }
    out
}

#[test]
fn gpu_rope_kv_write_and_attention_match_the_cpu() {
    let Some(g) = gpu("gpu_rope_kv_write_and_attention_match_the_cpu") else { return };
    // SmolLM2-135M's shapes: 9 query heads and 3 KV heads of 64.
    let layout = KvLayout { n_layers: 30, n_kv_heads: 3, head_dim: 64, block_size: 16 };
    let shape = KvShape { n_layers: 30, n_kv_heads: 3, head_dim: 64, block_size: 16 };
    let (n_heads, hd, layer) = (9usize, 64usize, 5usize);
    let kvd = layout.n_kv_heads * hd;
    let n_blocks = 8;
    // One sequence of 40 positions in blocks [6, 2, 7], all written this step.
    let table = [6u32, 2, 7];
    let n = 40;
    let mut rng = Rng::new(13);
    let mut q = rng.normal_vec(n * n_heads * hd);
    let mut k = rng.normal_vec(n * kvd);
    let v = rng.normal_vec(n * kvd);
    let pos: Vec<i32> = (0..n as i32).collect();
    // RoPE.
    let (mut dq, mut dk, dpos) = (g.upload(&q).unwrap(), g.upload(&k).unwrap(), g.upload(&pos).unwrap());
    g.rope(&mut dq, &dpos, n, n_heads, hd, hd, 10000.0).unwrap();
    g.rope(&mut dk, &dpos, n, layout.n_kv_heads, hd, hd, 10000.0).unwrap();
    for (r, p) in pos.iter().enumerate() {
        pdmesh_kernels::rope::rope_row(&mut q[r * n_heads * hd..(r + 1) * n_heads * hd], hd, hd, *p as usize, 10000.0);
        pdmesh_kernels::rope::rope_row(&mut k[r * kvd..(r + 1) * kvd], hd, hd, *p as usize, 10000.0);
    }
    close(&g.download(&dq).unwrap(), &q, 1e-4, "rope q");
    close(&g.download(&dk).unwrap(), &k, 1e-4, "rope k");
    // The KV write, from the CPU's rotated keys so the arenas compare bit for bit.
    let dk = g.upload(&k).unwrap();
    let dv = g.upload(&v).unwrap();
    let row_block: Vec<i32> = (0..n).map(|p| table[p / 16] as i32).collect();
    let row_slot: Vec<i32> = (0..n).map(|p| (p % 16) as i32).collect();
    let mut arena = g.zeros::<u16>(n_blocks * layout.block_elems()).unwrap();
    g.kv_write(&dk, &dv, &mut arena, &g.upload(&row_block).unwrap(), &g.upload(&row_slot).unwrap(), n, layer, shape)
        .unwrap();
    let mut cache = KvCache::new(layout, n_blocks);
    for p in 0..n {
        for h in 0..layout.n_kv_heads {
            cache.write(&table, layer, 0, h, p, &k[p * kvd + h * hd..p * kvd + (h + 1) * hd]);
            cache.write(&table, layer, 1, h, p, &v[p * kvd + h * hd..p * kvd + (h + 1) * hd]);
        }
    }
    let all: Vec<u32> = (0..n_blocks as u32).collect();
    let want = cache.export(&all, n_blocks * 16).unwrap().bytes;
    assert!(bytes(&g.download(&arena).unwrap()) == want, "kv_write's arena differs from the engine's");
    // Causal attention of every row, against a plain f64 reference over the
    // same f16 keys and values (query and probabilities rounded to f16, as the kernel and the CPU do).
    let rows = AttentionRows {
        n,
        pos: g.upload(&pos).unwrap(),
        table_start: g.upload(&vec![0i32; n]).unwrap(),
        tables: g.upload(&table.map(|b| b as i32)).unwrap(),
        max_ctx: n,
    };
    let dq = g.upload(&q).unwrap();
    let mut dout = g.zeros::<f32>(n * n_heads * hd).unwrap();
    let scale = 1.0 / (hd as f32).sqrt();
    g.attention(&dq, &mut dout, &arena, &rows, n_heads, layer, shape, scale).unwrap();
    let f16 = |x: f32| half::f16::from_f32(x).to_f32();
    let mut want = vec![0f32; n * n_heads * hd];
    for r in 0..n {
        for h in 0..n_heads {
            let kh = h / (n_heads / layout.n_kv_heads);
            let qv: Vec<f64> =
                q[(r * n_heads + h) * hd..(r * n_heads + h + 1) * hd].iter().map(|x| f16(*x) as f64).collect();
            let s: Vec<f64> = (0..=r)
                .map(|j| (0..hd).map(|e| f16(k[j * kvd + kh * hd + e]) as f64 * qv[e]).sum::<f64>() * scale as f64)
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
            for e in 0..hd {
                want[(r * n_heads + h) * hd + e] = (0..=r)
                    .map(|j| f16(((s[j] - mx).exp() / z) as f32) as f64 * f16(v[j * kvd + kh * hd + e]) as f64)
                    .sum::<f64>() as f32;
            }
        }
    }
    close(&g.download(&dout).unwrap(), &want, 2e-3, "attention");
}

#[test]
fn gpu_argmax_and_sampling_pick_as_expected() {
    let Some(g) = gpu("gpu_argmax_and_sampling_pick_as_expected") else { return };
    let vocab = 49152;
    let mut rng = Rng::new(14);
    let mut logits = rng.normal_vec(3 * vocab);
    logits[100] = 50.0; // row 0's winner
    logits[vocab + 49151] = 50.0; // row 1's, at the end
    logits[2 * vocab + 7] = 50.0; // row 2: a tie, the lower index wins
    logits[2 * vocab + 9000] = 50.0;
    let dl = g.upload(&logits).unwrap();
    let mut out = g.zeros::<i32>(3).unwrap();
    g.argmax(&dl, 3, vocab, &mut out).unwrap();
    assert_eq!(g.download(&out).unwrap(), vec![100, 49151, 7]);
    // At a low temperature the winner takes all the probability; u picks
    // within the cumulative distribution (u = 0 takes the first index with any).
    let du = g.upload(&[0.5f32, 0.999, 0.0]).unwrap();
    g.sample_temperature(&dl, 3, vocab, 0.05, &du, &mut out).unwrap();
    let got = g.download(&out).unwrap();
    assert_eq!(&got[..2], &[100, 49151]);
    assert!(got[2] == 7 || got[2] == 9000, "{got:?}");
}

/// The GEMM path: Q4_1 weights dequantized to f16 on the GPU, activations
/// cast to f16, one cuBLAS GEMM, against the CPU's f32 product of the same
/// f16-rounded values (relative 1e-3: f16 inputs, f32 sums in another order).
#[test]
fn gpu_f16_gemm_matches_the_cpus_product_of_the_same_values() {
    let Some(g) = gpu("gpu_f16_gemm_matches_the_cpus_product_of_the_same_values") else { return };
    assert!(g.gemm_ready(), "cuBLAS: {}", g.blas_note);
    let (rows, cols, n_tok) = (1536, 576, 37);
    let mut rng = Rng::new(14);
    let mut w4 = vec![BlockQ4_1::default(); rows * cols / QK];
    quant::quantize_q4_1(&rng.normal_vec(rows * cols), &mut w4);
    let x = rng.normal_vec(n_tok * cols);
    let dw = g.upload(&bytes(&w4)).unwrap();
    let w16 = g.dequant_f16(&dw, WeightType::Q4_1, rows * cols).unwrap();
    let mut x16 = g.zeros::<u16>(x.len()).unwrap();
    g.cast_f16(&g.upload(&x).unwrap(), &mut x16, x.len()).unwrap();
    let mut y = g.zeros::<f32>(n_tok * rows).unwrap();
    g.linear_f16(&w16, &x16, &mut y, rows, cols, n_tok).unwrap();
    let mut w = vec![0f32; rows * cols];
    quant::dequantize_q4_1(&w4, &mut w);
    let (w, x): (Vec<f32>, Vec<f32>) =
        (w.iter().map(|v| quant::round_f16(*v)).collect(), x.iter().map(|v| quant::round_f16(*v)).collect());
    let want: Vec<f32> = (0..n_tok * rows)
        .map(|i| (0..cols).map(|k| w[(i % rows) * cols + k] * x[(i / rows) * cols + k]).sum())
        .collect();
    close(&g.download(&y).unwrap(), &want, 1e-3, "linear_f16");
    // The f16 weights are the CPU's dequantized values, rounded once.
    let got16 = g.download(&w16).unwrap();
    assert!(got16.iter().zip(&w).all(|(h, v)| quant::f16_to_f32(*h) == *v), "dequant_q4_1_f16");
}
