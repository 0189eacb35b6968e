// Runs the CUDA kernels that need no warp intrinsics on the CPU, from the
// very same sources, one thread at a time: embed_q4_1, embed_q8_0, the f16
// dequantizers and cast (dequant.cu), rope,
// kv_write, silu_mul, add_into, and matvec's per-block dot products
// (block_dot_q4_1, block_dot_q8_0), and for the 5-bit types and K-quants
// their f32 values (`kq_value`), f16 dequantizers and block dots
// (`block_dot_kq`). pdmesh-cuda's tests write the inputs,
// run `harness CASE DIR ARGS...`, and compare DIR/out.bin with the CPU
// reference (pdmesh-kernels, pdmesh-engine's KV layout).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "shim.h"
// clang-format off
#include "../common.cuh"
#include "../embed.cu"
#include "../dequant.cu"
#include "../rope.cu"
#include "../kv.cu"
#include "../activation.cu"
// clang-format on

static std::string dir;

template <class T>
static std::vector<T> load(const char* name) {
  std::string p = dir + "/" + name;
  FILE* f = std::fopen(p.c_str(), "rb");
  if (!f) {
    std::fprintf(stderr, "cannot open %s\n", p.c_str());
    std::exit(2);
  }
  std::fseek(f, 0, SEEK_END);
  const long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  std::vector<T> v(n / sizeof(T));
  if (std::fread(v.data(), 1, n, f) != (size_t)n) std::exit(2);
  std::fclose(f);
  return v;
}

template <class T>
static void save(const std::vector<T>& v) {
  std::string p = dir + "/out.bin";
  FILE* f = std::fopen(p.c_str(), "wb");
  std::fwrite(v.data(), sizeof(T), v.size(), f);
  std::fclose(f);
}

static dim3 grid_for(long n, unsigned threads) {
  dim3 g;
  g.x = (unsigned)((n + threads - 1) / threads);
  return g;
}

static dim3 block_of(unsigned threads) {
  dim3 b;
  b.x = threads;
  return b;
}

static_assert(sizeof(block_q5_0) == 22 && sizeof(block_q5_1) == 24 && sizeof(block_q2_K) == 84, "block sizes");
static_assert(sizeof(block_q3_K) == 110 && sizeof(block_q4_K) == 144 && sizeof(block_q5_K) == 176, "block sizes");
static_assert(sizeof(block_q6_K) == 210, "block sizes");

// `kq OP TYPE N`: OP values (f32 values of every block in w.bin), dequant
// (the type's f16 kernel over N values), dot (each block against the Q8
// blocks it spans in x.bin).
template <class B>
static void kq_case(const std::string& op, long n, void (*dequant)(const B*, f16_bits*, long)) {
  auto w = load<B>("w.bin");
  const int per = kq_traits<B>::values;
  if (op == "values") {
    std::vector<float> out(w.size() * per);
    for (size_t i = 0; i < out.size(); ++i) out[i] = kq_value(w[i / per], (int)(i % per));
    save(out);
  } else if (op == "dequant") {
    std::vector<f16_bits> out(n);
    launch(grid_for(n, 256), block_of(256), [&] { dequant(w.data(), out.data(), n); });
    save(out);
  } else {
    auto x = load<block_q8>("x.bin");
    std::vector<float> out(w.size());
    for (size_t i = 0; i < w.size(); ++i) out[i] = block_dot_kq(w[i], &x[i * (per / QK)]);
    save(out);
  }
}

static int kq(const std::string& op, const std::string& type, long n) {
  if (type == "q5_0") kq_case<block_q5_0>(op, n, dequant_q5_0_f16);
  else if (type == "q5_1") kq_case<block_q5_1>(op, n, dequant_q5_1_f16);
  else if (type == "q2_k") kq_case<block_q2_K>(op, n, dequant_q2_k_f16);
  else if (type == "q3_k") kq_case<block_q3_K>(op, n, dequant_q3_k_f16);
  else if (type == "q4_k") kq_case<block_q4_K>(op, n, dequant_q4_k_f16);
  else if (type == "q5_k") kq_case<block_q5_K>(op, n, dequant_q5_k_f16);
  else if (type == "q6_k") kq_case<block_q6_K>(op, n, dequant_q6_k_f16);
  else {
    std::fprintf(stderr, "unknown type %s\n", type.c_str());
    return 2;
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const std::string what = argv[1];
  dir = argv[2];
  auto arg = [&](int i) { return std::atoi(argv[3 + i]); };
  if (what == "kq") {
    if (argc < 6) return 2;
    return kq(argv[3], argv[4], std::atol(argv[5]));
  }
  if (what == "embed_q4_1" || what == "embed_q8_0") {
    const int n_tok = arg(0), cols = arg(1);
    auto tokens = load<int>("tokens.bin");
    std::vector<float> out((size_t)n_tok * cols);
    if (what == "embed_q4_1") {
      auto table = load<block_q4_1>("table.bin");
      launch(grid_for(out.size(), 128), block_of(128), [&] { embed_q4_1(table.data(), tokens.data(), out.data(), n_tok, cols, (int)(table.size() / (cols / QK))); });
    } else {
      auto table = load<block_q8_0>("table.bin");
      launch(grid_for(out.size(), 128), block_of(128), [&] { embed_q8_0(table.data(), tokens.data(), out.data(), n_tok, cols, (int)(table.size() / (cols / QK))); });
    }
    save(out);
  } else if (what == "rope") {
    const int n_rows = arg(0), n_heads = arg(1), head_dim = arg(2), dims = arg(3);
    const float base = (float)std::atof(argv[7]);
    auto x = load<float>("x.bin");
    auto pos = load<int>("pos.bin");
    const long n = (long)n_rows * n_heads * (dims / 2);
    launch(grid_for(n, 64), block_of(64), [&] { rope(x.data(), pos.data(), n_rows, n_heads, head_dim, dims, base); });
    save(x);
  } else if (what == "kv_write") {
    const int n_rows = arg(0), layer = arg(1), n_layers = arg(2), n_kv_heads = arg(3), head_dim = arg(4),
              block_size = arg(5), n_blocks = arg(6);
    auto k = load<float>("k.bin");
    auto v = load<float>("v.bin");
    auto rb = load<int>("row_block.bin");
    auto rs = load<int>("row_slot.bin");
    std::vector<f16_bits> arena((size_t)n_blocks * block_size * n_layers * 2 * n_kv_heads * head_dim, 0);
    const long n = (long)n_rows * n_kv_heads * head_dim;
    launch(grid_for(n, 64), block_of(64), [&] {
      kv_write(k.data(), v.data(), arena.data(), rb.data(), rs.data(), n_rows, layer, n_layers, n_kv_heads, head_dim, block_size, n_blocks);
    });
    save(arena);
  } else if (what == "silu_mul" || what == "add_into") {
    auto a = load<float>("a.bin");
    auto b = load<float>("b.bin");
    const long n = (long)a.size();
    if (what == "silu_mul")
      launch(grid_for(n, 256), block_of(256), [&] { silu_mul(a.data(), b.data(), n); });
    else
      launch(grid_for(n, 256), block_of(256), [&] { add_into(a.data(), b.data(), n); });
    save(a);
  } else if (what == "dequant_q4_1_f16" || what == "dequant_q8_0_f16" || what == "cast_f16") {
    const long n = arg(0);
    std::vector<f16_bits> out(n);
    auto grid = grid_for(n, 256);
    if (what == "dequant_q4_1_f16") {
      auto w = load<block_q4_1>("w.bin");
      launch(grid, block_of(256), [&] { dequant_q4_1_f16(w.data(), out.data(), n); });
    } else if (what == "dequant_q8_0_f16") {
      auto w = load<block_q8_0>("w.bin");
      launch(grid, block_of(256), [&] { dequant_q8_0_f16(w.data(), out.data(), n); });
    } else {
      auto x = load<float>("x.bin");
      launch(grid, block_of(256), [&] { cast_f16(x.data(), out.data(), n); });
    }
    save(out);
  } else if (what == "dot_q4_1" || what == "dot_q8_0") {
    auto x = load<block_q8>("x.bin");
    std::vector<float> out(x.size());
    if (what == "dot_q4_1") {
      auto w = load<block_q4_1>("w.bin");
      for (size_t i = 0; i < x.size(); ++i) out[i] = block_dot_q4_1(w[i], &x[i]);
    } else {
      auto w = load<block_q8_0>("w.bin");
      for (size_t i = 0; i < x.size(); ++i) out[i] = block_dot_q8_0(w[i], &x[i]);
    }
    save(out);
  } else {
    std::fprintf(stderr, "unknown case %s\n", what.c_str());
    return 2;
  }
  return 0;
}
