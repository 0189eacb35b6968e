//! The CUDA kernels that need no warp intrinsics or barriers, run on the
//! CPU from their very sources (kernels/cuda/host: a C++ shim that steps
//! through blocks and threads one at a time), against the CPU reference:
//! `embed_q4_1`, `embed_q8_0`, the f16 dequantizers and cast, `rope`,
//! `kv_write`, `silu_mul`, `add_into`, and matvec's per-block dot products,
//! for Q4_1, Q8_0, Q5_0, Q5_1 and the K-quants Q2_K to Q6_K. This checks their indexing, nibble
//! order, angles and the paged-KV layout here; the GPU check script
//! (scripts/gpu-check.sh) checks every kernel on a GPU.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use pdmesh_engine::{KvCache, KvLayout};
use pdmesh_kernels::quant::{self, BlockQ4_1, BlockQ8, BlockQ8_0, QK};
use pdmesh_kernels::rng::Rng;

/// Build the harness once per test (a C++17 compiler; skipped without one).
fn harness(test: &str) -> Option<(PathBuf, PathBuf)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("host/harness.cpp");
    let dir = std::env::temp_dir().join(format!("pdmesh-cuda-host-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join("harness");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    match Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-Wall", "-Wno-unknown-pragmas", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
    {
        Ok(o) if o.status.success() => Some((bin, dir)),
        Ok(o) => panic!("the host harness does not compile:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            pdmesh_testkit::skip(test, &format!("no C++ compiler ({cxx}: {e})"));
            None
        }
    }
}

fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: plain-old-data blocks and numbers, read as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }.to_vec()
}

fn write<T: Copy>(dir: &Path, name: &str, v: &[T]) {
    std::fs::write(dir.join(name), bytes(v)).unwrap();
}

fn run(bin: &Path, dir: &Path, case: &str, args: &[String]) -> Vec<u8> {
    let o = Command::new(bin).arg(case).arg(dir).args(args).output().unwrap();
    assert!(o.status.success(), "harness {case}: {}", String::from_utf8_lossy(&o.stderr));
    std::fs::read(dir.join("out.bin")).unwrap()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn s(v: impl ToString) -> String {
    v.to_string()
}

#[test]
fn embeddings_dequantize_rows_as_the_cpu_does() {
    let Some((bin, dir)) = harness("embeddings_dequantize_rows_as_the_cpu_does") else { return };
    let (rows, cols) = (50, 128);
    let mut rng = Rng::new(3);
    let table = rng.normal_vec(rows * cols);
    let mut q4 = vec![BlockQ4_1::default(); rows * cols / QK];
    quant::quantize_q4_1(&table, &mut q4);
    let mut q8 = vec![BlockQ8_0 { d: 0, qs: [0; QK] }; rows * cols / QK];
    quant::quantize_q8_0(&table, &mut q8);
    // The last two lie outside the table: their rows come out zero.
    let tokens: Vec<i32> = vec![7, 0, 49, 7, 23, 50, -1];
    write(&dir, "tokens.bin", &tokens);
    let nb = cols / QK;
    for case in ["embed_q4_1", "embed_q8_0"] {
        if case == "embed_q4_1" {
            write(&dir, "table.bin", &q4);
        } else {
            write(&dir, "table.bin", &q8);
        }
        let got = floats(&run(&bin, &dir, case, &[s(tokens.len()), s(cols)]));
        for (i, t) in tokens.iter().enumerate() {
            let mut want = vec![0f32; cols];
            let r = *t as usize;
            if (0..rows as i32).contains(t) {
                match case {
                    "embed_q4_1" => quant::dequantize_q4_1(&q4[r * nb..(r + 1) * nb], &mut want),
                    _ => quant::dequantize_q8_0(&q8[r * nb..(r + 1) * nb], &mut want),
                }
            }
            assert_eq!(&got[i * cols..(i + 1) * cols], &want[..], "{case}: token {t}");
        }
    }
}

#[test]
fn rope_turns_rows_as_the_cpu_does() {
    let Some((bin, dir)) = harness("rope_turns_rows_as_the_cpu_does") else { return };
    // SmolLM2-135M: 9 query heads of 64, RoPE on all 64 dims, base 10000.
    let (n_rows, n_heads, hd) = (5, 9, 64);
    let mut rng = Rng::new(4);
    let x = rng.normal_vec(n_rows * n_heads * hd);
    let pos: Vec<i32> = vec![0, 1, 17, 511, 2047];
    write(&dir, "x.bin", &x);
    write(&dir, "pos.bin", &pos);
    let got = floats(&run(&bin, &dir, "rope", &[s(n_rows), s(n_heads), s(hd), s(hd), s(10000.0)]));
    let mut want = x.clone();
    for (r, p) in pos.iter().enumerate() {
        pdmesh_kernels::rope::rope_row(
            &mut want[r * n_heads * hd..(r + 1) * n_heads * hd],
            hd,
            hd,
            *p as usize,
            10000.0,
        );
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "element {i}: {g} against {w}");
    }
}

#[test]
fn kv_write_fills_the_engines_block_layout() {
    let Some((bin, dir)) = harness("kv_write_fills_the_engines_block_layout") else { return };
    let layout = KvLayout { n_layers: 30, n_kv_heads: 3, head_dim: 64, block_size: 16 };
    let n_blocks = 6;
    let kvd = layout.n_kv_heads * layout.head_dim;
    let layer = 7;
    // Rows of two sequences: positions 0..20 of blocks [4, 1], 30..33 of [0, 5, 2].
    let rows: Vec<(Vec<u32>, usize)> =
        (0..20).map(|p| (vec![4, 1], p)).chain((30..33).map(|p| (vec![0, 5, 2], p))).collect();
    let mut rng = Rng::new(5);
    let k = rng.normal_vec(rows.len() * kvd);
    let v = rng.normal_vec(rows.len() * kvd);
    let row_block: Vec<i32> = rows.iter().map(|(t, p)| t[p / layout.block_size] as i32).collect();
    let row_slot: Vec<i32> = rows.iter().map(|(_, p)| (p % layout.block_size) as i32).collect();
    for (n, d) in [("k.bin", &k), ("v.bin", &v)] {
        write(&dir, n, d);
    }
    write(&dir, "row_block.bin", &row_block);
    write(&dir, "row_slot.bin", &row_slot);
    let args = [rows.len(), layer, layout.n_layers, layout.n_kv_heads, layout.head_dim, layout.block_size, n_blocks];
    let got = run(&bin, &dir, "kv_write", &args.map(s));
    let mut cache = KvCache::new(layout, n_blocks);
    for (r, (table, p)) in rows.iter().enumerate() {
        for h in 0..layout.n_kv_heads {
            let at = r * kvd + h * layout.head_dim..r * kvd + (h + 1) * layout.head_dim;
            cache.write(table, layer, 0, h, *p, &k[at.clone()]);
            cache.write(table, layer, 1, h, *p, &v[at]);
        }
    }
    let all: Vec<u32> = (0..n_blocks as u32).collect();
    let want = cache.export(&all, n_blocks * layout.block_size).unwrap().bytes;
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the kernel's arena differs from the engine's");
}

#[test]
fn silu_gate_and_residual_add_match_the_cpu() {
    let Some((bin, dir)) = harness("silu_gate_and_residual_add_match_the_cpu") else { return };
    let mut rng = Rng::new(6);
    let (a, b) = (rng.normal_vec(1536), rng.normal_vec(1536));
    write(&dir, "a.bin", &a);
    write(&dir, "b.bin", &b);
    let got = floats(&run(&bin, &dir, "silu_mul", &[]));
    let mut want = a.clone();
    pdmesh_kernels::activation::silu_mul(&mut want, &b);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{g} against {w}");
    }
    let got = floats(&run(&bin, &dir, "add_into", &[]));
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(got, want);
}

#[test]
fn matvec_block_dots_match_the_cpu_reference() {
    let Some((bin, dir)) = harness("matvec_block_dots_match_the_cpu_reference") else { return };
    let n = 64;
    let mut rng = Rng::new(7);
    let w = rng.normal_vec(n * QK);
    let x: Vec<f32> = rng.normal_vec(n * QK).iter().map(|v| v * 3.0).collect();
    let mut xq = vec![BlockQ8::default(); n];
    quant::quantize_q8(&x, &mut xq);
    write(&dir, "x.bin", &xq);
    let mut w4 = vec![BlockQ4_1::default(); n];
    quant::quantize_q4_1(&w, &mut w4);
    write(&dir, "w.bin", &w4);
    let got = floats(&run(&bin, &dir, "dot_q4_1", &[]));
    for i in 0..n {
        let want = pdmesh_kernels::dot::scalar::dot_q4_1(&w4[i..=i], [&xq[i..=i]])[0];
        assert!((got[i] - want).abs() <= 1e-5 * want.abs().max(1.0), "q4_1 block {i}: {} against {want}", got[i]);
    }
    let mut w8 = vec![BlockQ8_0 { d: 0, qs: [0; QK] }; n];
    quant::quantize_q8_0(&w, &mut w8);
    write(&dir, "w.bin", &w8);
    let got = floats(&run(&bin, &dir, "dot_q8_0", &[]));
    for i in 0..n {
        let want = pdmesh_kernels::dot::scalar::dot_q8_0(&w8[i..=i], [&xq[i..=i]])[0];
        assert!((got[i] - want).abs() <= 1e-5 * want.abs().max(1.0), "q8_0 block {i}: {} against {want}", got[i]);
    }
}

#[test]
fn f16_dequantizers_and_cast_round_the_cpus_values_once() {
    let Some((bin, dir)) = harness("f16_dequantizers_and_cast_round_the_cpus_values_once") else { return };
    let n = 40 * QK;
    let mut rng = Rng::new(8);
    let w = rng.normal_vec(n);
    let halves = |b: &[u8]| b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect::<Vec<_>>();
    let to_f16 = |v: &[f32]| v.iter().map(|x| half::f16::from_f32(*x).to_bits()).collect::<Vec<_>>();
    let mut want = vec![0f32; n];
    let mut w4 = vec![BlockQ4_1::default(); n / QK];
    quant::quantize_q4_1(&w, &mut w4);
    write(&dir, "w.bin", &w4);
    quant::dequantize_q4_1(&w4, &mut want);
    assert_eq!(halves(&run(&bin, &dir, "dequant_q4_1_f16", &[s(n)])), to_f16(&want), "dequant_q4_1_f16");
    let mut w8 = vec![BlockQ8_0 { d: 0, qs: [0; QK] }; n / QK];
    quant::quantize_q8_0(&w, &mut w8);
    write(&dir, "w.bin", &w8);
    quant::dequantize_q8_0(&w8, &mut want);
    assert_eq!(halves(&run(&bin, &dir, "dequant_q8_0_f16", &[s(n)])), to_f16(&want), "dequant_q8_0_f16");
    // Ties, subnormals and values past f16's range round as the CPU's f16 does.
    let mut x: Vec<f32> = rng.normal_vec(n).iter().map(|v| v * 1000.0).collect();
    x.extend([1.0 + 1.0 / 2048.0, 6.0e-8, -1.0e-6, 70000.0, -0.0]);
    write(&dir, "x.bin", &x);
    assert_eq!(halves(&run(&bin, &dir, "cast_f16", &[s(x.len())])), to_f16(&x), "cast_f16");
}

/// The 5-bit types and the K-quants: each type's value of every weight
/// (`kq_value`) is the CPU dequantizer's f32, bit for bit; its f16
/// dequantizing kernel rounds that once; its block dot (matvec's inner
/// step, over the Q8 activation blocks a weight block spans) is the f64
/// product of those values and the activations, to f32 rounding.
#[test]
fn k_quant_values_dequantizers_and_block_dots_match_the_cpu() {
    use pdmesh_kernels::formats::TensorType;
    use pdmesh_kernels::matmul::QData;
    let Some((bin, dir)) = harness("k_quant_values_dequantizers_and_block_dots_match_the_cpu") else { return };
    let mut rng = Rng::new(11);
    // (type, harness name, byte offsets of its f16 scales)
    let types: [(TensorType, &str, &[usize]); 7] = [
        (TensorType::Q5_0, "q5_0", &[0]),
        (TensorType::Q5_1, "q5_1", &[0, 2]),
        (TensorType::Q2K, "q2_k", &[80, 82]),
        (TensorType::Q3K, "q3_k", &[108]),
        (TensorType::Q4K, "q4_k", &[0, 2]),
        (TensorType::Q5K, "q5_k", &[0, 2]),
        (TensorType::Q6K, "q6_k", &[208]),
    ];
    let halves = |b: &[u8]| b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect::<Vec<_>>();
    for (ty, name, f16_at) in types {
        let (per, size) = (ty.block().0 as usize, ty.block().1 as usize);
        let nb = 24;
        let mut raw: Vec<u8> = (0..nb * size).map(|_| (rng.next_u64() >> 56) as u8).collect();
        for b in 0..nb {
            for &at in f16_at {
                let v = half::f16::from_f32(rng.normal() * 0.05).to_bits().to_le_bytes();
                raw[b * size + at..b * size + at + 2].copy_from_slice(&v);
            }
        }
        std::fs::write(dir.join("w.bin"), &raw).unwrap();
        // Blocks need their type's alignment to be viewed in place.
        let mut store = vec![0u64; raw.len().div_ceil(8)];
        // SAFETY: `store` holds at least `raw.len()` bytes.
        let view = unsafe { std::slice::from_raw_parts_mut(store.as_mut_ptr().cast::<u8>(), raw.len()) };
        view.copy_from_slice(&raw);
        let mut want = vec![0f32; nb * per];
        QData::from_bytes(ty, view).unwrap().dequantize(0, &mut want);
        let n = want.len();
        let got = floats(&run(&bin, &dir, "kq", &[s("values"), s(name), s(n)]));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{name}: f32 values");
        let f16s: Vec<u16> = want.iter().map(|x| half::f16::from_f32(*x).to_bits()).collect();
        assert_eq!(halves(&run(&bin, &dir, "kq", &[s("dequant"), s(name), s(n)])), f16s, "{name}: f16 dequantizer");
        let x: Vec<f32> = rng.normal_vec(n).iter().map(|v| v * 2.0).collect();
        let mut xq = vec![BlockQ8::default(); n / QK];
        quant::quantize_q8(&x, &mut xq);
        write(&dir, "x.bin", &xq);
        let got = floats(&run(&bin, &dir, "kq", &[s("dot"), s(name), s(n)]));
        for (b, g) in got.iter().enumerate() {
            let (mut exact, mut scale) = (0f64, 0f64);
            for e in b * per..(b + 1) * per {
                let xb = &xq[e / QK];
                let xv = xb.d as f64 * xb.qs[e % QK] as f64;
                exact += want[e] as f64 * xv;
                scale += (want[e] as f64 * xv).abs();
            }
            assert!(
                (*g as f64 - exact).abs() <= 1e-5 * scale + 1e-6,
                "{name} block {b}: {g} against {exact} (magnitude {scale})"
            );
        }
    }
}
