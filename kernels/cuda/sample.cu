// Picking tokens on the device, one CTA per row of logits.

// Greedy: the index of the largest logit (the lowest index among equals,
// as the CPU sampler picks).
extern "C" __global__ void argmax(const float* logits, int vocab, int* out) {
  __shared__ float best_v[1024];
  __shared__ int best_i[1024];
  const float* l = logits + (size_t)blockIdx.x * vocab;
  float bv = -INF_F32;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    if (l[i] > bv) {
      bv = l[i];
      bi = i;
    }
  }
  best_v[threadIdx.x] = bv;
  best_i[threadIdx.x] = bi;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float ov = best_v[threadIdx.x + s];
      const int oi = best_i[threadIdx.x + s];
      if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
        best_v[threadIdx.x] = ov;
        best_i[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = best_i[0];
}

// Temperature sampling over the whole vocabulary: the first index whose
// cumulative probability reaches u[row] (uniform in [0, 1), drawn on the
// host from the sequence's own generator). Each thread owns a contiguous
// chunk; chunk sums are scanned in shared memory, then the owner of the
// target walks its chunk. blockDim.x a power of two, at most 1024.
extern "C" __global__ void sample_temperature(const float* logits, int vocab, float temperature, const float* u,
                                              int* out) {
  __shared__ float scratch[WARP];
  __shared__ float chunk_sum[1024];
  const float* l = logits + (size_t)blockIdx.x * vocab;
  const int n = blockDim.x, t = threadIdx.x;
  const int per = (vocab + n - 1) / n;
  const int lo = min(vocab, t * per), hi = min(vocab, lo + per);
  float mx = -INF_F32;
  for (int i = lo; i < hi; ++i) mx = fmaxf(mx, l[i]);
  mx = block_max(mx, scratch);
  const float inv_t = 1.0f / temperature;
  float s = 0.0f;
  for (int i = lo; i < hi; ++i) s += expf((l[i] - mx) * inv_t);
  chunk_sum[t] = s;
  __syncthreads();
  // Inclusive scan of the chunk sums (Hillis-Steele).
  for (int off = 1; off < n; off <<= 1) {
    const float add = t >= off ? chunk_sum[t - off] : 0.0f;
    __syncthreads();
    chunk_sum[t] += add;
    __syncthreads();
  }
  const float total = chunk_sum[n - 1];
  const float target = u[blockIdx.x] * total;
  const float before = t > 0 ? chunk_sum[t - 1] : 0.0f;
  if (t == 0) out[blockIdx.x] = vocab - 1;  // rounding may leave the target past the end
  __syncthreads();
  if (before <= target && target < chunk_sum[t] && lo < hi) {
    float acc = before;
    int pick = hi - 1;
    for (int i = lo; i < hi; ++i) {
      acc += expf((l[i] - mx) * inv_t);
      if (acc > target) {
        pick = i;
        break;
      }
    }
    out[blockIdx.x] = pick;
  }
}
