// Shared by every pdmesh CUDA kernel; prepended to each source before
// NVRTC compiles it (so no #include and no CUDA header is needed).
//
// Block formats are bit-compatible with pdmesh-kernels (kernels/src/quant.rs,
// kquant.rs) and GGML: Q4_1, Q8_0, Q5_0, Q5_1 and the K-quants (Q2_K to
// Q6_K) straight from the GGUF file, and Q8 activations (`block_q8`: f32
// scale, f32 scale x sum, 32 int8).

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

// ---- The 5-bit types and the K-quants (GGML's block layouts) ----
//
// Each type gives the integer of value e (`kq_int`) and, per group of 16
// values, the factor and the offset that make it a weight:
// w = kq_mul(g) * q - kq_min(g), in that order, with each product and
// difference rounded (no FMA contraction), as pdmesh-kernels' dequantizers
// (kernels/src/kquant.rs) compute it, so the f32 values are bit-identical.

#define QK_K 256

struct block_q5_0 {   // x = d * (q - 16), q 5 bits: the fifth bit of value e is bit e of qh. 22 bytes.
  f16_bits d;
  unsigned char qh[4];
  unsigned char qs[QK / 2];
};

struct block_q5_1 {   // x = d * q + m. 24 bytes.
  f16_bits d;
  f16_bits m;
  unsigned char qh[4];
  unsigned char qs[QK / 2];
};

struct block_q2_K {   // x = d * (sc & 15) * q - dmin * (sc >> 4), q 2 bits, 16 scales. 84 bytes.
  unsigned char scales[QK_K / 16];
  unsigned char qs[QK_K / 4];
  f16_bits d;
  f16_bits dmin;
};

struct block_q3_K {   // x = d * (sc - 32) * (q - 4 * !hbit), q 2 bits + hmask, 16 6-bit scales. 110 bytes.
  unsigned char hmask[QK_K / 8];
  unsigned char qs[QK_K / 4];
  unsigned char scales[12];
  f16_bits d;
};

struct block_q4_K {   // x = d * sc * q - dmin * m, q 4 bits, 8 6-bit scales and mins. 144 bytes.
  f16_bits d;
  f16_bits dmin;
  unsigned char scales[12];
  unsigned char qs[QK_K / 2];
};

struct block_q5_K {   // Q4_K with a fifth bit per value in qh. 176 bytes.
  f16_bits d;
  f16_bits dmin;
  unsigned char scales[12];
  unsigned char qh[QK_K / 8];
  unsigned char qs[QK_K / 2];
};

struct block_q6_K {   // x = d * sc * (q - 32), q 6 bits, 16 int8 scales. 210 bytes.
  unsigned char ql[QK_K / 2];
  unsigned char qh[QK_K / 4];
  signed char scales[QK_K / 16];
  f16_bits d;
};

// Value e (0..32) of a Q5_0/Q5_1 block before any offset (0..32).
__device__ __forceinline__ int q5_int(const unsigned char* qs, const unsigned char* qh, int e) {
  const unsigned h = (unsigned)qh[0] | ((unsigned)qh[1] << 8) | ((unsigned)qh[2] << 16) | ((unsigned)qh[3] << 24);
  const int lo = e < 16 ? (qs[e] & 0x0F) : (qs[e - 16] >> 4);
  return lo | (int)(((h >> e) & 1u) << 4);
}

// Scale and min of sub-block j (0..8) from Q4_K/Q5_K's 12 packed bytes.
__device__ __forceinline__ void scale_min_k4(int j, const unsigned char* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q3_K's scale i (0..16), before its offset of 32.
__device__ __forceinline__ int q3k_scale(const unsigned char* p, int i) {
  const int g = i / 4, k = i % 4;
  const int low = g == 0 ? (p[k] & 0x0F) : g == 1 ? (p[4 + k] & 0x0F) : g == 2 ? (p[k] >> 4) : (p[4 + k] >> 4);
  return low | (((p[8 + k] >> (2 * g)) & 3) << 4);
}

// Where value e of a Q2_K/Q3_K block lies: byte qs[(e / 128) * 32 + l],
// bits 2 * j of it, l = e % 32 (also the hmask byte), scale (e / 16).
__device__ __forceinline__ int k23_low(const unsigned char* qs, int e) {
  return (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
}

__device__ __forceinline__ int kq_int(const block_q5_0& b, int e) { return q5_int(b.qs, b.qh, e) - 16; }
__device__ __forceinline__ int kq_int(const block_q5_1& b, int e) { return q5_int(b.qs, b.qh, e); }
__device__ __forceinline__ int kq_int(const block_q2_K& b, int e) { return k23_low(b.qs, e); }
__device__ __forceinline__ int kq_int(const block_q3_K& b, int e) {
  return k23_low(b.qs, e) - ((b.hmask[e % 32] >> (e / 32)) & 1 ? 0 : 4);
}
__device__ __forceinline__ int kq_int(const block_q4_K& b, int e) {
  const unsigned char q = b.qs[(e / 64) * 32 + e % 32];
  return (e % 64) < 32 ? (q & 0x0F) : (q >> 4);
}
__device__ __forceinline__ int kq_int(const block_q5_K& b, int e) {
  const unsigned char q = b.qs[(e / 64) * 32 + e % 32];
  const int lo = (e % 64) < 32 ? (q & 0x0F) : (q >> 4);
  return lo + (((b.qh[e % 32] >> (e / 32)) & 1) << 4);
}
__device__ __forceinline__ int kq_int(const block_q6_K& b, int e) {
  const int n = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
  const unsigned char ql = b.ql[n * 64 + l + 32 * (quarter & 1)];
  const int low = quarter < 2 ? (ql & 0x0F) : (ql >> 4);
  return (low | (((b.qh[n * 32 + l] >> (2 * quarter)) & 3) << 4)) - 32;
}

// Factor and offset of group g (16 values); a type without offsets has 0,
// and `kq_has_min` false so that no subtraction is made.
__device__ __forceinline__ float kq_mul(const block_q5_0& b, int) { return h2f(b.d); }
__device__ __forceinline__ float kq_mul(const block_q5_1& b, int) { return h2f(b.d); }
__device__ __forceinline__ float kq_mul(const block_q2_K& b, int g) { return __fmul_rn(h2f(b.d), (float)(b.scales[g] & 0x0F)); }
__device__ __forceinline__ float kq_mul(const block_q3_K& b, int g) { return __fmul_rn(h2f(b.d), (float)(q3k_scale(b.scales, g) - 32)); }
// Q4_K and Q5_K: d * scale, or dmin * min, of sub-block g / 2.
template <class B>
__device__ __forceinline__ float k4_factor(const B& b, int g, bool min) {
  int sc, m;
  scale_min_k4(g / 2, b.scales, &sc, &m);
  return min ? __fmul_rn(h2f(b.dmin), (float)m) : __fmul_rn(h2f(b.d), (float)sc);
}
__device__ __forceinline__ float kq_mul(const block_q4_K& b, int g) { return k4_factor(b, g, false); }
__device__ __forceinline__ float kq_mul(const block_q5_K& b, int g) { return k4_factor(b, g, false); }
__device__ __forceinline__ float kq_mul(const block_q6_K& b, int g) { return __fmul_rn(h2f(b.d), (float)b.scales[g]); }

__device__ __forceinline__ float kq_min(const block_q5_0&, int) { return 0.0f; }
// Q5_1 adds m: w = d * q - (-m), the same rounding as d * q + m.
__device__ __forceinline__ float kq_min(const block_q5_1& b, int) { return -h2f(b.m); }
__device__ __forceinline__ float kq_min(const block_q2_K& b, int g) { return __fmul_rn(h2f(b.dmin), (float)(b.scales[g] >> 4)); }
__device__ __forceinline__ float kq_min(const block_q3_K&, int) { return 0.0f; }
__device__ __forceinline__ float kq_min(const block_q4_K& b, int g) { return k4_factor(b, g, true); }
__device__ __forceinline__ float kq_min(const block_q5_K& b, int g) { return k4_factor(b, g, true); }
__device__ __forceinline__ float kq_min(const block_q6_K&, int) { return 0.0f; }

template <class B> struct kq_traits;
template <> struct kq_traits<block_q5_0> { enum { values = QK, has_min = 0 }; };
template <> struct kq_traits<block_q5_1> { enum { values = QK, has_min = 1 }; };
template <> struct kq_traits<block_q2_K> { enum { values = QK_K, has_min = 1 }; };
template <> struct kq_traits<block_q3_K> { enum { values = QK_K, has_min = 0 }; };
template <> struct kq_traits<block_q4_K> { enum { values = QK_K, has_min = 1 }; };
template <> struct kq_traits<block_q5_K> { enum { values = QK_K, has_min = 1 }; };
template <> struct kq_traits<block_q6_K> { enum { values = QK_K, has_min = 0 }; };

// Weight e of block b, in f32 (bit-identical to the CPU's dequantizer).
template <class B>
__device__ __forceinline__ float kq_value(const B& b, int e) {
  const float v = __fmul_rn(kq_mul(b, e / 16), (float)kq_int(b, e));
  return kq_traits<B>::has_min ? __fsub_rn(v, kq_min(b, e / 16)) : v;
}

// One weight block of these types against the Q8 activation blocks it
// spans (1 for Q5_0/Q5_1, 8 for a K-quant): per group of 16 values, four
// dp4a for the products and four for the activations' sum (the offset).
template <class B>
__device__ __forceinline__ float block_dot_kq(const B& w, const block_q8* x) {
  float acc = 0.0f;
  for (int g = 0; g < kq_traits<B>::values / 16; ++g) {
    const block_q8& xb = x[g / 2];
    const int* q8 = (const int*)xb.qs + (g % 2) * 4;
    int s = 0, sx = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int e = 16 * g + 4 * k;
      const int packed = (kq_int(w, e) & 0xFF) | ((kq_int(w, e + 1) & 0xFF) << 8) | ((kq_int(w, e + 2) & 0xFF) << 16) |
                         ((kq_int(w, e + 3) & 0xFF) << 24);
      s = dp4a(packed, q8[k], s);
      if (kq_traits<B>::has_min) sx = dp4a(0x01010101, q8[k], sx);
    }
    acc += kq_mul(w, g) * xb.d * (float)s;
    if (kq_traits<B>::has_min) acc -= kq_min(w, g) * xb.d * (float)sx;
  }
  return acc;
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
