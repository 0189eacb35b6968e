// The f16 side of the matrix products: weights dequantized once (Q4_1,
// Q8_0, Q5_0, Q5_1 or a K-quant, as the model file holds them) into row-major f16, and activations
// cast to f16, for the tensor-core GEMMs that prefill steps and large
// decode batches run through cuBLAS. One thread per value; the value is
// computed in f32 exactly as the CPU dequantizes it, then rounded once.
extern "C" __global__ void dequant_q4_1_f16(const block_q4_1* w, f16_bits* out, long n) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const block_q4_1* b = w + i / QK;
  const int e = i % QK;
  const int q = e < QK / 2 ? (b->qs[e] & 0x0F) : (b->qs[e - QK / 2] >> 4);
  out[i] = f2h((float)q * h2f(b->d) + h2f(b->m));
}

extern "C" __global__ void dequant_q8_0_f16(const block_q8_0* w, f16_bits* out, long n) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const block_q8_0* b = w + i / QK;
  out[i] = f2h((float)b->qs[i % QK] * h2f(b->d));
}

// The 5-bit types and the K-quants: value e of block e / values, in f32 as
// the CPU computes it (`kq_value`), rounded once.
template <class B>
__device__ __forceinline__ void dequant_kq_f16(const B* w, f16_bits* out, long n) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int per = kq_traits<B>::values;
  out[i] = f2h(kq_value(w[i / per], (int)(i % per)));
}

extern "C" __global__ void dequant_q5_0_f16(const block_q5_0* w, f16_bits* out, long n) { dequant_kq_f16(w, out, n); }
extern "C" __global__ void dequant_q5_1_f16(const block_q5_1* w, f16_bits* out, long n) { dequant_kq_f16(w, out, n); }
extern "C" __global__ void dequant_q2_k_f16(const block_q2_K* w, f16_bits* out, long n) { dequant_kq_f16(w, out, n); }
extern "C" __global__ void dequant_q3_k_f16(const block_q3_K* w, f16_bits* out, long n) { dequant_kq_f16(w, out, n); }
extern "C" __global__ void dequant_q4_k_f16(const block_q4_K* w, f16_bits* out, long n) { dequant_kq_f16(w, out, n); }
extern "C" __global__ void dequant_q5_k_f16(const block_q5_K* w, f16_bits* out, long n) { dequant_kq_f16(w, out, n); }
extern "C" __global__ void dequant_q6_k_f16(const block_q6_K* w, f16_bits* out, long n) { dequant_kq_f16(w, out, n); }

extern "C" __global__ void cast_f16(const float* x, f16_bits* out, long n) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = f2h(x[i]);
}
