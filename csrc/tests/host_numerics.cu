// Host driver for the CPU tests: runs the very __host__ __device__ code of csrc/quant (software
// E2M1 twin, scale recipes, correctly rounded division, fixed SiLU) on raw inputs, so that
// tests/test_cuda_host_numerics.py can compare it byte for byte with nvfp4_plugin.reference.
//
//   host_numerics MODE IN OUT [ARGS...]     (IN / OUT are raw little-endian binary files)
//
// MODE and ARGS (dtype: 0 bf16, 1 fp16, 2 fp32):
//   nvfp4 DTYPE M K UE8M0 GS_HEX   -> OUT = codes uint8[M*K/2] ++ linear scales uint8[M*K/16]
//   e2m1 PATH                       -> fp32[n] in, one code byte per value (PATH 0 fast: |y| < 7, taken times
//                                     kFastScale; 1 finite; 2 any)
//   e4m3                            -> fp32[n] in, bytes: satfinite(x) ++ satfinite(clamp448(x))
//   e4m3dec                         -> no input, fp32[256] decoded bytes
//   div                             -> fp32 pairs (a, b) in, fp32 a/b out
//   exp                             -> fp32[n] in, exp_fp32 out
//   silu DTYPE N                    -> DTYPE gate[N] ++ up[N] in, DTYPE silu(gate) * up out
//   fp8group DTYPE M K G EPS_HEX UE8M0 -> OUT = e4m3[M*K] ++ scale words uint32[M*K/G] (fp32 bits / byte)
//   fp8token DTYPE M K              -> OUT = e4m3[M*K] ++ fp32 scale[M]
//   swizzle KT                      -> int32 pairs (m, k) in, uint32 offsets out
//   chunks ROWS TROWS COLS TCOLS STEPS RESIDENT -> no input; int32 grid.x, grid.y, plan steps, then
//                                     (first row step, steps) of every CTA row y of the chunks kernels' plan
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../quant/kernel_utils.cuh"
#include "../quant/nvfp4_block.cuh"

using namespace nvq;

static std::vector<uint8_t> read_file(const char* path) {
  std::vector<uint8_t> v;
  FILE* f = std::fopen(path, "rb");
  if (!f) return v;
  uint8_t buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) v.insert(v.end(), buf, buf + n);
  std::fclose(f);
  return v;
}

static void write_file(const char* path, const std::vector<uint8_t>& v) {
  FILE* f = std::fopen(path, "wb");
  if (!f) std::exit(3);
  if (!v.empty()) std::fwrite(v.data(), 1, v.size(), f);
  std::fclose(f);
}

template <typename V>
static void put(std::vector<uint8_t>& out, V v) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(V));
}

static float hex_float(const char* s) { return u2f(uint32_t(std::strtoul(s, nullptr, 16))); }

template <typename T, bool UE8M0>
static void run_nvfp4(const std::vector<uint8_t>& in, std::vector<uint8_t>& out, long m, long k, float gs) {
  const OutScaleDirect<UE8M0> os{rcp_or_zero(gs)};
  std::vector<uint8_t> codes(size_t(m) * k / 2), scales(size_t(m) * k / 16);
  const size_t row_bytes = size_t(k) * sizeof(T);
  for (long r = 0; r < m; ++r) {
    for (long b = 0; b < k / 16; ++b) {
      uint4 c[kChunksPerBlock16<T>];
      std::memcpy(c, in.data() + r * row_bytes + b * 16 * sizeof(T), 16 * sizeof(T));
      uint32_t lo, hi;
      scales[r * (k / 16) + b] = nvfp4_quant_block16<T, UE8M0>(c, gs, os, lo, hi);
      std::memcpy(&codes[r * (k / 2) + b * 8], &lo, 4);
      std::memcpy(&codes[r * (k / 2) + b * 8 + 4], &hi, 4);
    }
  }
  out = codes;
  out.insert(out.end(), scales.begin(), scales.end());
}

template <typename T>
static float elem(const std::vector<uint8_t>& in, size_t i) {
  float x[Chunk<T>::kElems];
  uint4 c = make_uint4(0, 0, 0, 0);
  std::memcpy(&c, in.data() + i * sizeof(T), sizeof(T));
  chunk_to_float(c, static_cast<const T*>(nullptr), x);
  return x[0];
}

template <typename T>
static void put_elem(std::vector<uint8_t>& out, float v) {
  float vals[Chunk<T>::kElems] = {};
  vals[0] = v;
  const uint4 c = float_to_chunk<T>(vals);
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&c);
  out.insert(out.end(), p, p + sizeof(T));
}

template <typename T>
static void run_silu(const std::vector<uint8_t>& in, std::vector<uint8_t>& out, long n) {
  for (long i = 0; i < n; ++i) put_elem<T>(out, silu_mul_fp32(elem<T>(in, i), elem<T>(in, n + i)));
}

template <typename T>
static void run_fp8group(const std::vector<uint8_t>& in, std::vector<uint8_t>& out, long m, long k, long g, float eps,
                         bool ue8m0) {
  std::vector<uint8_t> q(size_t(m) * k);
  std::vector<uint32_t> s(size_t(m) * k / g);
  for (long grp = 0; grp < m * k / g; ++grp) {
    float amax = 0.0f;
    for (long i = 0; i < g; ++i) amax = max_ign(amax, fabsf(elem<T>(in, grp * g + i)));
    amax = inf_as_max(amax);
    const GroupScale gsc = ue8m0 ? fp8_group_scale<true>(amax, eps) : fp8_group_scale<false>(amax, eps);
    for (long i = 0; i < g; i += 2) {
      const uint16_t two = e4m3x2_satfinite(mul_rn(elem<T>(in, grp * g + i), gsc.mult),
                                            mul_rn(elem<T>(in, grp * g + i + 1), gsc.mult));
      q[grp * g + i] = uint8_t(two & 0xFF);
      q[grp * g + i + 1] = uint8_t(two >> 8);
    }
    s[grp] = gsc.bits;
  }
  out = q;
  for (uint32_t v : s) put(out, v);
}

template <typename T>
static void run_fp8token(const std::vector<uint8_t>& in, std::vector<uint8_t>& out, long m, long k) {
  std::vector<uint8_t> q(size_t(m) * k);
  std::vector<float> sc(m);
  for (long r = 0; r < m; ++r) {
    float amax = 0.0f;
    for (long i = 0; i < k; ++i) amax = max_ign(amax, fabsf(elem<T>(in, r * k + i)));
    const float s = div_rn(inf_as_max(amax), kE4M3Max);
    const float inv = rcp_or_zero(s);
    for (long i = 0; i < k; ++i) q[r * k + i] = e4m3_satfinite(mul_rn(elem<T>(in, r * k + i), inv));
    sc[r] = s;
  }
  out = q;
  for (float v : sc) put(out, v);
}

#define DISPATCH_T(dt, ...)              \
  do {                                   \
    if ((dt) == 0) {                     \
      using T = __nv_bfloat16;           \
      __VA_ARGS__;                       \
    } else if ((dt) == 1) {              \
      using T = __half;                  \
      __VA_ARGS__;                       \
    } else {                             \
      using T = float;                   \
      __VA_ARGS__;                       \
    }                                    \
  } while (0)

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s MODE IN OUT [ARGS...]\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const std::vector<uint8_t> in = read_file(argv[2]);
  std::vector<uint8_t> out;
  auto arg = [&](int i) { return std::atol(argv[3 + i]); };
  const float* f = reinterpret_cast<const float*>(in.data());
  const size_t nf = in.size() / 4;

  if (mode == "nvfp4") {
    const int dt = int(arg(1)), ue = int(arg(4));
    const long m = arg(2), k = arg(3);
    const float gs = hex_float(argv[3 + 5]);
    if (ue) {
      DISPATCH_T(dt, run_nvfp4<T, true>(in, out, m, k, gs));
    } else {
      DISPATCH_T(dt, run_nvfp4<T, false>(in, out, m, k, gs));
    }
  } else if (mode == "e2m1") {
    const int path = int(arg(1));
    for (size_t i = 0; i < nf; i += 8) {
      float y[8] = {};
      for (size_t j = 0; j < 8 && i + j < nf; ++j) y[j] = f[i + j];
      float ys[8];  // the fast encoder's input: the products times kFastScale
      for (int j = 0; j < 8; ++j) ys[j] = mul_rn(y[j], kFastScale);
      const uint32_t w = path == 0   ? e2m1x8_fast(ys, nibble_signs_f32(y))
                         : path == 1 ? e2m1x8_finite(y, nibble_signs_f32(y))
                                     : e2m1x8_any(y);
      for (size_t j = 0; j < 8 && i + j < nf; ++j) out.push_back(uint8_t((w >> (4 * j)) & 0xF));
    }
  } else if (mode == "e4m3") {
    for (size_t i = 0; i < nf; ++i) out.push_back(e4m3_satfinite(f[i]));
    for (size_t i = 0; i < nf; ++i) out.push_back(e4m3_satfinite(clamp448(f[i])));
  } else if (mode == "e4m3dec") {
    for (int b = 0; b < 256; ++b) put(out, e4m3_to_float(uint8_t(b)));
  } else if (mode == "div") {
    for (size_t i = 0; i + 1 < nf; i += 2) put(out, div_rn(f[i], f[i + 1]));
  } else if (mode == "exp") {
    for (size_t i = 0; i < nf; ++i) put(out, exp_fp32(f[i]));
  } else if (mode == "silu") {
    const int dt = int(arg(1));
    DISPATCH_T(dt, run_silu<T>(in, out, arg(2)));
  } else if (mode == "fp8group") {
    const int dt = int(arg(1));
    DISPATCH_T(dt, run_fp8group<T>(in, out, arg(2), arg(3), arg(4), hex_float(argv[3 + 5]), arg(6) != 0));
  } else if (mode == "fp8token") {
    const int dt = int(arg(1));
    DISPATCH_T(dt, run_fp8token<T>(in, out, arg(2), arg(3)));
  } else if (mode == "swizzle") {
    const uint32_t kt = uint32_t(arg(1));
    const int32_t* p = reinterpret_cast<const int32_t*>(in.data());
    for (size_t i = 0; i + 1 < in.size() / 4; i += 2) put(out, swizzled_offset(uint32_t(p[i]), uint32_t(p[i + 1]), kt));
  } else if (mode == "chunks") {
    const Tile t{int32_t(arg(4)), int32_t(arg(2))};  // cols, rows per step
    ChunkPlan plan;
    const dim3 g = chunk_grid(t, int32_t(arg(3)), uint64_t(arg(1)), int32_t(arg(5)), uint64_t(arg(6)), plan);
    put(out, int32_t(g.x));
    put(out, int32_t(g.y));
    put(out, plan.steps);
    for (uint32_t y = 0; y < g.y; ++y) {
      uint32_t n = 0;
      put(out, int32_t(chunk_run(plan, y, n)));
      put(out, int32_t(n));
    }
  } else {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  write_file(argv[3], out);
  return 0;
}
