//! Paged KV cache: one arena of fixed-size blocks, each holding `block_size`
//! positions of every layer's keys and values in f16.
//!
//! A block is the unit that moves between processes: a sequence's KV is the
//! concatenation of its blocks' bytes, in block-table order. Inside a block
//! the layout is `[layer][k|v][kv_head][slot][head_dim]`, so one head's keys
//! for the block's positions are contiguous (what attention reads), and a
//! whole block is one contiguous byte range (what a transfer writes).

use half::f16;
use serde::{Deserialize, Serialize};

use crate::blocks::{Blocks, PrefixConfig};
use crate::error::{EngineError, Result};

/// Shape of the cache; two caches can exchange blocks only if equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl KvLayout {
    /// f16 values per block.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.n_layers * 2 * self.n_kv_heads * self.head_dim
    }
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * 2
    }
    /// Element offset of (layer, k=0/v=1, head, slot) inside a block.
    #[inline]
    pub fn offset_in_block(&self, layer: usize, kv: usize, head: usize, slot: usize) -> usize {
        (((layer * 2 + kv) * self.n_kv_heads + head) * self.block_size + slot) * self.head_dim
    }
    /// Blocks needed for `n` positions.
    pub fn blocks_for(&self, n: usize) -> usize {
        n.div_ceil(self.block_size)
    }

    /// The blocks of `blocks` that hold `n_tokens` positions (an error if too few).
    pub fn covering<'b>(&self, blocks: &'b [u32], n_tokens: usize) -> Result<&'b [u32]> {
        let need = self.blocks_for(n_tokens);
        blocks.get(..need).ok_or_else(|| {
            EngineError::KvMismatch(format!("{n_tokens} tokens need {need} blocks, sequence has {}", blocks.len()))
        })
    }
}

/// A sequence's KV in transferable form: the bytes of its blocks, in order,
/// plus what the receiver needs to check and use them.
#[derive(Clone, Debug, PartialEq)]
pub struct KvBlob {
    pub layout: KvLayout,
    /// Positions filled (the rest of the last block is padding).
    pub n_tokens: usize,
    pub bytes: Vec<u8>,
}

/// Have the kernel back `blocks` of a host KV arena (`arena`: address and
/// length, as [`KvCache::arena`] gives them) with memory now, writable,
/// without touching their contents (`MADV_POPULATE_WRITE`). A receiver
/// calls it when it reserves blocks for a transfer, off its engine thread:
/// otherwise the first write into each untouched page faults on the
/// transfer's path (through NIXL's cross-process copy the 59 blocks of a
/// 940-token prompt took 66 ms instead of 6). Safe on blocks in use (the
/// contents stay as they are); best effort (an older kernel refuses it).
pub fn prefault_blocks(arena: (usize, usize), block_bytes: usize, blocks: &[u32]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        let mut i = 0;
        while i < sorted.len() {
            // One call per run of consecutive blocks.
            let mut j = i + 1;
            while j < sorted.len() && sorted[j] == sorted[j - 1] + 1 {
                j += 1;
            }
            let lo = arena.0 + sorted[i] as usize * block_bytes;
            let hi = (arena.0 + (sorted[j - 1] as usize + 1) * block_bytes).min(arena.0 + arena.1);
            let start = lo & !(PAGE - 1);
            if hi > start {
                // SAFETY: the range lies within the arena this process
                // allocated (rounded down to its page); MADV_POPULATE_WRITE
                // only maps pages, it never changes what they hold.
                unsafe {
                    libc::madvise(start as *mut libc::c_void, hi - start, libc::MADV_POPULATE_WRITE);
                }
            }
            i = j;
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (arena, block_bytes, blocks);
}

/// CRC-32C of each `block_bytes`-long block of `bytes`, in order: what a
/// KV transfer's sender computes and its receiver checks.
pub fn block_checksums(bytes: &[u8], block_bytes: usize) -> Vec<u32> {
    bytes.chunks(block_bytes.max(1)).map(crc32c::crc32c).collect()
}

/// [`block_checksums`] of a byte stream that arrives in pieces of any size
/// (a TCP transfer's chunks): each block's CRC-32C is taken as its bytes
/// come in, overlapping the rest of the transfer.
pub struct StreamChecksums {
    block_bytes: usize,
    sums: Vec<u32>,
    cur: u32,
    filled: usize,
}

impl StreamChecksums {
    pub fn new(block_bytes: usize) -> StreamChecksums {
        StreamChecksums { block_bytes: block_bytes.max(1), sums: Vec::new(), cur: 0, filled: 0 }
    }

    pub fn push(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let take = (self.block_bytes - self.filled).min(data.len());
            self.cur = crc32c::crc32c_append(self.cur, &data[..take]);
            self.filled += take;
            data = &data[take..];
            if self.filled == self.block_bytes {
                self.sums.push(self.cur);
                (self.cur, self.filled) = (0, 0);
            }
        }
    }

    /// The checksums, a partly filled last block included.
    pub fn finish(mut self) -> Vec<u32> {
        if self.filled > 0 {
            self.sums.push(self.cur);
        }
        self.sums
    }
}

/// Check blocks' checksums as received (`got`) against the sender's:
/// `KvCorrupt` names the first block that differs, or a count that does.
pub fn verify_checksums(got: &[u32], expected: &[u32]) -> Result<()> {
    if let Some(i) = got.iter().zip(expected).position(|(g, e)| g != e) {
        return Err(EngineError::KvCorrupt(format!(
            "block {i} of {} has CRC-32C {:08x}, the sender's was {:08x}",
            expected.len(),
            got[i],
            expected[i]
        )));
    }
    if got.len() != expected.len() {
        return Err(EngineError::KvCorrupt(format!(
            "{} blocks arrived, the sender checksummed {}",
            got.len(),
            expected.len()
        )));
    }
    Ok(())
}

// The wire format is little-endian f16; on little-endian hosts that is the
// in-memory representation, so blocks move with a plain copy.
#[cfg(not(target_endian = "little"))]
compile_error!("the KV wire format assumes a little-endian host");

fn f16_bytes(v: &[f16]) -> &[u8] {
    // SAFETY: f16 is a 2-byte plain value with no padding.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 2) }
}

fn f16_bytes_mut(v: &mut [f16]) -> &mut [u8] {
    // SAFETY: as above; every bit pattern is a valid f16.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 2) }
}

/// Ask for transparent huge pages over the arena (fewer TLB misses, and
/// fewer pages for a transport to pin); a no-op where the OS says no.
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (ptr as usize).div_ceil(HUGE) * HUGE;
        let end = (ptr as usize + len) / HUGE * HUGE;
        if end > start {
            // SAFETY: madvise only gives the kernel a hint about pages we own.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// A zeroed arena from the allocator's zeroed pages: untouched blocks cost
/// no resident memory, so RSS follows the blocks actually used.
fn zeroed_f16(n: usize) -> Vec<f16> {
    let v = vec![0u16; n];
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: f16 is repr(transparent) over u16: same size, alignment and
    // validity, so the allocation can change element type in place.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr() as *mut f16, v.len(), v.capacity()) }
}

/// What of a transfer's blocks the receiver reads, so what a transfer
/// moves and checksums: every block whole, except that the first `trimmed`
/// lie wholly before every sliding window's reach from the receiver's next
/// position, and of those only the byte ranges `kept` (the global layers')
/// are read. A model without windows trims nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shipped {
    pub trimmed: usize,
    pub kept: Vec<std::ops::Range<usize>>,
}

impl Shipped {
    /// The byte ranges of block `i` (of blocks `block_bytes` long) that move.
    pub fn ranges(&self, i: usize, block_bytes: usize) -> Vec<std::ops::Range<usize>> {
        if i < self.trimmed {
            self.kept.clone()
        } else {
            std::iter::once(0..block_bytes).collect()
        }
    }

    /// Bytes moved for `n_blocks` blocks.
    pub fn bytes(&self, n_blocks: usize, block_bytes: usize) -> usize {
        let kept: usize = self.kept.iter().map(|r| r.len()).sum();
        let t = self.trimmed.min(n_blocks);
        t * kept + (n_blocks - t) * block_bytes
    }
}

impl KvLayout {
    /// What a transfer of `n_tokens` positions moves ([`Shipped`]), for a
    /// model whose layer `l` attends over `windows[l]` positions (None:
    /// all). The receiver's next query is at position `n_tokens`; a window
    /// of `w` sees from `n_tokens + 1 - w`, so a block whose last position
    /// is before that is read by the global layers only.
    pub fn shipped(&self, windows: &[Option<usize>], n_tokens: usize) -> Shipped {
        let Some(w) = windows.iter().flatten().max() else { return Shipped::default() };
        let first_seen = (n_tokens + 1).saturating_sub(*w);
        let trimmed = first_seen / self.block_size;
        let layer_bytes = self.block_bytes() / self.n_layers;
        let mut kept: Vec<std::ops::Range<usize>> = Vec::new();
        for (l, _) in windows.iter().enumerate().filter(|(_, w)| w.is_none()) {
            let r = l * layer_bytes..(l + 1) * layer_bytes;
            match kept.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => kept.push(r),
            }
        }
        Shipped { trimmed, kept }
    }
}

pub struct KvCache {
    pub layout: KvLayout,
    /// Each layer's sliding window (None: global), for what transfers move.
    windows: Vec<Option<usize>>,
    data: Vec<f16>,
    /// Which blocks are free, held or cached for prefix reuse.
    pub blocks: Blocks,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("layout", &self.layout)
            .field("used", &self.used())
            .field("total", &self.total())
            .finish()
    }
}

impl KvCache {
    /// An arena of `n_blocks` with no prefix cache.
    pub fn new(layout: KvLayout, n_blocks: usize) -> KvCache {
        KvCache::with_prefix(layout, n_blocks, None)
    }

    /// An arena whose full prompt blocks are kept for reuse as `prefix` says.
    pub fn with_prefix(layout: KvLayout, n_blocks: usize, prefix: Option<PrefixConfig>) -> KvCache {
        let data = zeroed_f16(layout.block_elems() * n_blocks);
        advise_huge_pages(data.as_ptr() as *mut u8, data.len() * 2);
        KvCache { layout, windows: Vec::new(), data, blocks: Blocks::new(n_blocks, prefix) }
    }

    /// The arena's address and size in bytes: block `b` occupies
    /// `[addr + b * block_bytes, addr + (b + 1) * block_bytes)`. The arena
    /// never moves, so a transport may register it once and move blocks in
    /// and out of it directly (only blocks of sequences that are not
    /// running: reserved-but-unfilled on the receiving side, prefilled and
    /// pinned on the sending side).
    pub fn arena(&self) -> (usize, usize) {
        (self.data.as_ptr() as usize, self.data.len() * 2)
    }

    /// Block `b`'s values as f16 bits (a GPU arena mirrors them).
    pub fn block_bits(&self, b: u32) -> &[u16] {
        let r = self.block_range(b);
        // SAFETY: f16 is a transparent u16.
        unsafe { std::slice::from_raw_parts(self.data[r].as_ptr().cast::<u16>(), self.layout.block_elems()) }
    }

    /// Block `b`'s values as f16 bits, to overwrite (from a GPU's copy).
    pub fn block_bits_mut(&mut self, b: u32) -> &mut [u16] {
        let r = self.block_range(b);
        let n = self.layout.block_elems();
        // SAFETY: f16 is a transparent u16.
        unsafe { std::slice::from_raw_parts_mut(self.data[r].as_mut_ptr().cast::<u16>(), n) }
    }

    pub fn total(&self) -> usize {
        self.blocks.total()
    }
    /// Blocks an allocation can take (free, or cached and unreferenced).
    pub fn free_blocks(&self) -> usize {
        self.blocks.available()
    }
    /// Blocks held by sequences.
    pub fn used(&self) -> usize {
        self.blocks.held()
    }

    /// Take `n` blocks, or none at all if fewer are available.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>> {
        self.blocks.allocate(n)
    }

    /// Drop one reference to each block. Ids out of range are ignored.
    pub fn release(&mut self, blocks: &[u32]) {
        self.blocks.release(blocks)
    }

    /// Store one head's key (kv=0) or value (kv=1) row for position `pos`.
    pub fn write(&mut self, blocks: &[u32], layer: usize, kv: usize, head: usize, pos: usize, row: &[f32]) {
        let l = self.layout;
        let base = blocks[pos / l.block_size] as usize * l.block_elems();
        let off = base + l.offset_in_block(layer, kv, head, pos % l.block_size);
        pdmesh_kernels::attention::f32_to_f16_slice(row, &mut self.data[off..off + l.head_dim]);
    }

    /// Visit positions `0..n` of one head's keys (kv=0) or values (kv=1)
    /// block by block: `f(first position, f16 rows of the run)`.
    /// Hand `f` each run of positions `seen` of one head that lies in one
    /// block: (first position, its f16 values).
    fn for_each_run(
        &self,
        blocks: &[u32],
        layer: usize,
        kv: usize,
        head: usize,
        seen: std::ops::Range<usize>,
        mut f: impl FnMut(usize, &[f16]),
    ) {
        let l = self.layout;
        let bs = l.block_size;
        assert!(blocks.len() * bs >= seen.end, "block table too short for {} positions", seen.end);
        let mut pos = seen.start;
        while pos < seen.end {
            let slot = pos % bs;
            let take = (seen.end - pos).min(bs - slot);
            let off = blocks[pos / bs] as usize * l.block_elems() + l.offset_in_block(layer, kv, head, slot);
            f(pos, &self.data[off..off + take * l.head_dim]);
            pos += take;
        }
    }

    /// Gather positions `seen` of one head's keys or values into `dst`
    /// (`seen.end * head_dim` f32), zeroing the positions before `seen`: a
    /// sliding window's layer never reads (and a transfer may not have
    /// brought) what lies before its window.
    pub fn gather(
        &self,
        blocks: &[u32],
        layer: usize,
        kv: usize,
        head: usize,
        seen: std::ops::Range<usize>,
        dst: &mut [f32],
    ) {
        let hd = self.layout.head_dim;
        dst[..seen.start * hd].fill(0.0);
        self.for_each_run(blocks, layer, kv, head, seen, |pos, run| {
            pdmesh_kernels::attention::f16_to_f32_slice(run, &mut dst[pos * hd..pos * hd + run.len()]);
        });
    }

    /// Gather positions `seen` of one head's values transposed into `dst`
    /// (`head_dim` rows of `stride` f32: `dst[d * stride + pos]`), zeroing
    /// positions `0..seen.start` and `seen.end..stride`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_transposed(
        &self,
        blocks: &[u32],
        layer: usize,
        kv: usize,
        head: usize,
        seen: std::ops::Range<usize>,
        stride: usize,
        dst: &mut [f32],
    ) {
        let l = self.layout;
        let (from, n) = (seen.start, seen.end);
        assert!(n <= stride && dst.len() >= l.head_dim * stride);
        self.for_each_run(blocks, layer, kv, head, seen, |pos, run| {
            pdmesh_kernels::attention::f16_rows_to_f32_columns(run, l.head_dim, dst, stride, pos);
        });
        for d in 0..l.head_dim {
            dst[d * stride..d * stride + from].fill(0.0);
            dst[d * stride + n..(d + 1) * stride].fill(0.0);
        }
    }

    fn block_range(&self, b: u32) -> std::ops::Range<usize> {
        let e = self.layout.block_elems();
        b as usize * e..(b as usize + 1) * e
    }

    /// Copy positions `0..n` of block `src` (every layer, keys and values)
    /// into block `dst`: a prompt that shares the head of a cached block
    /// gets those positions without computing them.
    pub fn copy_positions(&mut self, src: u32, dst: u32, n: usize) {
        let l = self.layout;
        let n = n.min(l.block_size);
        let (s0, d0) = (src as usize * l.block_elems(), dst as usize * l.block_elems());
        for layer in 0..l.n_layers {
            for kv in 0..2 {
                for head in 0..l.n_kv_heads {
                    let off = l.offset_in_block(layer, kv, head, 0);
                    self.data.copy_within(s0 + off..s0 + off + n * l.head_dim, d0 + off);
                }
            }
        }
    }

    /// Bytes of a sequence's blocks covering `n_tokens` positions.
    pub fn export(&self, blocks: &[u32], n_tokens: usize) -> Result<KvBlob> {
        let blocks = self.layout.covering(blocks, n_tokens)?;
        let mut bytes = Vec::with_capacity(blocks.len() * self.layout.block_bytes());
        for b in blocks {
            bytes.extend_from_slice(f16_bytes(&self.data[self.block_range(*b)]));
        }
        Ok(KvBlob { layout: self.layout, n_tokens, bytes })
    }

    /// Set each layer's sliding window (None: global); a model without
    /// windows need not call it.
    pub fn set_windows(&mut self, windows: Vec<Option<usize>>) {
        assert_eq!(windows.len(), self.layout.n_layers);
        self.windows = windows;
    }

    /// What a transfer of `n_tokens` positions of this cache moves.
    pub fn shipped(&self, n_tokens: usize) -> Shipped {
        self.layout.shipped(&self.windows, n_tokens)
    }

    /// CRC-32C of what a transfer moves of each block covering `n_tokens`
    /// positions ([`KvCache::shipped`]: whole blocks, padding included,
    /// unless a window trims them), read in place.
    pub fn checksums(&self, blocks: &[u32], n_tokens: usize) -> Result<Vec<u32>> {
        let blocks = self.layout.covering(blocks, n_tokens)?;
        let (plan, bb) = (self.shipped(n_tokens), self.layout.block_bytes());
        Ok(blocks
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let block = f16_bytes(&self.data[self.block_range(*b)]);
                plan.ranges(i, bb).into_iter().fold(0, |crc, r| crc32c::crc32c_append(crc, &block[r]))
            })
            .collect())
    }

    /// Flip the bits of `mask` in byte `byte` of block `b` (fault injection:
    /// a transfer's corruption, caught by the receiver's checksums).
    pub fn flip_byte(&mut self, b: u32, byte: usize, mask: u8) {
        let r = self.block_range(b);
        let i = r.start + (byte / 2) % (r.end - r.start);
        let bits = self.data[i].to_bits() ^ (u16::from(mask) << (8 * (byte % 2)));
        self.data[i] = f16::from_bits(bits);
    }

    /// Write a blob into `blocks` (which must be this sequence's own, already allocated).
    pub fn import(&mut self, blocks: &[u32], blob: &KvBlob) -> Result<()> {
        if blob.layout != self.layout {
            return Err(EngineError::KvMismatch(format!(
                "layout {:?} does not match this cache's {:?}",
                blob.layout, self.layout
            )));
        }
        let need = self.layout.blocks_for(blob.n_tokens);
        if blob.bytes.len() != need * self.layout.block_bytes() {
            return Err(EngineError::KvMismatch(format!(
                "{} bytes for {} tokens; expected {}",
                blob.bytes.len(),
                blob.n_tokens,
                need * self.layout.block_bytes()
            )));
        }
        if blocks.len() < need {
            return Err(EngineError::KvMismatch(format!("{need} blocks needed, {} reserved", blocks.len())));
        }
        let bb = self.layout.block_bytes();
        for (i, b) in blocks[..need].iter().enumerate() {
            let r = self.block_range(*b);
            let src = &blob.bytes[i * bb..(i + 1) * bb];
            f16_bytes_mut(&mut self.data[r]).copy_from_slice(src);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { n_layers: 2, n_kv_heads: 3, head_dim: 8, block_size: 4 }
    }

    #[test]
    fn allocate_is_all_or_nothing_and_release_returns_blocks() {
        let mut kv = KvCache::new(layout(), 5);
        let a = kv.allocate(3).unwrap();
        assert_eq!(kv.used(), 3);
        assert!(matches!(kv.allocate(3), Err(EngineError::KvFull { needed: 3, free: 2, total: 5 })));
        assert_eq!(kv.used(), 3, "a failed allocation takes nothing");
        kv.release(&a);
        assert_eq!(kv.free_blocks(), 5);
        let b = kv.allocate(5).unwrap();
        let mut sorted = b.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn checksums_in_place_equal_the_exported_bytes_and_catch_one_flipped_byte() {
        let l = layout();
        let mut a = KvCache::new(l, 4);
        let blocks = a.allocate(3).unwrap();
        for pos in 0..10 {
            a.write(&blocks, 1, 0, 2, pos, &[pos as f32 * 0.25; 8]);
        }
        let sums = a.checksums(&blocks, 10).unwrap();
        assert_eq!(sums.len(), 3, "10 positions in blocks of 4");
        let blob = a.export(&blocks, 10).unwrap();
        assert_eq!(block_checksums(&blob.bytes, l.block_bytes()), sums, "what TCP carries checks alike");
        let mut streamed = StreamChecksums::new(l.block_bytes());
        for piece in blob.bytes.chunks(l.block_bytes() / 3 + 5) {
            streamed.push(piece);
        }
        assert_eq!(streamed.finish(), sums, "taken chunk by chunk as it arrives");
        verify_checksums(&sums, &sums).unwrap();
        a.flip_byte(blocks[2], 1, 0x40);
        let bad = a.checksums(&blocks, 10).unwrap();
        let e = verify_checksums(&bad, &sums).unwrap_err().to_string();
        assert!(e.starts_with(pdmesh_vocab::KV_CORRUPT) && e.contains("block 2 of 3"), "{e}");
        a.flip_byte(blocks[2], 1, 0x40);
        assert_eq!(a.checksums(&blocks, 10).unwrap(), sums, "flipped twice, restored");
        assert!(verify_checksums(&sums[..2], &sums).is_err(), "a missing block is caught too");
    }

    /// Gemma 3 270M's KV: 18 layers, every sixth global, windows of 512.
    #[test]
    fn a_window_model_ships_its_old_blocks_global_layers_only() {
        let l = KvLayout { n_layers: 18, n_kv_heads: 1, head_dim: 256, block_size: 16 };
        let windows: Vec<Option<usize>> = (0..18).map(|i| if i % 6 == 5 { None } else { Some(512) }).collect();
        let bb = l.block_bytes();
        assert_eq!(bb, 294_912);
        // 2,048 positions: the next query (2,048) sees 1,537 onwards, so
        // blocks 0..96 keep layers 5, 11 and 17 only.
        let plan = l.shipped(&windows, 2048);
        assert_eq!(plan.trimmed, 96);
        let lb = bb / 18;
        assert_eq!(plan.kept, [5 * lb..6 * lb, 11 * lb..12 * lb, 17 * lb..18 * lb]);
        assert_eq!(plan.bytes(128, bb), 14_155_776, "against {} for every block whole", 128 * bb);
        assert_eq!(plan.ranges(96, bb), std::iter::once(0..bb).collect::<Vec<_>>());
        // Short prompts, and models without windows, ship whole blocks.
        assert_eq!(l.shipped(&windows, 500).trimmed, 0);
        assert_eq!(l.shipped(&windows, 527).trimmed, 1, "block 0 (0..15) is before 527 + 1 - 512");
        assert_eq!(l.shipped(&[None; 18], 4096), Shipped::default());
        // Checksums cover what moves: a byte outside it does not count.
        let mut kv = KvCache::new(l, 40);
        kv.set_windows(windows);
        let blocks = kv.allocate(38).unwrap();
        let before = kv.checksums(&blocks, 600).unwrap();
        kv.flip_byte(blocks[0], 10, 0x40); // layer 0 of block 0: not shipped
        assert_eq!(kv.checksums(&blocks, 600).unwrap(), before);
        kv.flip_byte(blocks[0], 5 * lb + 10, 0x40); // layer 5: shipped
        assert_ne!(kv.checksums(&blocks, 600).unwrap()[0], before[0]);
    }

    #[test]
    fn write_gather_export_import_roundtrip() {
        let l = layout();
        let mut a = KvCache::new(l, 4);
        let blocks = a.allocate(3).unwrap();
        let n = 10;
        for pos in 0..n {
            for layer in 0..2 {
                for kv in 0..2 {
                    for h in 0..3 {
                        let row: Vec<f32> =
                            (0..8).map(|d| (pos * 1000 + layer * 100 + kv * 10 + h) as f32 + d as f32 * 0.5).collect();
                        a.write(&blocks, layer, kv, h, pos, &row);
                    }
                }
            }
        }
        let blob = a.export(&blocks, n).unwrap();
        assert_eq!(blob.bytes.len(), 3 * l.block_bytes());
        let mut b = KvCache::new(l, 6);
        let _skip = b.allocate(2).unwrap();
        let dst = b.allocate(3).unwrap();
        b.import(&dst, &blob).unwrap();
        let mut ga = vec![f32::NAN; n * 8];
        let mut gb = vec![f32::NAN; n * 8];
        a.gather(&blocks, 1, 1, 2, 0..n, &mut ga);
        b.gather(&dst, 1, 1, 2, 0..n, &mut gb);
        assert_eq!(ga, gb);
        assert_eq!(ga[9 * 8], 9112.0);
        let stride = 12;
        let mut gt = vec![f32::NAN; 8 * stride];
        b.gather_transposed(&dst, 1, 1, 2, 0..n, stride, &mut gt);
        for pos in 0..n {
            for d in 0..8 {
                assert_eq!(gt[d * stride + pos], ga[pos * 8 + d]);
            }
        }
        assert!(gt[stride - 1] == 0.0 && gt[8 * stride - 1] == 0.0);
        // A window's view: positions before it are zeros, the rest as before
        // (runs that start inside a block).
        let mut gw = vec![f32::NAN; n * 8];
        b.gather(&dst, 1, 1, 2, 5..n, &mut gw);
        assert!(gw[..5 * 8].iter().all(|v| *v == 0.0) && gw[5 * 8..] == ga[5 * 8..]);
        b.gather_transposed(&dst, 1, 1, 2, 5..n, stride, &mut gt);
        for d in 0..8 {
            assert!(gt[d * stride..d * stride + 5].iter().all(|v| *v == 0.0));
            assert!((5..n).all(|p| gt[d * stride + p] == ga[p * 8 + d]));
        }
        let wrong = KvBlob { layout: KvLayout { head_dim: 4, ..l }, ..blob.clone() };
        assert!(b.import(&dst, &wrong).is_err());
        let short = KvBlob { bytes: blob.bytes[1..].to_vec(), ..blob };
        assert!(b.import(&dst, &short).is_err());
    }
}
