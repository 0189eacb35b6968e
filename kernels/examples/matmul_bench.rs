//! Times one quantized matmul shape per weight type on random blocks, the
//! products of a Gemma 3 270M prefill (512 activation rows) by default:
//! `cargo run --release -p pdmesh-kernels --example matmul_bench -- [ROWS] [THREADS] [REPEATS] [SEQ]`
//! (SEQ: activation rows per sequence, as the engine groups them; 1 is
//! batched decode, ROWS (the default) one prompt).
//! Prints one JSON line per type: milliseconds per product (best of the repeats).
use pdmesh_kernels::formats::TensorType;
use pdmesh_kernels::matmul::{acts_for, matmul, quantize_acts, QActs, QData, QMatrix};
use pdmesh_kernels::pool::Pool;
use pdmesh_kernels::rng::Rng;
use pdmesh_kernels::Backend;
use std::time::Instant;

/// Random bytes for `n` blocks of `ty`, each f16 scale at `f16_at` small and finite.
fn random_weights(rng: &mut Rng, ty: TensorType, n: usize, f16_at: &[usize]) -> Vec<u8> {
    let size = ty.block().1 as usize;
    let mut bytes: Vec<u8> = (0..n * size).map(|_| (rng.next_u64() >> 56) as u8).collect();
    for b in 0..n {
        for &at in f16_at {
            let v = half::f16::from_f32(0.001 + (rng.next_u64() % 1000) as f32 * 1e-5).to_bits().to_le_bytes();
            bytes[b * size + at..b * size + at + 2].copy_from_slice(&v);
        }
    }
    bytes
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let (acts, threads, repeats) =
        (*args.first().unwrap_or(&512), *args.get(1).unwrap_or(&2), *args.get(2).unwrap_or(&5));
    let seq = *args.get(3).unwrap_or(&acts);
    let be = Backend::detect();
    let pool = Pool::new(threads);
    let mut rng = Rng::new(7);
    // (type, weight rows, width, f16 offsets): Gemma 3 270M's shapes.
    let shapes = [
        (TensorType::Q5_0, 2048, 640, &[0usize][..]),
        (TensorType::Q8_0, 2048, 640, &[0][..]),
        (TensorType::Q4K, 640, 2048, &[0, 2][..]),
        (TensorType::Q6K, 640, 2048, &[208][..]),
    ];
    for (ty, rows, cols, f16_at) in shapes {
        let nblocks = rows * cols / ty.block().0 as usize;
        let bytes = random_weights(&mut rng, ty, nblocks, f16_at);
        // Blocks need their type's alignment: copy into u64 storage.
        let mut store = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `store` holds at least `bytes.len()` bytes.
        let view = unsafe { std::slice::from_raw_parts_mut(store.as_mut_ptr() as *mut u8, bytes.len()) };
        view.copy_from_slice(&bytes);
        let w = QMatrix { rows, cols, data: QData::from_bytes(ty, view).expect("blocks") };
        let x: Vec<f32> = (0..acts * cols).map(|_| rng.normal()).collect();
        let mut q = QActs::default();
        quantize_acts(be, &pool, &x, acts, cols, &acts_for(&[&w]), &mut q);
        q.group_rows((0..acts).step_by(seq).map(|r0| ((acts - r0).min(seq), 0, (acts - r0).min(seq))));
        let mut out = vec![0f32; acts * rows];
        let mut best = f64::INFINITY;
        for _ in 0..repeats {
            let t = Instant::now();
            matmul(be, &pool, &w, &q, &mut out);
            best = best.min(t.elapsed().as_secs_f64());
        }
        let gmacs = (rows * cols * acts) as f64 / best / 1e9;
        println!(
            "{{\"type\":\"{ty}\",\"rows\":{rows},\"cols\":{cols},\"acts\":{acts},\"ms\":{:.3},\"gmac_per_s\":{gmacs:.2},\"check\":{}}}",
            best * 1e3,
            out.iter().map(|v| *v as f64).sum::<f64>()
        );
    }
}
