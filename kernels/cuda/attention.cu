// Causal attention over the paged f16 cache, grouped-query (n_heads query
// heads share n_kv_heads KV heads), for decode rows and prefill rows alike.
// One CTA per (row, query head); row r is at position row_pos[r] of its
// sequence, whose block table starts at tables + row_table[r], and sees
// positions 0..=row_pos[r]. As on the CPU (llama.cpp's non-flash path), the
// query and the probabilities are rounded to f16 before their products.
// Dynamic shared memory: (max_ctx + head_dim) floats.
extern "C" __global__ void attention(const float* q, float* out, const f16_bits* arena, const int* row_pos,
                                     const int* row_table, const int* tables, int n_heads, int n_kv_heads,
                                     int head_dim, int block_size, int n_layers, int layer, float scale,
                                     int max_ctx, int n_tables, int n_blocks) {
  extern __shared__ float sm[];
  __shared__ float scratch[WARP];
  const int r = blockIdx.x, h = blockIdx.y;
  const int kvh = h / (n_heads / n_kv_heads);
  // Never past the shared scores (max_ctx), the tables or the arena.
  const int start = row_table[r];
  const int n_ctx = start < 0 ? 0 : min(min(row_pos[r] + 1, max_ctx), (n_tables - start) * block_size);
  float* qs = sm;              // head_dim
  float* scores = sm + head_dim;  // n_ctx
  const float* qr = q + ((size_t)r * n_heads + h) * head_dim;
  for (int e = threadIdx.x; e < head_dim; e += blockDim.x) qs[e] = round_f16(qr[e]);
  __syncthreads();
  const size_t block_elems = (size_t)block_size * n_layers * 2 * n_kv_heads * head_dim;
  const int* table = tables + max(start, 0);
  const size_t k_off = (((size_t)layer * 2 + 0) * n_kv_heads + kvh) * block_size * head_dim;
  const size_t v_off = (((size_t)layer * 2 + 1) * n_kv_heads + kvh) * block_size * head_dim;
  float mx = -INF_F32;
  for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
    const f16_bits* kj = arena + (size_t)clamp_block(table[j / block_size], n_blocks) * block_elems + k_off + (size_t)(j % block_size) * head_dim;
    float s = 0.0f;
    for (int e = 0; e < head_dim; ++e) s = fmaf(h2f(kj[e]), qs[e], s);
    s *= scale;
    scores[j] = s;
    mx = fmaxf(mx, s);
  }
  mx = block_max(mx, scratch);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
    const float p = expf(scores[j] - mx);
    scores[j] = p;
    sum += p;
  }
  sum = block_sum(sum, scratch);
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) scores[j] = round_f16(scores[j] * inv);
  __syncthreads();
  float* orow = out + ((size_t)r * n_heads + h) * head_dim;
  for (int e = threadIdx.x; e < head_dim; e += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < n_ctx; ++j) {
      const f16_bits* vj = arena + (size_t)clamp_block(table[j / block_size], n_blocks) * block_elems + v_off + (size_t)(j % block_size) * head_dim;
      acc = fmaf(h2f(vj[e]), scores[j], acc);
    }
    orow[e] = acc;
  }
}
