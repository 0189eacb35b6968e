// Activations to Q8, one warp per 32-value block, as the CPU's
// `quantize_q8` (kernels/src/quant.rs): scale 127 / amax, round half to
// even, d and s = d * sum(q) rounded through f16. Bit-exact with the CPU.
// Launch: blockDim.x a multiple of 32; one warp per block of `n_blocks`.
extern "C" __global__ void quantize_q8(const float* x, block_q8* out, int n_blocks) {
  const int b = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  const int lane = threadIdx.x % WARP;
  if (b >= n_blocks) return;
  const float v = x[(size_t)b * QK + lane];
  const float amax = warp_max(fabsf(v));
  const float d = amax / 127.0f;
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  const int q = __float2int_rn(v * id);
  out[b].qs[lane] = (signed char)q;
  const int sum = warp_sum(q);
  if (lane == 0) {
    out[b].d = round_f16(d);
    out[b].s = round_f16(d * (float)sum);
  }
}
