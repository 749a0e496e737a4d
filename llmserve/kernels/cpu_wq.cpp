// Weight-only quantized linear for x86 CPUs: y = x W^T + b, the weights kept as a checkpoint
// ships them and dequantized in registers inside the product, w = q * scale + offset with one
// float scale and offset per `group` weights along K (offset = -zero * scale; 0 where the
// format is symmetric or float). Four stored kinds:
//   KIND_INT8 (0): int8 q (W8A16: compressed-tensors int-quantized, GPTQ 8-bit);
//   KIND_INT4 (1): unsigned 4-bit q (W4A16: compressed-tensors pack-quantized, GPTQ, AWQ);
//   KIND_FP8  (2): float8 e4m3fn bytes (FP8 block-scaled, compressed-tensors float-quantized),
//     widened by bit arithmetic: ((b & 0x7f) << 20 | (b & 0x80) << 24) read as float32 is the
//     e4m3 value times 2^-120, subnormals included (as float32 subnormals), so one multiply
//     by 2^120 finishes it. NaN (0x7f) is not kept: no checkpoint stores one.
//   KIND_FP4  (3): e2m1 codes (MXFP4, gpt-oss's experts), nibbles packed as int4's, widened
//     through the 16-value table (0, 0.5, 1, 1.5, 2, 3, 4, 6, then their negatives) in
//     registers: exact; the block's e8m0 scale is the float32 scale (a power of two).
//
// Layout (kernels/cpu_wq.py: pack_wq): column tiles of TILE_N = 16 output channels, K-major
// inside a tile: q [N / 16][K][16] bytes (int4, fp4: [N / 16][K][8], byte j = channel j |
// channel j + 8 << 4), scales and offsets [N / 16][ceil(K / group)][16] float32 (the last group may be
// partial: SmolLM2's K = 576 in groups of 128). Threads split the tiles.
// Per tile, up to ROWS_M = 4 rows of x (decode) widen the tile's 16 weights at each k in
// registers; more rows widen the tile once into a [K][16] buffer and run a 6-row float32
// micro-kernel over it (kernels/cpu_wq.py sends 128 rows and more to torch's GEMM on the whole
// weight widened: wq_widen).
//
// ISAs: AVX2 + FMA (16 lanes as two 8-float registers) and AVX-512 F/BW/VL (one register), both
// compiled into this library (each its own `#pragma GCC target` region over cpu_wq_tile.h) and
// chosen at run time by CPUID (`isa` 0), or forced (1: AVX2, 2: AVX-512) for the tests.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t TILE_N = 16;
constexpr int64_t ROWS_M = 4;
constexpr int64_t BUFFERED_ROWS = 6;
constexpr int KIND_INT8 = 0, KIND_INT4 = 1, KIND_FP8 = 2, KIND_FP4 = 3;

struct Args {
  const float* x;
  const uint8_t* q;
  const float* scales;
  const float* offsets;
  const float* bias;  // padded to N, or nullptr
  float* y;
  int64_t M, N, K, group, tiles, kind;
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
struct W16 {
  __m256 lo, hi;
};
inline W16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline W16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, W16 w) {
  _mm256_storeu_ps(p, w.lo);
  _mm256_storeu_ps(p + 8, w.hi);
}
inline void fma16(float x, W16 w, W16& acc) {
  const __m256 xb = _mm256_set1_ps(x);
  acc.lo = _mm256_fmadd_ps(xb, w.lo, acc.lo);
  acc.hi = _mm256_fmadd_ps(xb, w.hi, acc.hi);
}
inline void add_store(W16 acc, const float* bias, float* out) {
  if (bias) {
    acc.lo = _mm256_add_ps(acc.lo, _mm256_loadu_ps(bias));
    acc.hi = _mm256_add_ps(acc.hi, _mm256_loadu_ps(bias + 8));
  }
  store16(out, acc);
}
inline __m256i bytes8(const uint8_t* q) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
}
inline __m256 fp8_lanes(__m256i v) {
  const __m256i bits = _mm256_or_si256(
      _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7f)), 20),
      _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}
// e2m1 codes (0..15, in 32-bit lanes) -> their values: the magnitude by a permute of the 8
// magnitudes (the low 3 bits pick), the sign bit 3 moved to bit 31
inline __m256 fp4_lanes(__m256i codes) {
  const __m256 magnitudes = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
  return _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, codes), _mm256_castsi256_ps(sign));
}
template <int KIND>
inline W16 widen(const uint8_t* q, W16 s, W16 o) {
  __m256 lo, hi;
  if constexpr (KIND == KIND_FP4) {
    const __m256i v = bytes8(q);
    lo = fp4_lanes(_mm256_and_si256(v, _mm256_set1_epi32(0xf)));
    hi = fp4_lanes(_mm256_srli_epi32(v, 4));
  } else if constexpr (KIND == KIND_INT4) {
    const __m256i v = bytes8(q);
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xf)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  } else if constexpr (KIND == KIND_INT8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
  } else {
    lo = fp8_lanes(bytes8(q));
    hi = fp8_lanes(bytes8(q + 8));
  }
  return {_mm256_fmadd_ps(lo, s.lo, o.lo), _mm256_fmadd_ps(hi, s.hi, o.hi)};
}
#include "cpu_wq_tile.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl")
namespace avx512 {
struct W16 {
  __m512 v;
};
inline W16 zero16() { return {_mm512_setzero_ps()}; }
inline W16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, W16 w) { _mm512_storeu_ps(p, w.v); }
inline void fma16(float x, W16 w, W16& acc) {
  acc.v = _mm512_fmadd_ps(_mm512_set1_ps(x), w.v, acc.v);
}
inline void add_store(W16 acc, const float* bias, float* out) {
  if (bias) acc.v = _mm512_add_ps(acc.v, _mm512_loadu_ps(bias));
  store16(out, acc);
}
template <int KIND>
inline W16 widen(const uint8_t* q, W16 s, W16 o) {
  __m512 f;
  if constexpr (KIND == KIND_INT4 || KIND == KIND_FP4) {
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0xf));
    const __m256i hi = _mm256_srli_epi32(v, 4);
    const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    if constexpr (KIND == KIND_FP4) {  // the 16 e2m1 values, one permute
      const __m512 values = _mm512_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f,
                                           -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
      f = _mm512_permutexvar_ps(nibbles, values);
    } else {
      f = _mm512_cvtepi32_ps(nibbles);
    }
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    if constexpr (KIND == KIND_INT8) {
      f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    } else {
      const __m512i v = _mm512_cvtepu8_epi32(b);
      const __m512i bits = _mm512_or_si512(
          _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7f)), 20),
          _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24));
      f = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
    }
  }
  return {_mm512_fmadd_ps(f, s.v, o.v)};
}
#include "cpu_wq_tile.h"
}  // namespace avx512
#pragma GCC pop_options

namespace {

bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

bool use_avx512(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 2, "wq: isa must be 0 (auto), 1 (AVX2) or 2 (AVX-512)");
  TORCH_CHECK(isa != 2 || cpu_has_avx512(), "wq: isa=2 asks for AVX-512, which this CPU lacks");
  return isa == 2 || (isa == 0 && cpu_has_avx512());
}

Args check(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& offsets,
           int64_t kind, int64_t group) {
  TORCH_CHECK(kind >= KIND_INT8 && kind <= KIND_FP4,
              "wq: kind must be 0 (int8), 1 (int4), 2 (fp8), 3 (fp4)");
  const int64_t width = kind == KIND_INT4 || kind == KIND_FP4 ? 8 : 16;
  TORCH_CHECK(q.dim() == 3 && q.size(2) == width && q.scalar_type() == at::kByte &&
                  q.is_contiguous(),
              "wq: q must be packed uint8 [N / 16, K, ", width, "] for kind ", kind);
  Args a{};
  a.tiles = q.size(0);
  a.N = a.tiles * TILE_N;
  a.K = q.size(1);
  a.group = group;
  a.kind = kind;
  TORCH_CHECK(group > 0, "wq: group=", group, " must be positive");
  const int64_t groups = (a.K + group - 1) / group;
  for (const auto& t : {scales, offsets}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.numel() == a.tiles * groups * TILE_N,
                "wq: scales and offsets must be packed float32 [N / 16, ceil(K / group), 16]");
  }
  a.q = q.data_ptr<uint8_t>();
  a.scales = scales.data_ptr<float>();
  a.offsets = offsets.data_ptr<float>();
  return a;
}

}  // namespace

// x [M, K] float32 times the packed W^T (+ bias [N padded] float32) -> y [M, N padded].
at::Tensor wq_linear(at::Tensor x, at::Tensor q, at::Tensor scales, at::Tensor offsets,
                     int64_t kind, int64_t group, std::optional<at::Tensor> bias, int64_t isa) {
  Args a = check(q, scales, offsets, kind, group);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.size(1) == a.K,
              "wq_linear: x must be a contiguous float32 [M, K] matrix, K=", a.K);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == a.N,
                "wq_linear: bias must be contiguous float32 [N padded to 16]");
    a.bias = bias->data_ptr<float>();
  }
  a.M = x.size(0);
  auto y = at::empty({a.M, a.N}, x.options());
  a.x = x.data_ptr<float>();
  a.y = y.data_ptr<float>();
  if (a.M > 0) use_avx512(isa) ? avx512::run(a) : avx2::run(a);
  return y;
}

// The packed weight widened to float32 into out [N padded, K]: for products of many rows.
void wq_widen(at::Tensor q, at::Tensor scales, at::Tensor offsets, int64_t kind, int64_t group,
              at::Tensor out, int64_t isa) {
  Args a = check(q, scales, offsets, kind, group);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.numel() == a.N * a.K,
              "wq_widen: out must be contiguous float32 [N padded, K]");
  use_avx512(isa) ? avx512::widen_all(a, out.data_ptr<float>())
                  : avx2::widen_all(a, out.data_ptr<float>());
}

bool wq_has_avx512() { return cpu_has_avx512(); }

TORCH_LIBRARY(llmserve_cpu_wq, m) {
  m.def("wq_linear", &wq_linear);  // weight-only int8 / int4 / fp8 / fp4 linear on packed tiles
  m.def("wq_widen", &wq_widen);    // a packed weight widened to float32 [N, K]
  m.def("wq_has_avx512", &wq_has_avx512);
}
