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

#ifdef PDMESH_HOST
// The host harness (kernels/cuda/host) runs kernels without warp
// intrinsics on the CPU: the same helpers in plain C++.
__device__ __forceinline__ float h2f(f16_bits h) {
  _Float16 v;
  memcpy(&v, &h, 2);
  return (float)v;
}

__device__ __forceinline__ f16_bits f2h(float f) {
  const _Float16 v = (_Float16)f;
  f16_bits h;
  memcpy(&h, &v, 2);
  return h;
}

__device__ __forceinline__ int dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
  return c;
}
#else
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

// Four int8 products summed into c (sm_61 and up).
__device__ __forceinline__ int dp4a(int a, int b, int c) {
  int r;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

#endif

__device__ __forceinline__ float round_f16(float x) { return h2f(f2h(x)); }

// A block id from device data, kept inside an arena of n_blocks blocks (a
// bad id reads a wrong block, never memory past the arena).
__device__ __forceinline__ int clamp_block(int b, int n_blocks) { return b < 0 ? 0 : (b >= n_blocks ? n_blocks - 1 : b); }

// One Q4_1 weight block against one Q8 activation block (matvec's inner step).
__device__ __forceinline__ float block_dot_q4_1(const block_q4_1& w, const block_q8* x) {
  int q4[4];
  memcpy(q4, w.qs, sizeof(q4));
  const int* q8 = (const int*)x->qs;
  int s = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s = dp4a(q4[i] & 0x0F0F0F0F, q8[i], s);             // elements 4i..4i+3
    s = dp4a((q4[i] >> 4) & 0x0F0F0F0F, q8[i + 4], s);  // elements 16+4i..
  }
  return h2f(w.d) * x->d * (float)s + h2f(w.m) * x->s;
}

// One Q8_0 weight block against one Q8 activation block.
__device__ __forceinline__ float block_dot_q8_0(const block_q8_0& w, const block_q8* x) {
  int qw[8];
  memcpy(qw, w.qs, sizeof(qw));
  const int* q8 = (const int*)x->qs;
  int s = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = dp4a(qw[i], q8[i], s);
  return h2f(w.d) * x->d * (float)s;
}

#ifndef PDMESH_HOST
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
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
#endif  // PDMESH_HOST
