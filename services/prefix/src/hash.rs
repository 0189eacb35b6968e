//! Chained block hashes. Stable across processes, versions and hosts: the
//! router and every worker must compute the same values.

/// The hash of one full block, chained through its parents.
pub type BlockHash = u64;

/// SplitMix64's finaliser: a cheap, well-mixed 64-bit permutation.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn absorb(h: u64, v: u64) -> u64 {
    mix(h ^ v.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// The seed of every chain: a hash of what, beside the tokens, decides a
/// block's KV (`identity`: the model and its config) and of the block size.
pub fn seed(identity: &[u8], block_size: usize) -> BlockHash {
    let mut h = absorb(0, identity.len() as u64);
    for chunk in identity.chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = absorb(h, u64::from_le_bytes(word));
    }
    absorb(h, block_size as u64)
}

/// The hash of a block holding `tokens` whose parent hashes to `parent`
/// (the seed for the first block).
pub fn block_hash(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = absorb(parent, tokens.len() as u64);
    for t in tokens {
        h = absorb(h, u64::from(*t));
    }
    h
}

/// Hashes of the full blocks of `tokens`, at most `max_blocks` of them.
pub fn chain(seed: BlockHash, block_size: usize, tokens: &[u32], max_blocks: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity((tokens.len() / block_size.max(1)).min(max_blocks));
    let mut parent = seed;
    for block in tokens.chunks_exact(block_size.max(1)).take(max_blocks) {
        parent = block_hash(parent, block);
        out.push(parent);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const PINNED_SEED: &str = "cb39c41305b366a6";
    const PINNED_BLOCK: &str = "550cd15350f9c7d6";

    #[test]
    fn values_are_stable_across_builds() {
        // The router and workers of different builds must agree: pin values.
        let s = seed(b"model", 16);
        assert_eq!(s, seed(b"model", 16));
        assert_eq!(
            chain(s, 2, &[1, 2, 3, 4, 5], 10),
            vec![block_hash(s, &[1, 2]), block_hash(block_hash(s, &[1, 2]), &[3, 4])]
        );
        assert_eq!(format!("{s:016x}"), PINNED_SEED);
        assert_eq!(format!("{:016x}", block_hash(s, &[1, 2, 3])), PINNED_BLOCK);
    }

    #[test]
    fn a_block_hash_depends_on_its_whole_prefix_and_the_seed() {
        let s = seed(b"model", 2);
        let a = chain(s, 2, &[1, 2, 3, 4], 10);
        let b = chain(s, 2, &[9, 2, 3, 4], 10);
        assert_ne!(a[1], b[1], "same second block, different first block");
        assert_ne!(chain(seed(b"other", 2), 2, &[1, 2], 1), chain(s, 2, &[1, 2], 1));
        assert_ne!(seed(b"model", 2), seed(b"model", 4));
        assert_ne!(block_hash(s, &[1, 2]), block_hash(s, &[2, 1]));
    }

    #[test]
    fn only_full_blocks_and_at_most_max_blocks() {
        let s = seed(b"m", 4);
        assert_eq!(chain(s, 4, &[1, 2, 3], 10).len(), 0);
        assert_eq!(chain(s, 4, &[1; 9], 10).len(), 2);
        assert_eq!(chain(s, 4, &[1; 16], 3).len(), 3);
    }
}
