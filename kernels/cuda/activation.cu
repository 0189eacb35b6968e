// SwiGLU's gate, in place: gate = silu(gate) * up, as the CPU's `silu_mul`.
extern "C" __global__ void silu_mul(float* gate, const float* up, long n) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = gate[i];
  gate[i] = g / (1.0f + expf(-g)) * up[i];
}

// The residual add: x += y.
extern "C" __global__ void add_into(float* x, const float* y, long n) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  x[i] += y[i];
}
