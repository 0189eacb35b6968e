// Token embeddings: row t of `out` is the dequantized row tokens[t] of the
// table (Q4_1 or Q8_0, as the model file holds it); an id outside the
// table's `vocab` rows gives a row of zeros, never a read past it. One
// thread per value.
extern "C" __global__ void embed_q4_1(const block_q4_1* table, const int* tokens, float* out, int n_tok, int cols,
                                      int vocab) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long)n_tok * cols) return;
  const int t = i / cols, c = i % cols;
  if (tokens[t] < 0 || tokens[t] >= vocab) {
    out[i] = 0.0f;
    return;
  }
  const block_q4_1* b = table + (size_t)tokens[t] * (cols / QK) + c / QK;
  const int e = c % QK;
  const int q = e < QK / 2 ? (b->qs[e] & 0x0F) : (b->qs[e - QK / 2] >> 4);
  out[i] = (float)q * h2f(b->d) + h2f(b->m);
}

extern "C" __global__ void embed_q8_0(const block_q8_0* table, const int* tokens, float* out, int n_tok, int cols,
                                      int vocab) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long)n_tok * cols) return;
  const int t = i / cols, c = i % cols;
  if (tokens[t] < 0 || tokens[t] >= vocab) {
    out[i] = 0.0f;
    return;
  }
  const block_q8_0* b = table + (size_t)tokens[t] * (cols / QK) + c / QK;
  out[i] = (float)b->qs[c % QK] * h2f(b->d);
}
