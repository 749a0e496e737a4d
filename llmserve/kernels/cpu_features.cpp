// Which SIMD features this CPU has AND the operating system lets a program use, read at run time
// (kernels/cpu_features.py). A feature counts only when CPUID reports it and the OS enabled its
// register state: XCR0 (xgetbv) bits 1-2 for AVX's ymm state, 5-7 for AVX-512's opmask and zmm
// state, 17-18 for AMX's tile config and data; for AMX, Linux also grants the tile data per
// process (arch_prctl ARCH_REQ_XCOMP_PERM, kernel 5.16+). A VM whose CPUID reports AMX while
// its XCR0 or kernel leaves the tiles off reports no AMX here, so AMX code never runs there.
//
// cpu_features() returns one 0/1 per name of FEATURES, in that order (kernels/cpu_features.py
// holds the same list). Built without -mavx so that it runs on any x86-64.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t ARCH_GET_XCOMP_SUPP = 0x1021, ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int64_t XFEATURE_XTILEDATA = 18;

struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(unsigned leaf, unsigned sub) {
  Regs r;
  if (__get_cpuid_max(0, nullptr) < leaf) return r;
  __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
  return r;
}

uint64_t xcr0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool bit(unsigned reg, int n) { return (reg >> n) & 1u; }

// Whether Linux lets this process use AMX tile data: the kernel supports the state and grants it.
bool amx_permitted() {
  uint64_t supported = 0;
  if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_SUPP, &supported) != 0) return false;
  if (!((supported >> XFEATURE_XTILEDATA) & 1u)) return false;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

}  // namespace

// avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx_vnni amx_tile amx_bf16
// amx_int8, each 0/1 as CPUID and the OS allow; then the raw XCR0 (0 without OSXSAVE).
std::vector<int64_t> cpu_features() {
  const Regs l1 = cpuid(1, 0), l7 = cpuid(7, 0), l71 = cpuid(7, 1);
  const bool osxsave = bit(l1.c, 27);
  const uint64_t xcr = osxsave ? xcr0() : 0;
  const bool ymm = (xcr & 0x6) == 0x6;            // SSE and AVX state
  const bool zmm = ymm && (xcr & 0xe0) == 0xe0;   // opmask, ZMM_Hi256, Hi16_ZMM
  const bool tiles = (xcr & 0x60000) == 0x60000;  // XTILECFG, XTILEDATA
  const bool avx512f = zmm && bit(l7.b, 16);
  const bool amx = tiles && bit(l7.d, 24) && amx_permitted();
  return {
      ymm && bit(l7.b, 5),                // avx2
      ymm && bit(l1.c, 12),               // fma
      ymm && bit(l1.c, 29),               // f16c
      avx512f,                            // avx512f
      avx512f && bit(l7.b, 30),           // avx512bw
      avx512f && bit(l7.b, 31),           // avx512vl
      avx512f && bit(l7.c, 11),           // avx512_vnni
      avx512f && bit(l71.a, 5),           // avx512_bf16
      ymm && bit(l71.a, 4),               // avx_vnni
      amx,                                // amx_tile
      amx && bit(l7.d, 22),               // amx_bf16
      amx && bit(l7.d, 25),               // amx_int8
      static_cast<int64_t>(xcr),
  };
}

TORCH_LIBRARY(llmserve_cpu_features, m) {
  m.def("cpu_features", &cpu_features);  // one 0/1 per feature, then XCR0
}
