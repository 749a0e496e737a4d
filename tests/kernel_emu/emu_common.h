// CPU emulation of the CUDA features that kernels/*.cu use, so that g++ can compile the real
// kernel sources and run them on the host (kernels/emu/emu.py builds and drives it; it is a test
// tool, never the serving path).
//
// What it emulates:
//   - A launch runs its CTAs one after another; each CTA's threads run as fibers (ucontext) on one
//     OS thread and switch only at barriers and warp collectives. Schedules: round-robin (threads
//     take turns, roughly lockstep), low-first and high-first (after every completed barrier the
//     lowest, or highest, runnable thread goes first, so those warps run far ahead of the others:
//     a missing __syncthreads lets them read shared memory not yet written, or overwrite what
//     others still read).
//   - __syncthreads / __syncwarp; __shfl_xor_sync, ldmatrix(.trans) and mma.sync m16n8k16 as warp
//     collectives built from the PTX ISA fragment tables. Every lane of the warp must be live and
//     at the same collective, or the launch fails.
//   - cp.async: "late" copies land at the cp.async.wait_group that retires their group (a missing
//     wait reads stale or poisoned shared memory), "early" ones at issue. Alignment and bounds of
//     every cp.async and ldmatrix address are checked.
//   - Dynamic shared memory starts as 0xff bytes (NaN in fp16, bf16 and fp32) in every CTA, and
//     is followed by a guard checked when the CTA ends (a store just past its end fails).
//   - kernels/common.cu is NOT compiled: its inline PTX is replaced by the C++ below (conversions
//     with round-to-nearest-even, MMA in fp32 with the products summed in k order). The FP8
//     conversions are common.cu's own integer code (its path below sm_89), copied verbatim
//     between the fp8-software markers; the sm_89+ cvt instructions are not exercised here.
//
// What it does not model: timing, occupancy, register limits and __launch_bounds__, bank
// conflicts, the memory model beyond the cp.async and barrier orderings above (plain global and
// shared stores are visible at once; no race detector), out-of-bounds global accesses (a wild
// pointer crashes the host process), static __shared__ arrays (plain statics: zeroed once, kept
// across CTAs and launches, not poisoned), and exact transcendental rounding (exp2f, expf and
// rsqrtf are the host libm's, within a few ulp of the GPU's). Bugs in common.cu's PTX are out of
// reach; nvcc (tests/test_kernels_compile.py) and the GPU tests cover those.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)
#define __shared__ static
#define LLMSERVE_DEVICE inline

using std::max;
using std::min;

namespace emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct Copy {
  size_t dst;  // offset into the CTA's dynamic shared memory
  const void* src;
  bool valid;  // false: zero-fill, read nothing
};

struct Fiber {
  ucontext_t ctx;
  Dim3 tid;
  int linear = 0;
  bool done = false;
  const long* waiting_on = nullptr;  // a barrier's generation, while blocked at it
  long waiting_since = 0;            // the generation it arrived in
  std::vector<Copy> uncommitted;
  std::vector<std::vector<Copy>> groups;  // committed, oldest first
};

// Per-warp scratch through which the lanes of a collective exchange their operands.
constexpr int kExchangeWords = 8;  // words 0-5 operands, word 7 the collective's id
struct Warp {
  int arrived = 0, live = 0;
  long generation = 0;
  uint64_t exchange[32 * kExchangeWords] = {};
};

struct Cta {
  Dim3 bid, bdim, gdim;
  std::vector<unsigned char> smem;  // dynamic shared memory, then kGuardBytes of 0xff
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int arrived = 0, live = 0;
  long generation = 0;
};

enum Flags : int { kLateCopies = 1, kGreedy = 2, kHighFirst = 4 };
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 64;

inline Cta* g_cta = nullptr;
inline Fiber* g_cur = nullptr;  // the running fiber; nullptr in the scheduler
inline ucontext_t g_sched;
inline long g_completions = 0;  // barriers completed and threads finished (greedy restarts)
inline long g_events = 0;       // completions plus arrivals (deadlock detection)
inline int g_flags = kLateCopies;
inline std::function<void()> g_body;
inline std::vector<std::unique_ptr<char[]>> g_stacks;  // reused by every CTA of every launch
inline bool g_failed = false;
inline char g_error[512] = "";

inline void yield() { swapcontext(&g_cur->ctx, &g_sched); }

// Records the first error of a launch and abandons the CTA: a fiber never runs again.
inline void fail(const char* fmt, ...) {
  if (!g_failed) {
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(g_error, sizeof(g_error), fmt, args);
    va_end(args);
    g_failed = true;
  }
  if (g_cur != nullptr) {
    swapcontext(&g_cur->ctx, &g_sched);
    std::abort();  // unreachable: the scheduler does not resume a failed launch
  }
}

inline size_t dyn_smem_bytes() { return g_cta->smem.size() - kGuardBytes; }
inline Warp& my_warp() { return g_cta->warps[g_cur->linear / 32]; }
inline int my_lane() { return g_cur->linear % 32; }

inline void land(const Copy& c) {
  if (c.valid) std::memcpy(g_cta->smem.data() + c.dst, c.src, 16);
  else std::memset(g_cta->smem.data() + c.dst, 0, 16);
}

// A barrier completes when every live thread has arrived; exiting threads stop counting.
inline void complete_if_full(int& arrived, int live, long& generation) {
  if (live > 0 && arrived == live) {
    arrived = 0;
    generation++;
    g_completions++;
  }
}

inline void fiber_entry() {
  g_body();
  Fiber* f = g_cur;
  f->done = true;
  for (auto& g : f->groups)  // copies still in flight land when the thread exits
    for (auto& c : g) land(c);
  for (auto& c : f->uncommitted) land(c);
  Warp& w = my_warp();
  w.live--;
  g_cta->live--;
  complete_if_full(w.arrived, w.live, w.generation);
  complete_if_full(g_cta->arrived, g_cta->live, g_cta->generation);
  g_completions++;
  g_events++;
  swapcontext(&f->ctx, &g_sched);
}

inline void wait_at(int& arrived, int live, long& generation) {
  const long gen = generation;
  ++arrived;
  g_events++;
  complete_if_full(arrived, live, generation);
  g_cur->waiting_on = &generation;  // lets the scheduler skip this fiber without switching to it
  g_cur->waiting_since = gen;
  while (generation == gen) yield();
  g_cur->waiting_on = nullptr;
}

inline void warp_barrier() {
  Warp& w = my_warp();
  wait_at(w.arrived, w.live, w.generation);
}

inline void cta_barrier() { wait_at(g_cta->arrived, g_cta->live, g_cta->generation); }

// Enter a warp collective: all 32 lanes live, and (after `exchange` is published by the caller
// and this barrier) every lane at the same collective `id`.
inline void collective_barrier(const char* what, uint64_t id) {
  Warp& w = my_warp();
  if (w.live != 32)
    fail("%s with %d of 32 lanes of warp %d live (block (%u,%u,%u))", what, w.live,
         g_cur->linear / 32, g_cta->bid.x, g_cta->bid.y, g_cta->bid.z);
  w.exchange[my_lane() * kExchangeWords + 7] = id;
  warp_barrier();
  for (int l = 0; l < 32; ++l)
    if (w.exchange[l * kExchangeWords + 7] != id)
      fail("%s: lanes of warp %d are at different warp collectives", what, g_cur->linear / 32);
}

inline unsigned char* dyn_smem() { return g_cta->smem.data(); }

inline void make_fibers(Cta& cta, int nthreads) {
  while (int(g_stacks.size()) < nthreads) g_stacks.emplace_back(new char[kStackBytes]);
  for (int t = 0; t < nthreads; ++t) {
    Fiber& f = cta.fibers[t];
    f.linear = t;
    f.tid = {unsigned(t % cta.bdim.x), unsigned((t / cta.bdim.x) % cta.bdim.y),
             unsigned(t / (cta.bdim.x * cta.bdim.y))};
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = g_stacks[t].get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
}

// Runs the CTA's fibers until all are done; false on a failure or a deadlock.
inline bool run_cta(Cta& cta) {
  for (;;) {
    const long events = g_events;
    int remaining = 0;
    const int n = int(cta.fibers.size());
    for (int i = 0; i < n; ++i) {
      Fiber& f = cta.fibers[(g_flags & kHighFirst) ? n - 1 - i : i];
      if (f.done) continue;
      if (f.waiting_on != nullptr && *f.waiting_on == f.waiting_since) {
        remaining++;  // still blocked
        continue;
      }
      const long mark = g_completions;
      g_cur = &f;
      swapcontext(&g_sched, &f.ctx);
      g_cur = nullptr;
      if (g_failed) return false;
      if (!f.done) remaining++;
      if ((g_flags & kGreedy) && g_completions != mark) {
        remaining = -1;  // start again from the first thread in schedule order
        break;
      }
    }
    if (remaining == 0) return true;
    if (remaining > 0 && g_events == events) {
      fail("deadlock in block (%u,%u,%u): %d threads wait at barriers the others never reach",
           cta.bid.x, cta.bid.y, cta.bid.z, remaining);
      return false;
    }
  }
}

inline bool run_grid(Dim3 grid, Dim3 block, size_t smem_bytes, std::function<void()> body) {
  g_body = std::move(body);
  const int nthreads = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Cta cta;
        cta.bid = {bx, by, bz};
        cta.bdim = block;
        cta.gdim = grid;
        cta.smem.assign(smem_bytes + kGuardBytes, 0xff);
        cta.fibers.resize(nthreads);
        cta.warps.resize((nthreads + 31) / 32);
        for (int t = 0; t < nthreads; ++t) cta.warps[t / 32].live++;
        cta.live = nthreads;
        make_fibers(cta, nthreads);
        g_cta = &cta;
        const bool ok = run_cta(cta);
        g_cta = nullptr;
        if (!ok) return false;
        for (size_t i = smem_bytes; i < cta.smem.size(); ++i)
          if (cta.smem[i] != 0xff) {
            fail("block (%u,%u,%u) wrote past the end of its %zu bytes of dynamic shared memory",
                 bx, by, bz, smem_bytes);
            return false;
          }
      }
  return true;
}

}  // namespace emu

#define threadIdx (emu::g_cur->tid)
#define blockIdx (emu::g_cta->bid)
#define blockDim (emu::g_cta->bdim)
#define gridDim (emu::g_cta->gdim)

inline void __syncthreads() { emu::cta_barrier(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier(); }

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __uint_as_float(unsigned i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned i;
  std::memcpy(&i, &f, 4);
  return i;
}
// volatile keeps g++ from contracting these into a fused multiply-add.
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
inline float __fsub_rn(float a, float b) {
  volatile float r = a - b;
  return r;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

template <typename V>
inline V __shfl_xor_sync(unsigned, V v, int mask) {
  static_assert(sizeof(V) == 4, "32-bit shuffles only");
  emu::Warp& w = emu::my_warp();
  const int lane = emu::my_lane();
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  w.exchange[lane * emu::kExchangeWords] = bits;
  emu::collective_barrier("__shfl_xor_sync", 1000 + mask);
  const uint32_t other = uint32_t(w.exchange[(lane ^ mask) * emu::kExchangeWords]);
  emu::warp_barrier();
  V r;
  std::memcpy(&r, &other, 4);
  return r;
}

// ------------------------------------------------------------------------------------------------
// The replacement of kernels/common.cu (same names and signatures)

#define LLMSERVE_NEG_BIG (-1.0e30f)

struct alignas(2) f16_t {
  unsigned short bits;
};
struct alignas(2) bf16_t {
  unsigned short bits;
};
struct alignas(16) vec16_t {
  unsigned int w[4];
};
struct alignas(8) float2_t {
  float x, y;
};
struct alignas(8) vec8_t {
  unsigned int w[2];
};
struct alignas(1) fp8e4m3_t {
  unsigned char bits;
};
template <typename KV>
struct IsFp8 {
  static constexpr bool value = false;
};
template <>
struct IsFp8<fp8e4m3_t> {
  static constexpr bool value = true;
};

inline float neg_inf() { return -INFINITY; }

#define LLMSERVE_LOG2E 1.4426950408889634f

inline void add_sink(float sink_log2, float m, float& l, float& a) {
  const float top = fmaxf(m, sink_log2);
  const float c = exp2f(m - top);
  l = l * c + exp2f(sink_log2 - top);
  a *= c;
}

// fp8-software-begin
// FP8 E4M3 conversions in integer arithmetic: the path below sm_89 and, in the same words, the
// CPU emulator's (tests/test_kernels_emulated.py checks that the two copies stay identical).

// E4M3 byte -> fp16 bits, exact: every E4M3 value is a normal fp16. NaN -> NaN.
LLMSERVE_DEVICE unsigned int e4m3_to_f16_bits(unsigned int b) {
  const unsigned int sign = (b & 0x80u) << 8;
  const unsigned int exponent = (b >> 3) & 0xfu, mantissa = b & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return sign | 0x7e00u;
  if (exponent != 0u) return sign | ((exponent + 8u) << 10) | (mantissa << 7);
  if (mantissa == 0u) return sign;
  // subnormal: mantissa * 2^-9 = 2^(p - 9) * (1 + rest / 2^p), p the leading bit's position
  const unsigned int p = mantissa >= 4u ? 2u : (mantissa >= 2u ? 1u : 0u);
  return sign | ((p + 6u) << 10) | ((mantissa - (1u << p)) << (10u - p));
}

// float -> E4M3 byte, rounded to nearest even; beyond +-448 (infinities too) saturates to +-448;
// NaN -> NaN.
LLMSERVE_DEVICE unsigned int float_to_e4m3_bits(float f) {
  const unsigned int u = __float_as_uint(f);
  const unsigned int sign = (u >> 24) & 0x80u;
  const unsigned int magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7fu;   // NaN
  if (magnitude >= 0x43e00000u) return sign | 0x7eu;  // >= 448: saturate
  if (magnitude < 0x3c800000u) {                      // below 2^-6: units of 2^-9
    const unsigned int shift = 141u - (magnitude >> 23);  // units = significand >> shift
    if (shift > 24u) return sign;                         // below half a unit
    const unsigned int m = 0x800000u | (magnitude & 0x7fffffu);
    unsigned int units = m >> shift;
    const unsigned int rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (units & 1u))) units++;
    return sign | units;  // 8 units is 2^-6, the smallest normal: the same bits
  }
  unsigned int bits = (magnitude >> 20) - (120u << 3);  // rebias the exponent 127 -> 7
  const unsigned int rest = magnitude & 0xfffffu;       // the 20 bits dropped
  if (rest > 0x80000u || (rest == 0x80000u && (bits & 1u))) bits++;
  return sign | bits;  // below 448, so a carry never reaches the NaN pattern
}
// fp8-software-end

// As common.cu's code below sm_89: the software conversions above, element by element.
inline unsigned e4m3x2_to_f16x2(unsigned two) {
  return e4m3_to_f16_bits(two & 0xffu) | (e4m3_to_f16_bits((two >> 8) & 0xffu) << 16);
}
inline unsigned float2_to_e4m3x2(float lo, float hi) {
  return float_to_e4m3_bits(lo) | (float_to_e4m3_bits(hi) << 8);
}

// fp16 <-> fp32 in integer arithmetic (no _Float16, which older g++ lack in C++).
inline float f16_bits_to_float(unsigned short h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = std::ldexp(float(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return __uint_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}
// Round to nearest even, as cvt.rn.f16.f32.
inline unsigned short float_to_f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);  // NaN
  if (magnitude >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520: inf
  if (magnitude < 0x38800000u) {  // below 2^-14: units of 2^-24 (1024 units: the min normal)
    const int shift = 126 - int(magnitude >> 23);  // value = m * 2^-shift units, shift >= 14
    if (shift > 24) return (unsigned short)sign;   // below half a unit
    const uint32_t m = 0x800000u | (magnitude & 0x7fffffu);
    uint32_t units = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (units & 1u))) units++;
    return (unsigned short)(sign | units);
  }
  uint32_t h = (magnitude >> 13) - (112u << 10);  // rebias the exponent 127 -> 15
  const uint32_t rest = magnitude & 0x1fffu;       // the 13 bits dropped
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;  // a carry may reach the exponent
  return (unsigned short)(sign | h);
}
inline float bf16_bits_to_float(unsigned short b) { return __uint_as_float(unsigned(b) << 16); }
inline unsigned short float_to_bf16_bits(float f) {  // cvt.rn.bf16.f32
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

namespace emu {
// d (16x8 fp32) += a (16x16) * b (16x8), fragments per the PTX ISA tables for m16n8k16:
//   A: a[r] holds two halves; row = gid (+8 for regs 1, 3), col = 2*tig + half (+8 for regs 2, 3)
//   B: b[r] holds two halves; k = 2*tig + half (+8 for reg 1), n = gid
//   C: c[i]; row = gid (+8 for i >= 2), col = 2*tig + (i & 1)
// with gid = lane / 4, tig = lane % 4.
template <float (*CVT)(unsigned short)>
inline void warp_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  Warp& w = my_warp();
  const int lane = my_lane();
  uint64_t* ex = w.exchange;
  for (int i = 0; i < 4; ++i) ex[lane * kExchangeWords + i] = a[i];
  ex[lane * kExchangeWords + 4] = b0;
  ex[lane * kExchangeWords + 5] = b1;
  collective_barrier("mma.sync", 1);
  auto half = [&](int l, int reg, int k) {
    const uint32_t word = uint32_t(ex[l * kExchangeWords + reg]);
    return CVT((unsigned short)((k & 1) ? word >> 16 : word & 0xffff));
  };
  auto A = [&](int row, int k) {
    return half(4 * (row % 8) + (k % 8) / 2, (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), k);
  };
  auto B = [&](int k, int n) { return half(4 * n + (k % 8) / 2, 4 + (k >= 8 ? 1 : 0), k); };
  const int gid = lane >> 2, tig = lane & 3;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = gid + (i >= 2 ? 8 : 0);
    const int col = 2 * tig + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[i] = acc;
  }
  warp_barrier();  // every lane has read the exchange before anyone reuses it
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
}  // namespace emu

template <typename T>
struct DType;

template <>
struct DType<f16_t> {
  static float to_float(unsigned short bits) { return f16_bits_to_float(bits); }
  static unsigned short from_float(float f) { return float_to_f16_bits(f); }
  static unsigned pack2(float lo, float hi) {
    return unsigned(from_float(lo)) | (unsigned(from_float(hi)) << 16);
  }
  static void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    emu::warp_mma<f16_bits_to_float>(d, a, b0, b1);
  }
  static unsigned from_e4m3x2(unsigned two) { return e4m3x2_to_f16x2(two); }
};

template <>
struct DType<bf16_t> {
  static float to_float(unsigned short bits) { return bf16_bits_to_float(bits); }
  static unsigned short from_float(float f) { return float_to_bf16_bits(f); }
  static unsigned pack2(float lo, float hi) {
    return unsigned(from_float(lo)) | (unsigned(from_float(hi)) << 16);
  }
  static void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    emu::warp_mma<bf16_bits_to_float>(d, a, b0, b1);
  }
  static unsigned from_e4m3x2(unsigned two) {
    const unsigned h = e4m3x2_to_f16x2(two);
    return pack2(f16_bits_to_float((unsigned short)(h & 0xffffu)),
                 f16_bits_to_float((unsigned short)(h >> 16)));
  }
};

template <typename T>
inline float vec_get(const vec16_t& v, int i) {
  const unsigned int word = v.w[i >> 1];
  return DType<T>::to_float(static_cast<unsigned short>((i & 1) ? (word >> 16) : (word & 0xffffu)));
}
template <typename T>
inline void vec_set(vec16_t& v, int i, float f) {
  const unsigned int bits = DType<T>::from_float(f);
  unsigned int& word = v.w[i >> 1];
  word = (i & 1) ? ((word & 0x0000ffffu) | (bits << 16)) : ((word & 0xffff0000u) | bits);
}
template <typename T>
inline vec16_t e4m3x8_to(const vec8_t& v) {
  vec16_t r;
  r.w[0] = DType<T>::from_e4m3x2(v.w[0] & 0xffffu);
  r.w[1] = DType<T>::from_e4m3x2(v.w[0] >> 16);
  r.w[2] = DType<T>::from_e4m3x2(v.w[1] & 0xffffu);
  r.w[3] = DType<T>::from_e4m3x2(v.w[1] >> 16);
  return r;
}
template <typename T>
inline float round_to(float f) {
  return DType<T>::to_float(DType<T>::from_float(f));
}

// A "shared address" is the offset into the CTA's dynamic shared memory.
inline unsigned smem_addr(const void* p) {
  const unsigned char* base = emu::g_cta->smem.data();
  const unsigned char* q = static_cast<const unsigned char*>(p);
  if (q < base || q >= base + emu::dyn_smem_bytes())
    emu::fail("smem_addr of a pointer outside the dynamic shared memory");
  return unsigned(q - base);
}

inline void emu_check_shared_16(const char* what, size_t addr) {
  if (addr % 16) emu::fail("%s: shared address %zu is not 16-byte aligned", what, addr);
  if (addr + 16 > emu::dyn_smem_bytes())
    emu::fail("%s: shared address %zu + 16 is past the %zu bytes of dynamic shared memory", what,
              addr, emu::dyn_smem_bytes());
}

inline void cp_async_16(unsigned dst, const void* src, bool valid) {
  emu_check_shared_16("cp.async", dst);
  if (valid && reinterpret_cast<uintptr_t>(src) % 16)
    emu::fail("cp.async: global source %p is not 16-byte aligned", src);
  const emu::Copy c{dst, src, valid};
  if (emu::g_flags & emu::kLateCopies) emu::g_cur->uncommitted.push_back(c);
  else emu::land(c);
}
inline void cp_async_commit() {
  emu::g_cur->groups.push_back(std::move(emu::g_cur->uncommitted));
  emu::g_cur->uncommitted.clear();
}
template <int N>
inline void cp_async_wait() {
  auto& groups = emu::g_cur->groups;
  while (int(groups.size()) > N) {
    for (auto& c : groups.front()) emu::land(c);
    groups.erase(groups.begin());
  }
}

// Lane 8j + i gives the address of row i of matrix j; lane l receives word (l % 4) of row l / 4.
inline void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  emu::Warp& w = emu::my_warp();
  const int lane = emu::my_lane();
  emu_check_shared_16("ldmatrix", addr);
  w.exchange[lane * emu::kExchangeWords] = addr;
  emu::collective_barrier("ldmatrix", 2);
  const unsigned char* smem = emu::g_cta->smem.data();
  for (int j = 0; j < 4; ++j) {
    const unsigned row = unsigned(w.exchange[(8 * j + lane / 4) * emu::kExchangeWords]);
    std::memcpy(&r[j], smem + row + 4 * (lane % 4), 4);
  }
  emu::warp_barrier();
}

// Transposed: lane l receives elements (row 2(l%4), col l/4) and (row 2(l%4)+1, col l/4).
inline void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  emu::Warp& w = emu::my_warp();
  const int lane = emu::my_lane();
  emu_check_shared_16("ldmatrix.trans", addr);
  w.exchange[lane * emu::kExchangeWords] = addr;
  emu::collective_barrier("ldmatrix.trans", 3);
  const unsigned char* smem = emu::g_cta->smem.data();
  for (int j = 0; j < 4; ++j) {
    const unsigned row0 = unsigned(w.exchange[(8 * j + 2 * (lane % 4)) * emu::kExchangeWords]);
    const unsigned row1 = unsigned(w.exchange[(8 * j + 2 * (lane % 4) + 1) * emu::kExchangeWords]);
    unsigned short lo, hi;
    std::memcpy(&lo, smem + row0 + 2 * (lane / 4), 2);
    std::memcpy(&hi, smem + row1 + 2 * (lane / 4), 2);
    r[j] = unsigned(lo) | (unsigned(hi) << 16);
  }
  emu::warp_barrier();
}

inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
inline float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
inline float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// ------------------------------------------------------------------------------------------------
// Launch thunks: unpack CuPy-style kernel parameters (one pointer per argument), checking that
// each argument's size and kind match the kernel's parameter type.

template <typename A>
struct ArgCode {
  static constexpr char value = std::is_pointer_v<A>              ? 'Q'
                                : std::is_same_v<A, long long> ? 'q'
                                : std::is_same_v<A, int>       ? 'i'
                                : std::is_same_v<A, float>     ? 'f'
                                                               : '?';
};

template <typename... Args, size_t... I>
void emu_invoke(void (*fn)(Args...), void** params, std::index_sequence<I...>) {
  fn(*reinterpret_cast<std::remove_cv_t<Args>*>(params[I])...);
}

// Returns 0, or 1 with the reason in emu_last_error().
template <typename... Args>
int emu_launch(void (*fn)(Args...), const unsigned* dims, size_t smem, void** params,
               const char* codes, int nargs, int flags) {
  emu::g_failed = false;
  emu::g_error[0] = '\0';
  constexpr char want[] = {ArgCode<Args>::value..., 0};
  if (nargs != int(sizeof...(Args))) {
    emu::fail("%d arguments for a kernel of %zu parameters", nargs, sizeof...(Args));
    return 1;
  }
  for (int i = 0; i < nargs; ++i)
    if (codes[i] != want[i]) {
      emu::fail("argument %d has kind '%c', the parameter wants '%c'", i, codes[i], want[i]);
      return 1;
    }
  emu::g_flags = flags;
  auto body = [&] { emu_invoke(fn, params, std::index_sequence_for<Args...>{}); };
  const emu::Dim3 grid{dims[0], dims[1], dims[2]}, block{dims[3], dims[4], dims[5]};
  const bool ok = emu::run_grid(grid, block, smem, body);
  return ok ? 0 : 1;
}
