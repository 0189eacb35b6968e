//! `Y = X · Wᵀ` for a quantized weight matrix W (`rows × cols`, one row per
//! output feature, GGML layout) and a batch of activation rows X.
//!
//! Activations are quantized to [`BlockQ8`] once per call site, then every
//! weight row is dotted against the batch in tiles of 32 activation rows
//! (which stay in L1) and groups of 4 (which share each unpacked weight
//! block). Output rows are split across the pool's threads.

use crate::dot::{self, Backend};
use crate::kdot;
use crate::kquant::*;
use crate::pool::{Pool, SyncPtr};
use crate::quant::{BlockQ4_1, BlockQ8, BlockQ8_0, QK};

/// Weight storage a matmul accepts.
#[derive(Clone, Copy, Debug)]
pub enum QData<'a> {
    Q4_1(&'a [BlockQ4_1]),
    Q8_0(&'a [BlockQ8_0]),
    Q5_0(&'a [BlockQ5_0]),
    Q5_1(&'a [BlockQ5_1]),
    Q2K(&'a [BlockQ2K]),
    Q3K(&'a [BlockQ3K]),
    Q4K(&'a [BlockQ4K]),
    Q5K(&'a [BlockQ5K]),
    Q6K(&'a [BlockQ6K]),
}

impl QData<'_> {
    /// Values per block.
    pub fn block_len(&self) -> usize {
        match self.acts() {
            ActKind::Q8 => QK,
            ActKind::Q8K => QK_K,
        }
    }

    /// Which activation blocks this weight type is dotted with (GGML's
    /// `vec_dot_type`).
    pub fn acts(&self) -> ActKind {
        match self {
            QData::Q4_1(_) | QData::Q8_0(_) | QData::Q5_0(_) | QData::Q5_1(_) => ActKind::Q8,
            _ => ActKind::Q8K,
        }
    }
}

/// The two forms of quantized activations: 32-value [`BlockQ8`] blocks
/// (for Q4_1, Q5_0, Q5_1, Q8_0 weights) and 256-value [`BlockQ8K`] blocks
/// (for the K-quants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActKind {
    Q8,
    Q8K,
}

/// A `rows × cols` block-quantized matrix, row-major.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: QData<'a>,
}

impl<'a> QMatrix<'a> {
    /// Blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / self.data.block_len()
    }
    pub fn kind(&self) -> &'static str {
        match self.data {
            QData::Q4_1(_) => "q4_1",
            QData::Q8_0(_) => "q8_0",
            QData::Q5_0(_) => "q5_0",
            QData::Q5_1(_) => "q5_1",
            QData::Q2K(_) => "q2_k",
            QData::Q3K(_) => "q3_k",
            QData::Q4K(_) => "q4_k",
            QData::Q5K(_) => "q5_k",
            QData::Q6K(_) => "q6_k",
        }
    }
}

/// Activation rows quantized for the integer dot products, in the forms
/// asked for ([`quantize_acts`]).
#[derive(Default)]
pub struct QActs {
    pub blocks: Vec<BlockQ8>,
    pub kblocks: Vec<BlockQ8K>,
    pub rows: usize,
    pub cols: usize,
    pub blocks_per_row: usize,
    /// Which forms hold this call's rows: [Q8, Q8K].
    has: [bool; 2],
    /// Rows that llama.cpp's repacked Q4_K GEMM would take: each
    /// sequence's rows from its first, in whole fours (the rest go through
    /// its GEMV, which sums in another order). All false unless the caller
    /// says, with [`QActs::group_rows`].
    pub gemm4: Vec<bool>,
    /// Rows of sequences of 8 rows or more: llama.cpp's tiled K-quant
    /// GEMM takes those (Q6_K here), its vec_dot the others.
    pub tiled8: Vec<bool>,
}

impl QActs {
    pub fn row(&self, r: usize) -> &[BlockQ8] {
        &self.blocks[r * self.blocks_per_row..(r + 1) * self.blocks_per_row]
    }
    pub fn krow(&self, r: usize) -> &[BlockQ8K] {
        let n = self.cols / QK_K;
        &self.kblocks[r * n..(r + 1) * n]
    }
    pub fn has(&self, kind: ActKind) -> bool {
        self.has[kind as usize]
    }

    /// Mark the rows that llama.cpp's 4-row Q4_K GEMM and tiled Q6_K GEMM
    /// would take. `items` are the sequences' rows (consecutive, in order):
    /// (rows, offset of the first in its step, the step's rows). llama.cpp
    /// takes the first `len - len % 4` rows of a step's sequence through the
    /// GEMM, and all of them through the tiled Q6_K GEMM when it has 8 or
    /// more; a step is what llama.cpp would run the rows in (see the engine's
    /// `BatchItem::shape`), so rows computed apart from the rest of their
    /// step keep its arithmetic.
    pub fn group_rows(&mut self, items: impl IntoIterator<Item = (usize, usize, usize)>) {
        self.gemm4.clear();
        self.tiled8.clear();
        for (rows, offset, len) in items {
            self.gemm4.extend((offset..offset + rows).map(|i| i < len - len % 4));
            self.tiled8.extend((0..rows).map(|_| len >= 8));
        }
        self.gemm4.resize(self.rows, false);
        self.tiled8.resize(self.rows, false);
    }
}

/// Quantize `rows` rows of `cols` f32 values (cols a multiple of 32) into `out`,
/// reusing its allocation, as 32-value [`BlockQ8`] blocks.
pub fn quantize_rows(be: Backend, pool: &Pool, x: &[f32], rows: usize, cols: usize, out: &mut QActs) {
    quantize_acts(be, pool, x, rows, cols, &[ActKind::Q8], out)
}

/// The activation forms that the weights `ws` take.
pub fn acts_for(ws: &[&QMatrix<'_>]) -> Vec<ActKind> {
    let mut kinds: Vec<ActKind> = ws.iter().map(|w| w.data.acts()).collect();
    kinds.dedup();
    if kinds.len() > 1 {
        kinds = vec![ActKind::Q8, ActKind::Q8K];
    }
    kinds
}

/// Quantize `rows` rows of `cols` values into each form of `kinds`
/// (Q8K needs `cols` a multiple of 256), reusing `out`'s allocations.
pub fn quantize_acts(
    be: Backend,
    pool: &Pool,
    x: &[f32],
    rows: usize,
    cols: usize,
    kinds: &[ActKind],
    out: &mut QActs,
) {
    assert_eq!(x.len(), rows * cols);
    out.rows = rows;
    out.cols = cols;
    out.has = [false; 2];
    out.gemm4.clear();
    out.gemm4.resize(rows, false);
    out.tiled8.clear();
    out.tiled8.resize(rows, false);
    let per_task = rows.div_ceil(pool.threads() * 2).max(1);
    for &kind in kinds {
        out.has[kind as usize] = true;
        match kind {
            ActKind::Q8 => {
                assert_eq!(cols % QK, 0, "activation width must be a multiple of {QK}");
                let nb = cols / QK;
                out.blocks.resize(rows * nb, BlockQ8::default());
                out.blocks_per_row = nb;
                let dst = SyncPtr::new(&mut out.blocks);
                pool.run(rows.div_ceil(per_task), |t| {
                    let (r0, r1) = (t * per_task, ((t + 1) * per_task).min(rows));
                    // SAFETY: tasks cover disjoint row ranges.
                    let o = unsafe { dst.slice(r0 * nb, (r1 - r0) * nb) };
                    dot::quantize_q8(be, &x[r0 * cols..r1 * cols], o);
                });
            }
            ActKind::Q8K => {
                assert_eq!(cols % QK_K, 0, "K-quant activation width must be a multiple of {QK_K}");
                let nb = cols / QK_K;
                out.kblocks.resize(rows * nb, BlockQ8K::default());
                let dst = SyncPtr::new(&mut out.kblocks);
                pool.run(rows.div_ceil(per_task), |t| {
                    let (r0, r1) = (t * per_task, ((t + 1) * per_task).min(rows));
                    // SAFETY: tasks cover disjoint row ranges.
                    let o = unsafe { dst.slice(r0 * nb, (r1 - r0) * nb) };
                    quantize_q8_k(&x[r0 * cols..r1 * cols], o);
                });
            }
        }
    }
}

/// Activation rows that share one pass over a weight row (a tuning knob,
/// reported on kernel spans).
pub const TILE_B: usize = 32;

/// Weight rows per slice kept in L1 while a tile of activations passes (a knob).
pub const ROW_SLICE: usize = 16;

/// `out[b * w.rows + r] = dot(W[r], X[b])` for every b in X and r in W.
pub fn matmul(be: Backend, pool: &Pool, w: &QMatrix<'_>, x: &QActs, out: &mut [f32]) {
    matmul_many(be, pool, [w], x, [out]);
}

/// [`matmul`] for several matrices that multiply the same activations
/// (a layer's Q, K and V; its gate and up projections), in one parallel
/// loop: one wait for the threads instead of one per matrix. Each output
/// is bit-identical to its own [`matmul`].
pub fn matmul_many<const N: usize>(be: Backend, pool: &Pool, ws: [&QMatrix<'_>; N], x: &QActs, outs: [&mut [f32]; N]) {
    for (w, out) in ws.iter().zip(&outs) {
        assert_eq!(x.cols, w.cols, "matmul width mismatch");
        assert!(x.has(w.data.acts()), "activations not quantized for {} weights", w.kind());
        assert_eq!(out.len(), x.rows * w.rows);
    }
    // Tasks of a multiple of 4 rows. A batch-1 product reads each weight
    // once and does little with it: each thread takes one contiguous share
    // of every matrix, one stream for the hardware prefetcher and one task
    // to claim (16 interleaved tasks halved its speed on small matrices on
    // a Zen 4). Larger batches get 8 tasks a thread, for balance.
    let split = if x.rows == 1 { 1 } else { 8 };
    let per_task = ws.map(|w| (w.rows.div_ceil(pool.threads() * split)).next_multiple_of(4).max(4));
    let mut first = [0usize; N];
    let mut n_tasks = 0;
    for i in 0..N {
        first[i] = n_tasks;
        n_tasks += ws[i].rows.div_ceil(per_task[i]);
    }
    let dsts = outs.map(|o| SyncPtr(o.as_mut_ptr()));
    pool.run(n_tasks, |t| {
        let i = first.iter().rposition(|&f| f <= t).unwrap_or(0);
        let (w, r0) = (ws[i], (t - first[i]) * per_task[i]);
        let r1 = (r0 + per_task[i]).min(w.rows);
        // Weight rows in slices that stay in L1 while a tile of activations passes.
        for rs in (r0..r1).step_by(ROW_SLICE) {
            let re = (rs + ROW_SLICE).min(r1);
            // Q5_0 against several columns: the slice widened to Q8_0 once
            // (the same integers and scales, so the Q8_0 kernels give the
            // Q5_0 kernels' bits) and multiplied by the Q8_0 kernels.
            if let (QData::Q5_0(bl), true) = (w.data, x.rows >= 4) {
                let nb = w.blocks_per_row();
                Q5_AS_Q8.with(|cell| {
                    let buf = &mut *cell.borrow_mut();
                    buf.resize((re - rs) * nb, BlockQ8_0 { d: 0, qs: [0; QK] });
                    crate::kquant::widen_q5_0(&bl[rs * nb..re * nb], buf);
                    let m = QMatrix { rows: re - rs, cols: w.cols, data: QData::Q8_0(buf) };
                    for b0 in (0..x.rows).step_by(TILE_B) {
                        let b1 = (b0 + TILE_B).min(x.rows);
                        // SAFETY: as below; `m`'s row 0 is `w`'s row `rs`.
                        unsafe { dot_rows_into(be, &m, 0, re - rs, x, b0, b1, SyncPtr(dsts[i].0.add(rs)), w.rows) };
                    }
                });
                continue;
            }
            for b0 in (0..x.rows).step_by(TILE_B) {
                let b1 = (b0 + TILE_B).min(x.rows);
                // SAFETY: each task writes only its own rows r0..r1 of every output row of matrix i.
                unsafe { dot_rows_into(be, w, rs, re, x, b0, b1, dsts[i], w.rows) };
            }
        }
    });
}

thread_local! {
    /// A slice of Q5_0 weight rows widened to Q8_0 (see [`matmul_many`]).
    static Q5_AS_Q8: std::cell::RefCell<Vec<BlockQ8_0>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Which matrix-product kernel [`matmul`] runs on `be` for a product with
/// `columns` activation rows (1: batch-1 decode), in words, for reports.
pub fn kernel_for(be: Backend, columns: usize) -> &'static str {
    match (be, columns) {
        (Backend::Avx512, 1) => "avx512-vnni pairs: 4 weight rows x 1 column per call",
        (Backend::Avx512, _) => "avx512-vnni pairs: 4 weight rows x 8 columns per call",
        (Backend::Avx2, 1) => "avx2 rows4: 4 weight rows x 1 column per call, their scales in one vector",
        (Backend::Avx2, _) => "avx2: 2 weight rows x 4 columns per call",
        (Backend::Scalar, _) => "scalar: 1 weight row x 1 column",
    }
}

/// Ask the CPU to start loading `count` weight blocks from `start`: rows are
/// short (a few hundred bytes), too short for the hardware prefetcher to
/// ramp up on before a tile is done with them.
#[inline(always)]
fn prefetch_rows<T>(blocks: &[T], start: usize, count: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let end = (start + count).min(blocks.len());
        if start >= end {
            return;
        }
        let base = blocks.as_ptr() as *const i8;
        let (from, to) = (start * std::mem::size_of::<T>(), end * std::mem::size_of::<T>());
        for off in (from..to).step_by(64) {
            // SAFETY: prefetch is a hint; the address is inside `blocks`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(off)) };
        }
    }
}

/// Dot weight rows `r0..r1` with activation rows `b0..b1`, writing
/// `out[b * stride + r]`.
///
/// # Safety
/// `dst` must be valid for every written index and not written by others.
#[allow(clippy::too_many_arguments)]
unsafe fn dot_rows_into(
    be: Backend,
    w: &QMatrix<'_>,
    r0: usize,
    r1: usize,
    x: &QActs,
    b0: usize,
    b1: usize,
    dst: SyncPtr<f32>,
    stride: usize,
) {
    let nb = w.blocks_per_row();
    // Groups: 4 columns x 2 rows while 4 columns remain, then 1 column x 4 rows.
    macro_rules! tile {
        ($f:path, $blocks:expr, $R:literal, $N:literal, $r:expr, $b:expr) => {{
            let rows: [_; $R] = std::array::from_fn(|i| &$blocks[($r + i) * nb..($r + i + 1) * nb]);
            prefetch_rows($blocks, ($r + $R) * nb, $R * nb);
            let xs: [&[BlockQ8]; $N] = std::array::from_fn(|i| x.row($b + i));
            let v = $f(rows, xs);
            for i in 0..$R {
                for j in 0..$N {
                    *dst.0.add(($b + j) * stride + $r + i) = v[i][j];
                }
            }
        }};
    }
    // Four columns at a time, `$RW` rows per call of `$wide`; then single
    // columns, `$RT` rows per call of `$tall`; leftover rows one by one
    // with `$one` (every kernel gives each output bit-identically).
    macro_rules! sweep {
        ($wide:path, $RW:literal, $NW:literal, $tall:path, $RT:literal, $one:path, $blocks:expr) => {{
            let mut b = b0;
            while b + $NW <= b1 {
                let mut r = r0;
                while r + $RW <= r1 {
                    tile!($wide, $blocks, $RW, $NW, r, b);
                    r += $RW;
                }
                while r < r1 {
                    tile!($one, $blocks, 1, $NW, r, b);
                    r += 1;
                }
                b += $NW;
            }
            while b + 4 <= b1 {
                let mut r = r0;
                while r + $RW <= r1 {
                    tile!($wide, $blocks, $RW, 4, r, b);
                    r += $RW;
                }
                while r < r1 {
                    tile!($one, $blocks, 1, 4, r, b);
                    r += 1;
                }
                b += 4;
            }
            while b < b1 {
                let mut r = r0;
                while r + $RT <= r1 {
                    tile!($tall, $blocks, $RT, 1, r, b);
                    r += $RT;
                }
                while r < r1 {
                    tile!($one, $blocks, 1, 1, r, b);
                    r += 1;
                }
                b += 1;
            }
        }};
    }
    macro_rules! scalar_sweep {
        ($f:path, $blocks:expr) => {{
            for r in r0..r1 {
                for b in b0..b1 {
                    *dst.0.add(b * stride + r) = $f(&$blocks[r * nb..(r + 1) * nb], [x.row(b)])[0];
                }
            }
        }};
    }
    match (be, w.data) {
        // A product with one activation row (batch-1 decode) has its own
        // path, 4 weight rows per call: on AVX-512 the VNNI pair kernel
        // (1.13-1.20x the AVX2 single-row kernel on a Sapphire Rapids VM),
        // on AVX2 the four-row kernels (scales of all four rows converted
        // at once). The same bits either way.
        #[cfg(target_arch = "x86_64")]
        (Backend::Avx512 | Backend::Avx2, QData::Q4_1(_) | QData::Q8_0(_)) if x.rows == 1 => {
            single_column(be, w, r0, r1, x, dst)
        }
        // Leftover single columns of a batch stay on the AVX2 kernel.
        #[cfg(target_arch = "x86_64")]
        (Backend::Avx512, QData::Q4_1(blocks)) => {
            use dot::{avx2::dot_q4_1 as one, avx512::dot_pairs};
            sweep!(dot_pairs::<BlockQ4_1, _, _>, 4, 8, one, 4, one, blocks)
        }
        #[cfg(target_arch = "x86_64")]
        (Backend::Avx512, QData::Q8_0(blocks)) => {
            use dot::{avx2::dot_q8_0 as one, avx512::dot_pairs};
            sweep!(dot_pairs::<BlockQ8_0, _, _>, 4, 8, one, 4, one, blocks)
        }
        #[cfg(target_arch = "x86_64")]
        (Backend::Avx2, QData::Q4_1(blocks)) => {
            use dot::avx2::dot_q4_1 as f;
            sweep!(f, 2, 4, f, 4, f, blocks)
        }
        #[cfg(target_arch = "x86_64")]
        (Backend::Avx2, QData::Q8_0(blocks)) => {
            use dot::avx2::dot_q8_0 as f;
            sweep!(f, 2, 4, f, 4, f, blocks)
        }
        (_, QData::Q4_1(blocks)) => scalar_sweep!(dot::scalar::dot_q4_1, blocks),
        (_, QData::Q8_0(blocks)) => scalar_sweep!(dot::scalar::dot_q8_0, blocks),
        _ => row_sweep(be, w, r0, r1, x, b0, b1, dst, stride),
    }
}

/// [`dot_rows_into`] for the K-quants and the 5-bit types: one weight row
/// at a time against four activation rows, then single ones (the same
/// bits either way).
///
/// # Safety
/// As [`dot_rows_into`].
#[allow(clippy::too_many_arguments)]
unsafe fn row_sweep(
    be: Backend,
    w: &QMatrix<'_>,
    r0: usize,
    r1: usize,
    x: &QActs,
    b0: usize,
    b1: usize,
    dst: SyncPtr<f32>,
    stride: usize,
) {
    let nb = w.blocks_per_row();
    macro_rules! sweep {
        ($f:expr, $blocks:expr, $row:ident) => {{
            for r in r0..r1 {
                let wr = &$blocks[r * nb..(r + 1) * nb];
                let mut b = b0;
                while b + 4 <= b1 {
                    let v = $f(wr, std::array::from_fn::<_, 4, _>(|i| x.$row(b + i)));
                    for (i, vi) in v.iter().enumerate() {
                        *dst.0.add((b + i) * stride + r) = *vi;
                    }
                    b += 4;
                }
                for b in b..b1 {
                    *dst.0.add(b * stride + r) = $f(wr, [x.$row(b)])[0];
                }
            }
        }};
    }
    // Q4_K and Q6_K: each activation row in the order llama.cpp would use
    // for it (`QActs::group_rows`); runs of rows with the same order go
    // four at a time.
    macro_rules! by_order {
        ($bl:expr, $flags:expr, $yes:expr, $no:expr) => {{
            for r in r0..r1 {
                let wr = &$bl[r * nb..(r + 1) * nb];
                let mut b = b0;
                while b < b1 {
                    let flag = $flags[b];
                    if b + 4 <= b1 && $flags[b..b + 4].iter().all(|f| *f == flag) {
                        let y: [&[BlockQ8K]; 4] = std::array::from_fn(|i| x.krow(b + i));
                        let v = if flag { $yes(wr, y) } else { $no(wr, y) };
                        for (i, vi) in v.iter().enumerate() {
                            *dst.0.add((b + i) * stride + r) = *vi;
                        }
                        b += 4;
                    } else {
                        let y = [x.krow(b)];
                        *dst.0.add(b * stride + r) = if flag { $yes(wr, y)[0] } else { $no(wr, y)[0] };
                        b += 1;
                    }
                }
            }
            return;
        }};
    }
    #[cfg(target_arch = "x86_64")]
    if be.has_avx2() {
        use kdot::avx2 as v;
        match w.data {
            QData::Q4K(bl) => by_order!(bl, x.gemm4, v::dot_q4_k::<true, _>, v::dot_q4_k::<false, _>),
            QData::Q6K(bl) => by_order!(bl, x.tiled8, v::dot_q6_k_tiled, v::dot_q6_k),
            _ => {}
        }
    }
    {
        use kdot::scalar as s;
        match w.data {
            QData::Q4K(bl) => by_order!(bl, x.gemm4, s::dot_q4_k::<true, _>, s::dot_q4_k::<false, _>),
            QData::Q6K(bl) => by_order!(bl, x.tiled8, s::dot_q6_k_tiled, s::dot_q6_k),
            _ => {}
        }
    }
    #[cfg(target_arch = "x86_64")]
    if be.has_avx2() {
        use kdot::avx2 as v;
        if let QData::Q5_0(bl) = w.data {
            return sweep!(v::dot_q5_0, bl, row);
        }
    }
    let _ = be;
    use kdot::scalar as s;
    match w.data {
        QData::Q5K(bl) => sweep!(s::dot_q5_k, bl, krow),
        QData::Q3K(bl) => sweep!(s::dot_q3_k, bl, krow),
        QData::Q2K(bl) => sweep!(s::dot_q2_k, bl, krow),
        QData::Q5_0(bl) => sweep!(s::dot_q5_0, bl, row),
        QData::Q5_1(bl) => sweep!(s::dot_q5_1, bl, row),
        QData::Q4_1(_) | QData::Q8_0(_) | QData::Q4K(_) | QData::Q6K(_) => {
            unreachable!("Q4_1, Q8_0, Q4_K and Q6_K have their own sweeps")
        }
    }
}

/// [`dot_rows_into`] for a product with one activation row (batch-1
/// decode): weight rows `r0..r1` four at a time through the backend's
/// four-row kernel, leftovers one by one with the AVX2 kernel
/// (bit-identical).
///
/// # Safety
/// As [`dot_rows_into`]; the CPU must run `be` (AVX2 or better).
#[cfg(target_arch = "x86_64")]
#[inline(never)]
unsafe fn single_column(be: Backend, w: &QMatrix<'_>, r0: usize, r1: usize, x: &QActs, dst: SyncPtr<f32>) {
    let nb = w.blocks_per_row();
    macro_rules! run {
        ($four:path, $one:path, $blocks:expr) => {{
            let xs = [x.row(0)];
            let mut r = r0;
            while r + 4 <= r1 {
                let rows: [_; 4] = std::array::from_fn(|i| &$blocks[(r + i) * nb..(r + i + 1) * nb]);
                // The next tile streams in while this one computes.
                let v = $four(rows, xs, Ahead::tile($blocks, (r + 4) * nb, 4 * nb, 4));
                for (i, vi) in v.iter().enumerate() {
                    *dst.0.add(r + i) = vi[0];
                }
                r += 4;
            }
            for r in r..r1 {
                *dst.0.add(r) = $one([&$blocks[r * nb..(r + 1) * nb]], xs)[0][0];
            }
        }};
    }
    use dot::avx2::{dot_q4_1, dot_q4_1_rows4, dot_q8_0, dot_q8_0_rows4};
    use dot::{avx512::dot_pairs_ahead, Ahead};
    match (be, w.data) {
        (Backend::Avx512, QData::Q4_1(blocks)) => run!(dot_pairs_ahead::<BlockQ4_1, 4, 1>, dot_q4_1, blocks),
        (Backend::Avx512, QData::Q8_0(blocks)) => run!(dot_pairs_ahead::<BlockQ8_0, 4, 1>, dot_q8_0, blocks),
        (_, QData::Q4_1(blocks)) => run!(dot_q4_1_rows4, dot_q4_1, blocks),
        (_, QData::Q8_0(blocks)) => run!(dot_q8_0_rows4, dot_q8_0, blocks),
        _ => unreachable!("only Q4_1 and Q8_0 take the single-column path"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_q4_1, quantize_q4_1};
    use crate::testutil::Rng;

    /// Every backend this CPU has gives the scalar reference's bits, for
    /// row counts and batches that leave remainders in every tile shape.
    #[test]
    fn every_backend_gives_the_scalar_bits() {
        let all = [Backend::Avx2, Backend::Avx512];
        let here: Vec<Backend> = all.into_iter().filter(|b| b.runs_here()).collect();
        if here.len() < all.len() {
            eprintln!("SKIPPED in part: this CPU runs only {here:?} of {all:?} beside the scalar reference");
        }
        let pool = Pool::new(2);
        let mut rng = Rng::new(5);
        for (rows, cols) in [(37usize, 96usize), (64, 576)] {
            let w = rng.normal_vec(rows * cols);
            let mut w41 = vec![BlockQ4_1::default(); rows * cols / QK];
            quantize_q4_1(&w, &mut w41);
            let mut w80 = vec![BlockQ8_0 { d: 0, qs: [0; QK] }; rows * cols / QK];
            crate::quant::quantize_q8_0(&w, &mut w80);
            let matrices = [QData::Q4_1(&w41), QData::Q8_0(&w80)].map(|data| QMatrix { rows, cols, data });
            for (m, batch) in matrices.iter().flat_map(|m| [1usize, 3, 4, 9, 33].map(|b| (m, b))) {
                let x = rng.normal_vec(batch * cols);
                let run = |be: Backend| {
                    let mut qa = QActs::default();
                    quantize_rows(be, &pool, &x, batch, cols, &mut qa);
                    let mut out = vec![f32::NAN; batch * rows];
                    matmul(be, &pool, m, &qa, &mut out);
                    out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
                };
                let want = run(Backend::Scalar);
                for be in &here {
                    let kind = m.kind();
                    assert!(
                        run(*be) == want,
                        "{be:?} differs from the scalar reference: {kind} {rows}x{cols}, batch {batch}"
                    );
                }
            }
        }
    }

    /// The K-quant and 5-bit products: every backend gives the scalar
    /// bits, for batches with remainders, with both activation forms made.
    #[test]
    fn k_quant_products_give_the_scalar_bits_on_every_backend() {
        use crate::testutil::random_blocks;
        let pool = Pool::new(2);
        let mut rng = Rng::new(17);
        let (rows, cols) = (13usize, 512usize);
        let q4k: Vec<BlockQ4K> = random_blocks(&mut rng, rows * 2, &[0, 2]);
        let q6k: Vec<BlockQ6K> = random_blocks(&mut rng, rows * 2, &[208]);
        let q5k: Vec<BlockQ5K> = random_blocks(&mut rng, rows * 2, &[0, 2]);
        let q50: Vec<BlockQ5_0> = random_blocks(&mut rng, rows * 16, &[0]);
        let q51: Vec<BlockQ5_1> = random_blocks(&mut rng, rows * 16, &[0, 2]);
        let datas = [QData::Q4K(&q4k), QData::Q6K(&q6k), QData::Q5K(&q5k), QData::Q5_0(&q50), QData::Q5_1(&q51)];
        for data in datas {
            let m = QMatrix { rows, cols, data };
            for batch in [1usize, 5, 9] {
                let x = rng.normal_vec(batch * cols);
                let run = |be: Backend| {
                    let mut qa = QActs::default();
                    quantize_acts(be, &pool, &x, batch, cols, &acts_for(&[&m]), &mut qa);
                    let mut out = vec![f32::NAN; batch * rows];
                    matmul(be, &pool, &m, &qa, &mut out);
                    out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
                };
                let want = run(Backend::Scalar);
                assert!(want.iter().all(|b| !f32::from_bits(*b).is_nan()), "{} left a cell unwritten", m.kind());
                // Q5_0 widened to Q8_0 for several columns gives the Q5_0 kernel's bits.
                if let QData::Q5_0(bl) = m.data {
                    let mut qa = QActs::default();
                    quantize_acts(Backend::Scalar, &pool, &x, batch, cols, &[ActKind::Q8], &mut qa);
                    for b in 0..batch {
                        for r in 0..rows {
                            let direct = crate::kdot::scalar::dot_q5_0(&bl[r * 16..(r + 1) * 16], [qa.row(b)])[0];
                            assert_eq!(want[b * rows + r], direct.to_bits(), "q5_0 row {r} column {b}");
                        }
                    }
                }
                for be in [Backend::Avx2, Backend::Avx512].into_iter().filter(|b| b.runs_here()) {
                    assert!(run(be) == want, "{be:?} differs from scalar: {} batch {batch}", m.kind());
                }
            }
        }
    }

    /// Matrices multiplied together give each one's own product, bits and all.
    #[test]
    fn matmul_many_equals_one_matmul_each() {
        let pool = Pool::new(2);
        let mut rng = Rng::new(9);
        let cols = 96;
        let shapes = [37usize, 8, 64];
        let ws: Vec<Vec<BlockQ4_1>> = shapes
            .iter()
            .map(|&rows| {
                let mut q = vec![BlockQ4_1::default(); rows * cols / QK];
                quantize_q4_1(&rng.normal_vec(rows * cols), &mut q);
                q
            })
            .collect();
        let ms: Vec<QMatrix> =
            shapes.iter().zip(&ws).map(|(&rows, w)| QMatrix { rows, cols, data: QData::Q4_1(w) }).collect();
        for be in [Backend::Scalar, Backend::detect()] {
            for batch in [1usize, 5] {
                let mut qa = QActs::default();
                quantize_rows(be, &pool, &rng.normal_vec(batch * cols), batch, cols, &mut qa);
                let mut outs: Vec<Vec<f32>> = shapes.iter().map(|r| vec![f32::NAN; r * batch]).collect();
                let [a, b, c] = &mut outs[..] else { unreachable!() };
                matmul_many(be, &pool, [&ms[0], &ms[1], &ms[2]], &qa, [a, b, c]);
                for (m, got) in ms.iter().zip(&outs) {
                    let mut want = vec![f32::NAN; m.rows * batch];
                    matmul(be, &pool, m, &qa, &mut want);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(got), bits(&want), "{be:?} {} rows, batch {batch}", m.rows);
                }
            }
        }
    }

    #[test]
    fn matmul_matches_naive_float_reference_for_any_batch() {
        let pool = Pool::new(2);
        let mut rng = Rng::new(3);
        let (rows, cols) = (37, 96);
        let w = rng.normal_vec(rows * cols);
        let mut wq = vec![BlockQ4_1::default(); rows * cols / QK];
        quantize_q4_1(&w, &mut wq);
        let mut wd = vec![0f32; rows * cols];
        dequantize_q4_1(&wq, &mut wd);
        let m = QMatrix { rows, cols, data: QData::Q4_1(&wq) };
        for be in [Backend::Scalar, Backend::detect()] {
            for batch in [1usize, 3, 4, 33, 70] {
                let x = rng.normal_vec(batch * cols);
                let mut qa = QActs::default();
                quantize_rows(be, &pool, &x, batch, cols, &mut qa);
                // Poison the output so unwritten cells show up.
                let mut out = vec![f32::NAN; batch * rows];
                matmul(be, &pool, &m, &qa, &mut out);
                for b in 0..batch {
                    for r in 0..rows {
                        let exact: f32 = (0..cols).map(|c| wd[r * cols + c] * x[b * cols + c]).sum();
                        let got = out[b * rows + r];
                        // 8-bit activations: error bounded relative to the norms.
                        let nw: f32 = wd[r * cols..(r + 1) * cols].iter().map(|v| v * v).sum();
                        let nx: f32 = x[b * cols..(b + 1) * cols].iter().map(|v| v * v).sum();
                        let tol = 0.02 * (nw * nx).sqrt();
                        assert!((exact - got).abs() < tol, "{be:?} b={b} r={r}: {exact} vs {got}");
                    }
                }
                // A row computed alone equals the same row computed in the batch.
                let mut qa1 = QActs::default();
                quantize_rows(be, &pool, &x[(batch - 1) * cols..], 1, cols, &mut qa1);
                let mut out1 = vec![f32::NAN; rows];
                matmul(be, &pool, &m, &qa1, &mut out1);
                assert_eq!(&out1[..], &out[(batch - 1) * rows..]);
            }
        }
    }
}
