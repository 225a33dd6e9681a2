// Exhaustive check of the bf16 SiLU table mapping over all 65536 bf16 patterns: range test,
// offset, and table value == silu_fp32(g) (as filled by the kernel).
#include <cstdio>
#include "../quant/numerics.cuh"
using namespace nvq;
constexpr int kSiluTab = 8192;
constexpr uint32_t kSiluTabBias = 0x3300u * 4u, kSiluTabOut = 0xFFFDC000u;
static float silu_tab_input(int i) { return u2f((uint32_t(i >> 12) << 31) | ((uint32_t(i & 0xFFF) + 0x3300u) << 16)); }
static uint32_t silu_tab_off(uint32_t x) { return (x & 0x3FFFu) | ((x >> 3) & 0x4000u); }
int main() {
  static float tab[kSiluTab];
  for (int i = 0; i < kSiluTab; ++i) tab[i] = silu_fp32(silu_tab_input(i));
  int bad = 0, inr = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t mag = h & 0x7FFF, x = h * 4u - kSiluTabBias;
    const bool in = (x & kSiluTabOut) == 0, want = mag >= 0x3300 && mag < 0x4300;
    if (in != want) { if (bad++ < 5) printf("range h=%04x\n", h); continue; }
    if (!in) continue;
    ++inr;
    const uint32_t off = silu_tab_off(x);
    const float g = u2f(h << 16);
    if (off % 4 || off / 4 >= kSiluTab || f2u(tab[off / 4]) != f2u(silu_fp32(g))) { if (bad++ < 5) printf("value h=%04x\n", h); }
  }
  // pairs in one word: the OR test of two x must equal the AND of the single tests
  for (uint32_t a = 0; a < 65536; a += 7) for (uint32_t b = 0; b < 65536; b += 13) {
    const uint32_t xa = a * 4u - kSiluTabBias, xb = b * 4u - kSiluTabBias;
    if ((((xa | xb) & kSiluTabOut) == 0) != (((xa & kSiluTabOut) == 0) && ((xb & kSiluTabOut) == 0))) { if (bad++ < 5) printf("or-test %x %x\n", a, b); }
  }
  printf("bf16 patterns in table range: %d, failures: %d\n", inr, bad);
  return bad != 0;
}
