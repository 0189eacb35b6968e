// Keys and values of this step into the paged arena (f16), the layout of
// engine/src/kv.rs: a block is [layer][k|v][kv_head][slot][head_dim].
// Row r goes to block row_block[r], slot row_slot[r]. One thread per
// (row, kv head, dim). A row naming a block outside the arena's `n_blocks`
// or a slot outside the block is skipped, never written past the arena.
extern "C" __global__ void kv_write(const float* k, const float* v, f16_bits* arena, const int* row_block,
                                    const int* row_slot, int n_rows, int layer, int n_layers, int n_kv_heads,
                                    int head_dim, int block_size, int n_blocks) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  const int kvd = n_kv_heads * head_dim;
  if (i >= (long)n_rows * kvd) return;
  const int r = i / kvd, h = (i % kvd) / head_dim, e = i % head_dim;
  const int slot = row_slot[r];
  if (row_block[r] < 0 || row_block[r] >= n_blocks || slot < 0 || slot >= block_size) return;
  const size_t block_elems = (size_t)block_size * n_layers * 2 * kvd;
  f16_bits* blk = arena + (size_t)row_block[r] * block_elems;
  const size_t ko = ((((size_t)layer * 2 + 0) * n_kv_heads + h) * block_size + slot) * head_dim + e;
  const size_t vo = ((((size_t)layer * 2 + 1) * n_kv_heads + h) * block_size + slot) * head_dim + e;
  blk[ko] = f2h(k[i]);
  blk[vo] = f2h(v[i]);
}
