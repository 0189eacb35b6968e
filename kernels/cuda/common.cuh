// Shared by every pdmesh CUDA kernel; prepended to each source before
// NVRTC compiles it (so no #include and no CUDA header is needed).
//
// Block formats are bit-compatible with pdmesh-kernels (kernels/src/quant.rs)
// and GGML: Q4_1 and Q8_0 weights straight from the GGUF file, and Q8
// activations (`block_q8`: f32 scale, f32 scale x sum, 32 int8).

#define QK 32
#define WARP 32
#define INF_F32 __int_as_float(0x7f800000)

typedef unsigned short f16_bits;

struct block_q4_1 {   // x = d * q + m, q in 0..16; element i < 16 is the low
  f16_bits d;         // nibble of qs[i], element i >= 16 the high nibble of
  f16_bits m;         // qs[i - 16]. 20 bytes.
  unsigned char qs[QK / 2];
};

struct block_q8_0 {   // x = d * q. 34 bytes (its quants are only 2-aligned).
  f16_bits d;
  signed char qs[QK];
};

struct block_q8 {     // activations: x ~ d * q, s = d * sum(q). 40 bytes.
  float d;
  float s;
  signed char qs[QK];
};

// f16 through PTX conversions (round to nearest even), as the CPU's `half` crate.
__device__ __forceinline__ float h2f(f16_bits h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ f16_bits f2h(float f) {
  f16_bits h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ float round_f16(float x) { return h2f(f2h(x)); }

// Four int8 products summed into c (sm_61 and up).
__device__ __forceinline__ int dp4a(int a, int b, int c) {
  int r;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum (or max) over a whole CTA of at most 1024 threads; every thread gets
// the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = (blockDim.x + WARP - 1) / WARP;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = (blockDim.x + WARP - 1) / WARP;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INF_F32;
  return warp_max(v);
}
