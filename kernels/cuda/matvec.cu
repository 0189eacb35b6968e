// Quantized weights times Q8 activations for up to MAX_TOK tokens at once
// (decode steps; longer batches are cut into chunks of MAX_TOK):
// y[t * rows + r] = sum over blocks b of W[r][b] . X[t][b].
//
// One warp per output row; its lanes stride over the row's blocks, each
// lane a whole block (8 dp4a per token). blockDim = (32, rows_per_cta):
// `rows_per_cta` is the tuning knob (PDMESH_CUDA_ROWS_PER_CTA), reported
// on kernel spans and in /statusz; grid.x = ceil(rows / rows_per_cta).

#define MAX_TOK 8

// One warp per output row over blocks of type B, dotted by `dot`; each
// weight block spans XB activation blocks (8 for a K-quant's 256 values).
template <class B, float (*dot)(const B&, const block_q8*), int XB = 1>
__device__ __forceinline__ void matvec(const B* w, const block_q8* x, float* y, int rows, int blocks_per_row,
                                       int n_tok) {
  const int r = blockIdx.x * blockDim.y + threadIdx.y;
  if (r >= rows) return;
  const B* wr = w + (size_t)r * blocks_per_row;
  float acc[MAX_TOK];
#pragma unroll
  for (int t = 0; t < MAX_TOK; ++t) acc[t] = 0.0f;
  for (int b = threadIdx.x; b < blocks_per_row; b += WARP) {
    const B wb = wr[b];
#pragma unroll
    for (int t = 0; t < MAX_TOK; ++t) {
      if (t >= n_tok) break;
      acc[t] += dot(wb, x + ((size_t)t * blocks_per_row + b) * XB);
    }
  }
#pragma unroll
  for (int t = 0; t < MAX_TOK; ++t) {
    if (t >= n_tok) break;
    const float v = warp_sum(acc[t]);
    if (threadIdx.x == 0) y[(size_t)t * rows + r] = v;
  }
}

extern "C" __global__ void matvec_q4_1(const block_q4_1* w, const block_q8* x, float* y, int rows,
                                       int blocks_per_row, int n_tok) {
  matvec<block_q4_1, block_dot_q4_1>(w, x, y, rows, blocks_per_row, n_tok);
}

extern "C" __global__ void matvec_q8_0(const block_q8_0* w, const block_q8* x, float* y, int rows,
                                       int blocks_per_row, int n_tok) {
  matvec<block_q8_0, block_dot_q8_0>(w, x, y, rows, blocks_per_row, n_tok);
}

// The 5-bit types and the K-quants (`block_dot_kq`, common.cuh);
// `blocks_per_row` counts weight blocks (of 32 or 256 values).
extern "C" __global__ void matvec_q5_0(const block_q5_0* w, const block_q8* x, float* y, int rows, int blocks_per_row,
                                       int n_tok) {
  matvec<block_q5_0, block_dot_kq<block_q5_0>, 1>(w, x, y, rows, blocks_per_row, n_tok);
}

extern "C" __global__ void matvec_q5_1(const block_q5_1* w, const block_q8* x, float* y, int rows, int blocks_per_row,
                                       int n_tok) {
  matvec<block_q5_1, block_dot_kq<block_q5_1>, 1>(w, x, y, rows, blocks_per_row, n_tok);
}

extern "C" __global__ void matvec_q2_k(const block_q2_K* w, const block_q8* x, float* y, int rows, int blocks_per_row,
                                       int n_tok) {
  matvec<block_q2_K, block_dot_kq<block_q2_K>, 8>(w, x, y, rows, blocks_per_row, n_tok);
}

extern "C" __global__ void matvec_q3_k(const block_q3_K* w, const block_q8* x, float* y, int rows, int blocks_per_row,
                                       int n_tok) {
  matvec<block_q3_K, block_dot_kq<block_q3_K>, 8>(w, x, y, rows, blocks_per_row, n_tok);
}

extern "C" __global__ void matvec_q4_k(const block_q4_K* w, const block_q8* x, float* y, int rows, int blocks_per_row,
                                       int n_tok) {
  matvec<block_q4_K, block_dot_kq<block_q4_K>, 8>(w, x, y, rows, blocks_per_row, n_tok);
}

extern "C" __global__ void matvec_q5_k(const block_q5_K* w, const block_q8* x, float* y, int rows, int blocks_per_row,
                                       int n_tok) {
  matvec<block_q5_K, block_dot_kq<block_q5_K>, 8>(w, x, y, rows, blocks_per_row, n_tok);
}

extern "C" __global__ void matvec_q6_k(const block_q6_K* w, const block_q8* x, float* y, int rows, int blocks_per_row,
                                       int n_tok) {
  matvec<block_q6_K, block_dot_kq<block_q6_K>, 8>(w, x, y, rows, blocks_per_row, n_tok);
}
