// Exhaustive host check of the fast software E2M1 encoder: for every fp32 y with |y| < 7 (its contract),
// e2m1x8_fast(y * kFastScale) gives the code of e2m1x8_finite(y) (the magic-number encoder that
// tests/test_cuda_host_numerics.py checks against nvfp4_plugin.numerics), sign bits included.
// Products below 2**-120 in magnitude scale inexactly (2**-6 takes them subnormal); they encode to a
// signed zero either way, which the check covers too.
//   nvcc -std=c++17 -O2 -I csrc csrc/tests/e2m1_fast_check.cu -o /tmp/e2m1_fast_check && /tmp/e2m1_fast_check 8
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "../quant/numerics.cuh"
using namespace nvq;

int main(int argc, char** argv) {
  const int nt = argc > 1 ? atoi(argv[1]) : 2;
  constexpr uint32_t kEnd = 0x40E00000u;  // bits of 7.0f: every magnitude below it
  std::atomic<uint64_t> bad{0}, n{0};
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t) th.emplace_back([&, t] {
    uint64_t b = 0, cnt = 0;
    for (uint32_t base = uint32_t(t) * 8u; base < kEnd; base += uint32_t(nt) * 8u) {
      for (uint32_t neg = 0; neg < 2; ++neg) {
        const uint32_t sign = neg << 31;
        float y[8], ys[8];
        for (int j = 0; j < 8; ++j) {
          y[j] = u2f((base + uint32_t(j)) | (j & 1 ? sign ^ 0x80000000u : sign));
          ys[j] = mul_rn(y[j], kFastScale);
        }
        const uint32_t signs = nibble_signs_f32(y);
        const uint32_t want = e2m1x8_finite(y, signs), got = e2m1x8_fast(ys, signs);
        cnt += 8;
        if (want != got && b++ < 5) std::printf("mismatch at %08x: want %08x got %08x\n", base, want, got);
      }
    }
    bad += b;
    n += cnt;
  });
  for (auto& x : th) x.join();
  std::printf("%llu values, %llu mismatching words\n", (unsigned long long)n.load(), (unsigned long long)bad.load());
  return bad.load() == 0 ? 0 : 1;
}
