//! Every block dequantizer against the `gguf` package's NumPy dequantizer,
//! bit for bit, on random blocks (`scripts/kquant_vectors.py` made the
//! vectors in `data/kquant_vectors.bin`).

use pdmesh_kernels::formats::{self, TensorType};
use pdmesh_kernels::matmul::QData;

/// (type, raw blocks, the values `gguf` dequantized them to).
fn cases() -> Vec<(TensorType, Vec<u8>, Vec<f32>)> {
    let data = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/kquant_vectors.bin")).expect("vectors");
    let mut out = Vec::new();
    let mut at = 0;
    let u32_at = |i: usize| u32::from_le_bytes(data[i..i + 4].try_into().expect("4 bytes"));
    while at < data.len() {
        let (id, n, size) = (u32_at(at), u32_at(at + 4) as usize, u32_at(at + 8) as usize);
        at += 12;
        let ty = TensorType::from_ggml_id(id).unwrap_or_else(|| panic!("unknown type id {id} in the vectors"));
        let (per_block, bytes) = ty.block();
        assert_eq!(bytes as usize, size, "{ty} block size");
        let raw = data[at..at + n * size].to_vec();
        at += n * size;
        let values: Vec<f32> = data[at..at + n * per_block as usize * 4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        at += values.len() * 4;
        out.push((ty, raw, values));
    }
    out
}

#[test]
fn dequantizers_equal_the_gguf_package_bit_for_bit() {
    let cases = cases();
    let mut seen = Vec::new();
    for (ty, raw, want) in &cases {
        if !ty.is_matmul_weight() {
            continue;
        }
        // Copy into u64-aligned storage, as a memory-mapped tensor is aligned.
        let mut buf = vec![0u64; raw.len().div_ceil(8)];
        // SAFETY: buf has at least raw.len() bytes.
        let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, raw.len()) };
        bytes.copy_from_slice(raw);
        let q = QData::from_bytes(*ty, bytes).expect("aligned blocks");
        let mut got = vec![f32::NAN; want.len()];
        q.dequantize(0, &mut got);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{ty} value {i}: {g} against gguf's {w}");
        }
        seen.push(*ty);
    }
    for ty in formats::ALL.into_iter().filter(|t| t.is_matmul_weight()) {
        assert!(seen.contains(&ty), "no vectors for {ty}");
    }
}
