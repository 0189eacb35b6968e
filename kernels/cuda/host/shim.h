// What the CUDA sources need to compile as plain C++ for the host harness:
// kernel qualifiers become nothing, the thread and block indices become
// globals that `launch` steps through, one thread at a time. Only kernels
// without warp intrinsics or __syncthreads run this way (harness.cpp).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#define PDMESH_HOST 1
#define __global__
#define __device__
#define __forceinline__ inline

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

static dim3 threadIdx, blockIdx, blockDim, gridDim;

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }

// Rounded products and differences (on a GPU: never contracted into an FMA).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }

// Run `kernel()` for every thread of every block, in order.
template <class K>
void launch(dim3 grid, dim3 block, K kernel) {
  gridDim = grid;
  blockDim = block;
  for (blockIdx.z = 0; blockIdx.z < grid.z; ++blockIdx.z)
    for (blockIdx.y = 0; blockIdx.y < grid.y; ++blockIdx.y)
      for (blockIdx.x = 0; blockIdx.x < grid.x; ++blockIdx.x)
        for (threadIdx.z = 0; threadIdx.z < block.z; ++threadIdx.z)
          for (threadIdx.y = 0; threadIdx.y < block.y; ++threadIdx.y)
            for (threadIdx.x = 0; threadIdx.x < block.x; ++threadIdx.x) kernel();
}
