//! Scaled dot-product attention for one query position against a run of
//! cached keys and values (grouped-query: several query heads share one KV
//! head). The paged cache is gathered by the caller once per (sequence,
//! layer, KV head) and reused by every query position and query head of the
//! group: keys as rows `[position][dim]`, values transposed `[dim][position]`
//! so both products run along contiguous memory, as llama.cpp's do.

use crate::dot::Backend;
#[cfg(target_arch = "x86_64")]
use crate::ggml_avx2;
use crate::ggml_ref;
use crate::quant::round_f16;

/// Positions of transposed values are padded to a multiple of this (with
/// zeros), the unit of llama.cpp's f16 dot product.
pub const VALUE_PAD: usize = 32;

/// Summation order of the attention dot products, following llama.cpp:
/// a step with several query tokens of a sequence goes through tinyBLAS
/// (`Gemm`), a single token through `ggml_vec_dot_f16` (`VecDot`). Only the
/// last bits of the result differ; matching them keeps greedy decoding on
/// llama.cpp's path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SumOrder {
    Gemm,
    VecDot,
}

/// Gathered keys and values of one KV head.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    /// `[position][head_dim]`, at least `n_kv` rows.
    pub keys: &'a [f32],
    /// `[head_dim][stride]`; `stride` is a multiple of [`VALUE_PAD`] and
    /// positions from `n_kv` to `stride` hold zeros.
    pub values_t: &'a [f32],
    pub stride: usize,
    pub head_dim: usize,
}

/// `q` and `out` hold `group` heads of `head_dim` values; positions
/// `0..n_kv` of `kv` are visible.
pub fn attend_group(
    be: Backend,
    q: &[f32],
    kv: KvView<'_>,
    n_kv: usize,
    scale: f32,
    order: SumOrder,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_window(be, q, kv, 0..n_kv, scale, order, scores, out)
}

/// [`attend_group`] where only positions `visible` (a sliding window's
/// `first..n_kv`) are seen: the others are masked, as llama.cpp masks them.
#[allow(clippy::too_many_arguments)]
pub fn attend_window(
    be: Backend,
    q: &[f32],
    kv: KvView<'_>,
    visible: std::ops::Range<usize>,
    scale: f32,
    order: SumOrder,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (first, n_kv) = (visible.start, visible.end);
    assert!(first < n_kv, "attention over an empty window");
    let (hd, stride) = (kv.head_dim, kv.stride);
    assert!(n_kv <= stride && stride % VALUE_PAD == 0, "value stride must cover n_kv and be a multiple of {VALUE_PAD}");
    assert!(kv.keys.len() >= n_kv * hd && kv.values_t.len() >= hd * stride);
    assert_eq!(q.len(), out.len());
    let mut qh16 = [0f32; 256];
    assert!(hd <= qh16.len() && hd % 32 == 0, "head_dim must be a multiple of 32, at most 256");
    // llama.cpp's non-flash path multiplies the f16 cache by the query and
    // the probabilities rounded to f16; round the same way.
    let qr = &mut qh16[..hd];
    for (qh, oh) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)) {
        qr.iter_mut().zip(qh).for_each(|(r, v)| *r = round_f16(*v));
        // Masked positions are -inf, so they come out of the softmax as 0.
        scores.clear();
        scores.resize(stride, f32::NEG_INFINITY);
        for (j, s) in scores[..n_kv].iter_mut().enumerate().skip(first) {
            *s = dot_in_order(be, order, &kv.keys[j * hd..(j + 1) * hd], qr) * scale;
        }
        softmax_in_order(be, scores);
        scores.iter_mut().for_each(|p| *p = round_f16(*p));
        for (d, o) in oh.iter_mut().enumerate() {
            *o = dot_in_order(be, order, &kv.values_t[d * stride..(d + 1) * stride], scores);
        }
    }
}

/// Attention as llama.cpp's CPU flash-attention kernel computes it for one
/// query row (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`): the
/// query rounded to f16, each key's dot product in `ggml_vec_dot_f16`'s
/// order, an online softmax (`expf`), and the weighted values summed in an
/// f16 accumulator (rounded after every position), divided by the sum at
/// the end. `keys` and `values` are `[position][head_dim]`; `q` and `out`
/// hold `group` heads; positions `visible` are seen.
#[allow(clippy::too_many_arguments)]
pub fn attend_flash(
    be: Backend,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    head_dim: usize,
    visible: std::ops::Range<usize>,
    scale: f32,
    out: &mut [f32],
) {
    let hd = head_dim;
    assert!(visible.start < visible.end, "attention over an empty window");
    assert!(keys.len() >= visible.end * hd && values.len() >= visible.end * hd && hd.is_multiple_of(64) && hd <= 256);
    assert_eq!(q.len(), out.len());
    let mut qh16 = [0f32; 256];
    let mut acc = [0f32; 256];
    for (qh, oh) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)) {
        let qr = &mut qh16[..hd];
        qr.iter_mut().zip(qh).for_each(|(r, v)| *r = round_f16(*v));
        let acc = &mut acc[..hd];
        acc.fill(0.0);
        let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
        for j in visible.clone() {
            let s = dot_f16_order(be, &keys[j * hd..(j + 1) * hd], qr) * scale;
            let (mut ms, mut vs) = (1f32, 1f32);
            if s > m {
                ms = (m - s).exp();
                m = s;
                f16_accumulate(be, acc, None, ms);
            } else {
                vs = (s - m).exp();
            }
            f16_accumulate(be, acc, Some(&values[j * hd..(j + 1) * hd]), vs);
            sum = sum.mul_add(ms, vs);
        }
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        oh.iter_mut().zip(acc.iter()).for_each(|(o, a)| *o = a * inv);
    }
}

/// Positions per tile of llama.cpp's tiled flash attention (GGML_FA_TILE_KV),
/// and the query rows of a step from which llama.cpp uses it (GGML_FA_TILE_Q).
pub const FA_TILE_KV: usize = 64;
pub const FA_TILE_Q: usize = 64;

/// Attention as llama.cpp's tiled CPU flash-attention kernel computes one
/// query row (`ggml_compute_forward_flash_attn_ext_tiled`, the path for
/// steps of [`FA_TILE_Q`] rows or more): f32 queries, each score one FMA
/// chain over the head's dimensions, and per tile of [`FA_TILE_KV`]
/// positions (from position 0) the running maximum, an AVX-512 build's
/// `ggml_v_expf` and its sum in f64 by 16, and each value dimension one FMA
/// chain over the positions. `keys_t` is `[dim][stride]`, `values`
/// `[position][head_dim]`; `q` and `out` hold `group` heads.
#[allow(clippy::too_many_arguments)]
pub fn attend_flash_tiled(
    be: Backend,
    q: &[f32],
    keys_t: &[f32],
    stride: usize,
    values: &[f32],
    head_dim: usize,
    visible: std::ops::Range<usize>,
    scale: f32,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if be.has_avx2() {
        // SAFETY: an AVX2 backend has FMA; the same code, compiled with it.
        return unsafe { tiled_fma(q, keys_t, stride, values, head_dim, visible, scale, out) };
    }
    let _ = be;
    tiled(q, keys_t, stride, values, head_dim, visible, scale, out)
}

/// [`tiled`] compiled with FMA and AVX2 (the same operations in the same order).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tiled_fma(
    q: &[f32],
    keys_t: &[f32],
    stride: usize,
    values: &[f32],
    head_dim: usize,
    visible: std::ops::Range<usize>,
    scale: f32,
    out: &mut [f32],
) {
    tiled(q, keys_t, stride, values, head_dim, visible, scale, out)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tiled(
    q: &[f32],
    keys_t: &[f32],
    stride: usize,
    values: &[f32],
    head_dim: usize,
    visible: std::ops::Range<usize>,
    scale: f32,
    out: &mut [f32],
) {
    let hd = head_dim;
    assert!(visible.start < visible.end && visible.end <= stride, "attention over an empty window");
    assert!(keys_t.len() >= hd * stride && values.len() >= visible.end * hd && hd <= 256 && hd.is_multiple_of(LANES));
    assert!(stride.is_multiple_of(LANES) && q.len() == out.len() && q.len().is_multiple_of(hd));
    let t = Tiles { keys_t, stride, values, hd, visible, scale };
    // The heads of a group read the same keys and values: several at a
    // time share each load (each output's arithmetic is unchanged).
    let mut h0 = 0;
    let heads = q.len() / hd;
    while h0 < heads {
        let (qs, os) = (&q[h0 * hd..], &mut out[h0 * hd..]);
        h0 += match heads - h0 {
            n if n >= 4 => t.heads::<4>(qs, os),
            n if n >= 2 => t.heads::<2>(qs, os),
            _ => t.heads::<1>(qs, os),
        };
    }
}

/// Positions per score register and values per accumulator register of
/// [`tiled`] (16 f32: two AVX2 registers).
const LANES: usize = 16;

/// What every head of one query row reads in [`tiled`].
struct Tiles<'a> {
    keys_t: &'a [f32],
    stride: usize,
    values: &'a [f32],
    hd: usize,
    visible: std::ops::Range<usize>,
    scale: f32,
}

impl Tiles<'_> {
    /// Attention of `H` heads (`q[..H * hd]` into `out[..H * hd]`); returns `H`.
    #[inline(always)]
    fn heads<const H: usize>(&self, q: &[f32], out: &mut [f32]) -> usize {
        let hd = self.hd;
        let mut acc = [[0f32; 256]; H];
        let mut scores = [[0f32; FA_TILE_KV]; H];
        let (mut m, mut sum) = ([f32::NEG_INFINITY; H], [0f32; H]);
        for t0 in (0..self.visible.end).step_by(FA_TILE_KV) {
            let t1 = (t0 + FA_TILE_KV).min(self.visible.end);
            if t1 <= self.visible.start {
                continue;
            }
            self.scores::<H>(q, t0, t1, &mut scores);
            let mut live = [true; H];
            let mut rescale = [None; H];
            for h in 0..H {
                let scores = &mut scores[h];
                for (i, s) in scores.iter_mut().enumerate() {
                    let pos = t0 + i;
                    *s = if pos >= self.visible.start && pos < t1 { *s * self.scale } else { f32::NEG_INFINITY };
                }
                let tile_max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                if tile_max == f32::NEG_INFINITY {
                    live[h] = false;
                    continue;
                }
                let m_new = m[h].max(tile_max);
                if m_new > m[h] {
                    let ms = (m[h] - m_new).exp();
                    rescale[h] = Some(ms);
                    sum[h] *= ms;
                }
                m[h] = m_new;
                let mut tile_sum = 0f64;
                scores.iter_mut().for_each(|s| *s = ggml_ref::expf_x16(*s - m_new));
                for g in scores.chunks_exact(16) {
                    tile_sum += ggml_ref::reduce16(g) as f64;
                }
                sum[h] = (sum[h] as f64 + tile_sum) as f32;
            }
            if live.iter().all(|l| *l) {
                self.accumulate::<H>(&mut acc, &scores, &rescale, t0, t1);
            } else {
                for h in (0..H).filter(|h| live[*h]) {
                    let (a, p) = (std::array::from_mut(&mut acc[h]), std::array::from_ref(&scores[h]));
                    self.accumulate::<1>(a, p, &[rescale[h]], t0, t1);
                }
            }
        }
        for h in 0..H {
            let inv = if sum[h] == 0.0 { 0.0 } else { 1.0 / sum[h] };
            out[h * hd..(h + 1) * hd].iter_mut().zip(&acc[h]).for_each(|(o, a)| *o = a * inv);
        }
        H
    }

    /// Scores of positions `t0..t1` for `H` heads (the rest of each tile
    /// left as is, up to a multiple of [`LANES`]): for each, one FMA chain
    /// over the dimensions in order, from 0; [`LANES`] positions of every
    /// head at a time, each key load shared by the heads.
    #[inline(always)]
    fn scores<const H: usize>(&self, q: &[f32], t0: usize, t1: usize, out: &mut [[f32; FA_TILE_KV]; H]) {
        for j0 in (0..t1 - t0).step_by(LANES) {
            let mut o = [[0f32; LANES]; H];
            for d in 0..self.hd {
                // In bounds: t0 + j0 < stride, both multiples of LANES.
                let row: &[f32; LANES] = self.keys_t[d * self.stride + t0 + j0..][..LANES].try_into().expect("lanes");
                for h in 0..H {
                    let qd = q[h * self.hd + d];
                    o[h].iter_mut().zip(row).for_each(|(o, k)| *o = k.mul_add(qd, *o));
                }
            }
            for h in 0..H {
                out[h][j0..j0 + LANES].copy_from_slice(&o[h]);
            }
        }
    }

    /// `acc[h] = acc[h] * rescale[h]`, then for each position of `t0..t1`
    /// in order `acc[h] += values[pos] * p[h][pos - t0]`: each value
    /// dimension one FMA chain over the positions, [`LANES`] dimensions of
    /// every head kept in registers over the whole tile.
    #[inline(always)]
    fn accumulate<const H: usize>(
        &self,
        acc: &mut [[f32; 256]; H],
        p: &[[f32; FA_TILE_KV]; H],
        rescale: &[Option<f32>; H],
        t0: usize,
        t1: usize,
    ) {
        let hd = self.hd;
        for c in (0..hd).step_by(LANES) {
            let mut a: [[f32; LANES]; H] = std::array::from_fn(|h| acc[h][c..c + LANES].try_into().expect("lanes"));
            for h in 0..H {
                if let Some(ms) = rescale[h] {
                    a[h].iter_mut().for_each(|x| *x *= ms);
                }
            }
            for (i, pos) in (t0..t1).enumerate() {
                let v: &[f32; LANES] = self.values[pos * hd + c..][..LANES].try_into().expect("lanes");
                for h in 0..H {
                    let ph = p[h][i];
                    a[h].iter_mut().zip(v).for_each(|(a, x)| *a = x.mul_add(ph, *a));
                }
            }
            for h in 0..H {
                acc[h][c..c + LANES].copy_from_slice(&a[h]);
            }
        }
    }
}

/// The flash kernel's f16 accumulator update: `acc = f16(v * k + acc)`
/// (GGML's `ggml_vec_mad_f16`), or `acc = f16(acc * k)` without `v`
/// (`ggml_vec_scale_f16`); element by element, so any width gives the
/// same bits.
fn f16_accumulate(be: Backend, acc: &mut [f32], v: Option<&[f32]>, k: f32) {
    #[cfg(target_arch = "x86_64")]
    if be.has_avx2() && acc.len().is_multiple_of(8) {
        // SAFETY: an AVX2 backend has F16C and FMA; lengths checked.
        return unsafe { f16c::accumulate(acc, v, k) };
    }
    let _ = be;
    match v {
        Some(v) => acc.iter_mut().zip(v).for_each(|(a, x)| *a = round_f16(x.mul_add(k, *a))),
        None => acc.iter_mut().for_each(|a| *a = round_f16(*a * k)),
    }
}

/// `ggml_vec_dot_f16` of an AVX-512 build (the reference build of the
/// models that use flash attention), on whatever this CPU has.
fn dot_f16_order(be: Backend, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if be.has_avx2() {
        // SAFETY: an AVX2 backend means AVX2+FMA; lengths are multiples of 64 (head sizes of 64..256).
        return unsafe { ggml_avx2::dot_vec4_x16(a, b) };
    }
    let _ = be;
    ggml_ref::dot_vec4_x16(a, b)
}

fn dot_in_order(be: Backend, order: SumOrder, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if be.has_avx2() {
        // SAFETY: an AVX2 backend means AVX2+FMA; lengths are multiples of 32.
        return unsafe {
            match order {
                SumOrder::Gemm => ggml_avx2::dot_chain(a, b),
                SumOrder::VecDot => ggml_avx2::dot_vec4(a, b),
            }
        };
    }
    let _ = be;
    match order {
        SumOrder::Gemm => ggml_ref::dot_chain(a, b),
        SumOrder::VecDot => ggml_ref::dot_vec4(a, b),
    }
}

fn softmax_in_order(be: Backend, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if be.has_avx2() {
        // SAFETY: an AVX2 backend means AVX2+FMA; x.len() is a multiple of 32.
        return unsafe { ggml_avx2::softmax(x) };
    }
    let _ = be;
    ggml_ref::softmax(x)
}

/// Convert f16 bit patterns to f32 (hardware F16C where the CPU has it).
pub fn f16_to_f32_slice(src: &[half::f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if f16c() {
        // SAFETY: the CPU has AVX2 and F16C; the lengths are equal.
        return unsafe { f16c::to_f32(src, dst) };
    }
    use half::slice::HalfFloatSliceExt;
    src.convert_to_f32_slice(dst);
}

/// Convert `rows` rows of `width` f16 values (`src[s * width + d]`) to f32
/// columns: `dst[d * stride + col0 + s]` (values transposed for attention,
/// one row per cached position).
pub fn f16_rows_to_f32_columns(src: &[half::f16], width: usize, dst: &mut [f32], stride: usize, col0: usize) {
    assert_eq!(src.len() % width, 0);
    let rows = src.len() / width;
    assert!(col0 + rows <= stride && dst.len() >= (width - 1) * stride + col0 + rows);
    let mut s0 = 0;
    #[cfg(target_arch = "x86_64")]
    if f16c() && width.is_multiple_of(8) {
        s0 = rows - rows % 8;
        // SAFETY: the CPU has AVX2 and F16C; the bounds were checked above.
        unsafe { f16c::transpose8(&src[..s0 * width], width, dst, stride, col0) };
    }
    for s in s0..rows {
        for (d, v) in src[s * width..(s + 1) * width].iter().enumerate() {
            dst[d * stride + col0 + s] = v.to_f32();
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn f16c() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2, FMA and F16C; `acc.len()` a multiple of 8, `v` at least as long.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn accumulate(acc: &mut [f32], v: Option<&[f32]>, k: f32) {
        let kk = _mm256_set1_ps(k);
        for i in (0..acc.len()).step_by(8) {
            let a = _mm256_loadu_ps(acc.as_ptr().add(i));
            let r = match v {
                Some(v) => _mm256_fmadd_ps(_mm256_loadu_ps(v.as_ptr().add(i)), kk, a),
                None => _mm256_mul_ps(a, kk),
            };
            let rounded = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r));
            _mm256_storeu_ps(acc.as_mut_ptr().add(i), rounded);
        }
    }

    /// # Safety
    /// AVX2 and F16C; `src.len() == dst.len()`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn to_f32(src: &[half::f16], dst: &mut [f32]) {
        let n8 = src.len() - src.len() % 8;
        let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
        for i in (0..n8).step_by(8) {
            _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(_mm_loadu_si128(s.add(i) as *const __m128i)));
        }
        for i in n8..src.len() {
            dst[i] = src[i].to_f32();
        }
    }

    /// Whole groups of 8 rows, 8x8 tiles converted and transposed in registers.
    ///
    /// # Safety
    /// AVX2 and F16C; `src.len()` a multiple of `8 * width`, `width` of 8,
    /// and `dst` long enough for every column written.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn transpose8(src: &[half::f16], width: usize, dst: &mut [f32], stride: usize, col0: usize) {
        let rows = src.len() / width;
        let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
        for r0 in (0..rows).step_by(8) {
            for c0 in (0..width).step_by(8) {
                let v: [__m256; 8] = std::array::from_fn(|k| {
                    _mm256_cvtph_ps(_mm_loadu_si128(s.add((r0 + k) * width + c0) as *const __m128i))
                });
                for (k, col) in transpose(v).into_iter().enumerate() {
                    _mm256_storeu_ps(d.add((c0 + k) * stride + col0 + r0), col);
                }
            }
        }
    }

    /// 8x8 transpose: `out[j][i] = v[i][j]`.
    #[inline(always)]
    unsafe fn transpose(v: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(v[0], v[1]);
        let t1 = _mm256_unpackhi_ps(v[0], v[1]);
        let t2 = _mm256_unpacklo_ps(v[2], v[3]);
        let t3 = _mm256_unpackhi_ps(v[2], v[3]);
        let t4 = _mm256_unpacklo_ps(v[4], v[5]);
        let t5 = _mm256_unpackhi_ps(v[4], v[5]);
        let t6 = _mm256_unpacklo_ps(v[6], v[7]);
        let t7 = _mm256_unpackhi_ps(v[6], v[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}

/// Convert f32 to f16 (round to nearest even).
pub fn f32_to_f16_slice(src: &[f32], dst: &mut [half::f16]) {
    use half::slice::HalfFloatSliceExt;
    dst.convert_from_f32_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn matches_naive_attention() {
        let mut rng = Rng::new(21);
        let (group, hd, n) = (3, 64, 23);
        let q = rng.normal_vec(group * hd);
        let k = rng.normal_vec(n * hd);
        let v = rng.normal_vec(n * hd);
        let stride = n.next_multiple_of(VALUE_PAD);
        let mut vt = vec![0f32; hd * stride];
        for j in 0..n {
            for d in 0..hd {
                vt[d * stride + j] = v[j * hd + d];
            }
        }
        let kv = KvView { keys: &k, values_t: &vt, stride, head_dim: hd };
        let scale = 1.0 / (hd as f32).sqrt();
        for be in [Backend::Scalar, Backend::detect()] {
            for order in [SumOrder::Gemm, SumOrder::VecDot] {
                let mut out = vec![f32::NAN; group * hd];
                let mut scratch = Vec::new();
                attend_group(be, &q, kv, n, scale, order, &mut scratch, &mut out);
                for h in 0..group {
                    let s: Vec<f64> = (0..n)
                        .map(|j| (0..hd).map(|d| (q[h * hd + d] * k[j * hd + d]) as f64).sum::<f64>() * scale as f64)
                        .collect();
                    let m = s.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..hd {
                        let want: f64 = (0..n).map(|j| e[j] / z * v[j * hd + d] as f64).sum();
                        let got = out[h * hd + d] as f64;
                        // f16 rounding of q and of the probabilities.
                        assert!((want - got).abs() < 1e-2, "{be:?} {order:?} h={h} d={d}: {want} vs {got}");
                    }
                }
            }
        }
    }

    /// The transposing conversion puts every value where the scalar loop
    /// does, for row counts with and without a remainder of 8.
    /// Both flash kernels (one row, tiled) are attention over the visible
    /// window: near an f64 soft-max of the same scores, and the tiled one
    /// gives the same bits on every backend.
    #[test]
    fn flash_kernels_attend_over_the_window() {
        let mut rng = Rng::new(23);
        let (hd, n) = (64usize, 150usize);
        let q = rng.normal_vec(2 * hd);
        let keys = rng.normal_vec(n * hd);
        let values = rng.normal_vec(n * hd);
        let stride = n.next_multiple_of(VALUE_PAD);
        let mut keys_t = vec![0f32; hd * stride];
        for p in 0..n {
            for d in 0..hd {
                keys_t[d * stride + p] = keys[p * hd + d];
            }
        }
        for window in [0..n, 70..n, 0..1, 63..65] {
            let mut want = vec![0f64; 2 * hd];
            for h in 0..2 {
                let s: Vec<f64> = window
                    .clone()
                    .map(|p| (0..hd).map(|d| q[h * hd + d] as f64 * keys[p * hd + d] as f64).sum::<f64>() * 0.125)
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (i, p) in window.clone().enumerate() {
                    for d in 0..hd {
                        want[h * hd + d] += e[i] / z * values[p * hd + d] as f64;
                    }
                }
            }
            let mut tiled = vec![f32::NAN; 2 * hd];
            attend_flash_tiled(Backend::Scalar, &q, &keys_t, stride, &values, hd, window.clone(), 0.125, &mut tiled);
            let mut one = vec![f32::NAN; 2 * hd];
            attend_flash(Backend::Scalar, &q, &keys, &values, hd, window.clone(), 0.125, &mut one);
            for i in 0..2 * hd {
                assert!(
                    (tiled[i] as f64 - want[i]).abs() < 1e-4,
                    "tiled {window:?} [{i}]: {} vs {}",
                    tiled[i],
                    want[i]
                );
                // The one-row kernel rounds its accumulator to f16.
                assert!((one[i] as f64 - want[i]).abs() < 5e-3, "one-row {window:?} [{i}]: {} vs {}", one[i], want[i]);
            }
            for be in [Backend::Avx2, Backend::Avx512].into_iter().filter(|b| b.runs_here()) {
                let mut v = vec![f32::NAN; 2 * hd];
                attend_flash_tiled(be, &q, &keys_t, stride, &values, hd, window.clone(), 0.125, &mut v);
                assert_eq!(
                    v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    tiled.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
                let mut o = vec![f32::NAN; 2 * hd];
                attend_flash(be, &q, &keys, &values, hd, window.clone(), 0.125, &mut o);
                assert_eq!(
                    o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    one.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }

    /// The tiled kernel takes a group's heads several at a time: each head's
    /// output has the bits it has alone, on every backend.
    #[test]
    fn tiled_heads_together_give_each_head_s_bits() {
        let mut rng = Rng::new(29);
        let (hd, n, heads) = (64usize, 200usize, 7usize);
        let q = rng.normal_vec(heads * hd);
        let stride = n.next_multiple_of(VALUE_PAD);
        let keys_t = rng.normal_vec(hd * stride);
        let values = rng.normal_vec(n * hd);
        for be in [Backend::Scalar, Backend::Avx2, Backend::Avx512].into_iter().filter(|b| b.runs_here()) {
            for window in [0..n, 70..n, 130..131] {
                let mut all = vec![f32::NAN; heads * hd];
                attend_flash_tiled(be, &q, &keys_t, stride, &values, hd, window.clone(), 0.125, &mut all);
                for h in 0..heads {
                    let mut one = vec![f32::NAN; hd];
                    let qh = &q[h * hd..(h + 1) * hd];
                    attend_flash_tiled(be, qh, &keys_t, stride, &values, hd, window.clone(), 0.125, &mut one);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&all[h * hd..(h + 1) * hd]), bits(&one), "{be:?} {window:?} head {h}");
                }
            }
        }
    }

    #[test]
    fn expf_x16_is_expf() {
        for x in [-80.0f32, -20.0, -3.5, -1.0, -1e-3, 0.0, 0.7, 5.0] {
            let (got, want) = (crate::ggml_ref::expf_x16(x), x.exp());
            assert!((got - want).abs() <= want * 2e-6, "{x}: {got} vs {want}");
        }
        assert_eq!(crate::ggml_ref::expf_x16(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn f16_rows_to_columns_transposes() {
        let mut rng = Rng::new(4);
        for (rows, width) in [(16usize, 64usize), (13, 64), (5, 8), (9, 24)] {
            let src: Vec<half::f16> = rng.normal_vec(rows * width).into_iter().map(half::f16::from_f32).collect();
            let (stride, col0) = (rows + 7, 3);
            let mut dst = vec![f32::NAN; width * stride];
            f16_rows_to_f32_columns(&src, width, &mut dst, stride, col0);
            for s in 0..rows {
                for d in 0..width {
                    assert_eq!(dst[d * stride + col0 + s], src[s * width + d].to_f32(), "rows {rows} s {s} d {d}");
                }
            }
            let untouched = (0..width).flat_map(|d| (0..stride).map(move |c| (d, c)));
            for (d, c) in untouched.filter(|&(_, c)| c < col0 || c >= col0 + rows) {
                assert!(dst[d * stride + c].is_nan(), "wrote outside the columns: d {d} c {c}");
            }
            let mut flat = vec![0f32; rows * width];
            f16_to_f32_slice(&src, &mut flat);
            assert!(flat.iter().zip(&src).all(|(a, b)| *a == b.to_f32()));
        }
    }

    #[test]
    fn f16_roundtrip() {
        let x = [0.0f32, 1.5, -2.25, 65504.0, 1e-3];
        let mut h = [half::f16::ZERO; 5];
        f32_to_f16_slice(&x, &mut h);
        let mut back = [f32::NAN; 5];
        f16_to_f32_slice(&h, &mut back);
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() * 1e-3);
        }
    }
}
