// GGUF-quantized linear layers on x86 CPUs: y = x W^T with W kept as the GGUF file stores it
// (Q4_0, Q4_1, Q8_0 and Q4_K blocks, one row of W after another: w uint8 [N, row_bytes]).
//
// gguf_linear quantizes x per block of 32 along K to int16 (a scale per block: amax / 32767) or
// int8 (amax / 127, as GGUF's Q8_0), then each output is a sum over blocks of integer dot
// products, the weights unpacked from their nibbles in registers (kernels/cpu_gguf_dot.h).
// Threads split the N outputs; up to 4 rows of x, each row of W is unpacked in registers; for
// more, once per output into int16 levels that 8 rows of x at a time then read. Two builds of the inner loops, chosen at run time:
// AVX2 (maddubs / madd) and, where the CPU has AVX-512 VNNI and VL, vpdpbusd / vpdpwssd on
// 256-bit lanes.
//
// gguf_dequantize widens W to float32 [N, K] (the prefill path's GEMM runs on it; the tests
// compare it with the gguf package's dequantizer).
// Registered as torch operators (torch.ops.llmserve_cpu_gguf.*) with only the ATen headers they
// need (kernels/cpu_build.py: torch/extension.h and pybind11 take 4x as long to compile).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/to.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// ggml type ids
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K's 8 six-bit scales and mins from its 12 packed bytes (GGUF's layout: bytes 0-3 hold
// scales 0-3 and the top 2 bits of scales 4-7, 4-7 the mins likewise, 8-11 the low 4 bits).
inline void q4k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

struct Format {
  int64_t elems, bytes;  // per block
};

Format format_of(int64_t fmt) {
  switch (fmt) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
  }
  TORCH_CHECK(false, "gguf: unsupported ggml type ", fmt, " (Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12)");
}

struct Problem {
  const uint8_t* w;
  int64_t row_bytes, fmt, M, N, K, act_bits;
  const void* xq;  // int8 or int16 [M, K]
  const float* xd;
  const float* xs;
  float* y;
};

namespace avx2 {
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
inline __m256i dot_s16(__m256i a0, __m256i x0, __m256i a1, __m256i x1) {
  return _mm256_add_epi32(_mm256_madd_epi16(a0, x0), _mm256_madd_epi16(a1, x1));
}
#include "cpu_gguf_dot.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
inline __m256i dot_s16(__m256i a0, __m256i x0, __m256i a1, __m256i x1) {
  return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), a0, x0), a1, x1);
}
#include "cpu_gguf_dot.h"
}  // namespace vnni
#pragma GCC pop_options

// Blocks [i0, i1) of 32 values of x (contiguous rows, so block i is row i / (K / 32)) -> q (int8
// or int16: the block's amax maps to the type's largest value), d[i] and s[i] = d[i] * sum(q).
template <typename ACT>
void quantize_blocks(const float* x, int64_t i0, int64_t i1, ACT* q, float* d, float* s) {
  constexpr float top = sizeof(ACT) == 1 ? 127.0f : 32767.0f;
  for (int64_t i = i0; i < i1; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / top, inv = amax > 0.0f ? top / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
      q[i * 32 + j] = static_cast<ACT>(v);
      sum += v;
    }
    d[i] = scale;
    s[i] = scale * static_cast<float>(sum);
  }
}

// quantize_blocks with the activation type chosen by act_bits (8: int8, else int16).
inline void quantize_span(const float* x, int64_t i0, int64_t i1, int64_t act_bits, void* q,
                          float* d, float* s) {
  if (act_bits == 8) {
    quantize_blocks(x, i0, i1, static_cast<int8_t*>(q), d, s);
  } else {
    quantize_blocks(x, i0, i1, static_cast<int16_t*>(q), d, s);
  }
}

// x [M, K] -> q [M, K], d and s [M, K / 32], the blocks split over the threads.
template <typename ACT>
void quantize_rows(const float* x, int64_t M, int64_t K, ACT* q, float* d, float* s) {
  at::parallel_for(0, M * (K / 32), 64, [&](int64_t begin, int64_t end) {
    quantize_blocks(x, begin, end, q, d, s);
  });
}

void check_weight(const at::Tensor& w, int64_t fmt, int64_t K) {
  const Format f = format_of(fmt);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf: w must be contiguous uint8 [N, row_bytes]");
  TORCH_CHECK(K % f.elems == 0 && w.size(1) == K / f.elems * f.bytes, "gguf: a row of K=", K,
              " takes ", K / f.elems * f.bytes, " bytes in ggml type ", fmt, ", w has ", w.size(1));
}

}  // namespace

bool has_vnni() {
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw");
}

// x [M, K] float32 contiguous; w uint8 [N, row_bytes] (GGUF blocks of ggml type fmt); y [M, N].
// act_bits: x quantized to int8 (8) or int16 (16) per block of 32.
at::Tensor gguf_linear(at::Tensor x, at::Tensor w, int64_t fmt, bool vnni,
                          int64_t act_bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gguf_linear: x must be a contiguous float32 [M, K] matrix");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, fmt, K);
  TORCH_CHECK(!vnni || has_vnni(), "gguf_linear: this CPU has no AVX-512 VNNI");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "gguf_linear: act_bits must be 8 or 16");
  auto xq = at::empty({M, K}, x.options().dtype(act_bits == 8 ? at::kChar : at::kShort));
  auto xd = at::empty({M, K / 32}, x.options());
  auto xs = at::empty({M, K / 32}, x.options());
  if (act_bits == 8) {
    quantize_rows(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xd.data_ptr<float>(),
                  xs.data_ptr<float>());
  } else {
    quantize_rows(x.data_ptr<float>(), M, K, xq.data_ptr<int16_t>(), xd.data_ptr<float>(),
                  xs.data_ptr<float>());
  }
  auto y = at::empty({M, N}, x.options());
  // more than 4 int16 rows: the outputs are written as y^T [N, M] (cpu_gguf_dot.h:
  // unpacked_range), then transposed here
  const bool transposed = act_bits == 16 && M > 4;
  auto yt = transposed ? at::empty({N, M}, x.options()) : y;
  const Problem pr{w.data_ptr<uint8_t>(), w.size(1), fmt, M, N, K, act_bits, xq.data_ptr(),
                   xd.data_ptr<float>(), xs.data_ptr<float>(), yt.data_ptr<float>()};
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (vnni) {
      vnni::outputs(pr, n0, n1);
    } else {
      avx2::outputs(pr, n0, n1);
    }
  });
  if (transposed) {
    const float* src = yt.data_ptr<float>();
    float* dst = y.data_ptr<float>();
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        for (int64_t n = 0; n < N; ++n) dst[m * N + n] = src[n * M + m];
      }
    });
  }
  return y;
}

// One block of ggml type fmt (elems values) into out.
void dequantize_block(const uint8_t* p, int64_t fmt, float* out) {
  if (fmt == Q4_K) {
    uint8_t sc[8], mn[8];
    q4k_scales(p + 4, sc, mn);
    const float d = f16(p), dmin = f16(p + 2);
    for (int c = 0; c < 4; ++c) {
      const uint8_t* q = p + 16 + 32 * c;
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        for (int i = 0; i < 32; ++i) {
          out[32 * j + i] = d * sc[j] * ((q[i] >> (4 * h)) & 15) - dmin * mn[j];
        }
      }
    }
    return;
  }
  const float d = f16(p);
  for (int i = 0; i < 32; ++i) {
    if (fmt == Q8_0) {
      out[i] = d * static_cast<int8_t>(p[2 + i]);
    } else {
      const uint8_t* qs = p + (fmt == Q4_0 ? 2 : 4);
      const int level = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
      out[i] = fmt == Q4_0 ? d * (level - 8) : d * level + f16(p + 2);
    }
  }
}

// w uint8 [N, row_bytes] of ggml type fmt -> out float32 [N, K].
void gguf_dequantize(at::Tensor w, int64_t fmt, at::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == w.size(0),
              "gguf_dequantize: out must be contiguous float32 [N, K]");
  const int64_t K = out.size(1);
  check_weight(w, fmt, K);
  const Format f = format_of(fmt);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, w.size(0), 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t b = 0; b < K / f.elems; ++b) {
        dequantize_block(wp + n * row_bytes + b * f.bytes, fmt, op + n * K + b * f.elems);
      }
    }
  });
}

#include "cpu_decode_layer.h"

TORCH_LIBRARY(llmserve_cpu_gguf, m) {
  m.def("decode_layer", &decode_layer);        // a decoder layer over decode rows, one call
  m.def("gguf_linear", &gguf_linear);          // x times GGUF-quantized W^T, x quantized per block
  m.def("gguf_dequantize", &gguf_dequantize);  // GGUF blocks widened to float32 [N, K]
  m.def("has_vnni", &has_vnni);                // whether this CPU has AVX-512 VNNI (and VL, BW)
}
