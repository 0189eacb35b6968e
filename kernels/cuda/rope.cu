// RoPE on rows of `n_heads` heads of `head_dim` values, in place: row r is
// at position pos[r]. One thread per (row, head, pair). The angle is built
// as the CPU's `rope_row` builds it (theta = pos, times theta_scale once per
// pair index), so the same f32 products are taken.
extern "C" __global__ void rope(float* x, const int* pos, int n_rows, int n_heads, int head_dim, int dims,
                                float base) {
  const int pairs = dims / 2;
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long)n_rows * n_heads * pairs) return;
  const int p = i % pairs;
  const int h = (i / pairs) % n_heads;
  const int r = i / ((long)pairs * n_heads);
  const float theta_scale = powf(base, -2.0f / (float)dims);
  float theta = (float)pos[r];
  for (int k = 0; k < p; ++k) theta *= theta_scale;
  float s, c;
  sincosf(theta, &s, &c);
  float* v = x + ((size_t)r * n_heads + h) * head_dim + 2 * p;
  const float x0 = v[0], x1 = v[1];
  v[0] = fmaf(x0, c, -(x1 * s));
  v[1] = fmaf(x0, s, x1 * c);
}
