// Weight-only int8 linear for x86 CPUs with AVX2 + FMA: y = x W^T + b, W = q * scale + offset,
// q int8, one float scale and offset per group of `group` weights along K.
//
// The weights are packed once (kernels/cpu.py: pack_int8) in column tiles of TILE_N = 16 output
// channels, K-major inside a tile: q [N / 16][K][16], scales and offsets [N / 16][K / group][16],
// so the weights cross the memory bus as 10 bytes per 32 (float32: 128). Threads split the tiles.
// Per tile:
//   - up to ROWS_M = 4 rows of x (decode): for each k, the tile's 16 weights are widened to
//     float32 in two registers (scale and offset in one FMA), x[m][k] broadcast, 4 x 2 vectors
//     accumulated;
//   - more rows: the tile is widened once into a [K][16] buffer and a 6-row float32
//     micro-kernel runs over it (kernels/cpu.py sends 128 rows and more to torch's GEMM on a
//     widened copy instead: int8_widen).
// Registered as torch operators (torch.ops.llmserve_cpu_int8.*) with only the headers they need:
// torch/extension.h (pybind11 and all of ATen) took 4x as long to compile (42 s of CPU, 10 s).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t TILE_N = 16;
constexpr int64_t ROWS_M = 4;

inline __m256 widen(const int8_t* q, __m256 scale, __m256 offset) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale, offset);
}

// acc (+ bias) into y[m0 .. m0 + ROWS)[n0 .. n0 + 16) for tile t.
template <int ROWS>
inline void store_rows(__m256 (&acc)[ROWS][2], const float* bias, float* y, int64_t N,
                       int64_t t, int64_t m0) {
  const int64_t n0 = t * TILE_N;
  for (int m = 0; m < ROWS; ++m) {
    float* out = y + (m0 + m) * N + n0;
    if (bias) {
      acc[m][0] = _mm256_add_ps(acc[m][0], _mm256_loadu_ps(bias + n0));
      acc[m][1] = _mm256_add_ps(acc[m][1], _mm256_loadu_ps(bias + n0 + 8));
    }
    _mm256_storeu_ps(out, acc[m][0]);
    _mm256_storeu_ps(out + 8, acc[m][1]);
  }
}

// y[m0 .. m0 + rows)[n0 .. n0 + 16) for tile t.
template <int ROWS>
void tile_rows(const float* x, const int8_t* q, const float* scales, const float* offsets,
               const float* bias, float* y, int64_t N, int64_t K, int64_t group, int64_t t,
               int64_t m0) {
  const int64_t groups = K / group;
  const int8_t* qt = q + t * K * TILE_N;
  const float* st = scales + t * groups * TILE_N;
  const float* ot = offsets + t * groups * TILE_N;
  __m256 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s0 = _mm256_loadu_ps(st + g * TILE_N), s1 = _mm256_loadu_ps(st + g * TILE_N + 8);
    const __m256 o0 = _mm256_loadu_ps(ot + g * TILE_N), o1 = _mm256_loadu_ps(ot + g * TILE_N + 8);
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      const __m256 w0 = widen(qt + k * TILE_N, s0, o0);
      const __m256 w1 = widen(qt + k * TILE_N + 8, s1, o1);
      for (int m = 0; m < ROWS; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + (m0 + m) * K + k);
        acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
      }
    }
  }
  store_rows<ROWS>(acc, bias, y, N, t, m0);
}

// The same tile's weights widened once into `buf` [K][16] (scale and offset applied), then
// y[m0 .. m0 + ROWS) from it: no widening in the inner loop, 6 rows of x per pass.
void widen_tile(const int8_t* q, const float* scales, const float* offsets, int64_t K,
                int64_t group, int64_t t, float* buf) {
  const int64_t groups = K / group;
  const int8_t* qt = q + t * K * TILE_N;
  const float* st = scales + t * groups * TILE_N;
  const float* ot = offsets + t * groups * TILE_N;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s0 = _mm256_loadu_ps(st + g * TILE_N), s1 = _mm256_loadu_ps(st + g * TILE_N + 8);
    const __m256 o0 = _mm256_loadu_ps(ot + g * TILE_N), o1 = _mm256_loadu_ps(ot + g * TILE_N + 8);
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      _mm256_storeu_ps(buf + k * TILE_N, widen(qt + k * TILE_N, s0, o0));
      _mm256_storeu_ps(buf + k * TILE_N + 8, widen(qt + k * TILE_N + 8, s1, o1));
    }
  }
}

template <int ROWS>
void buffered_rows(const float* x, const float* buf, const float* bias, float* y, int64_t N,
                   int64_t K, int64_t t, int64_t m0) {
  __m256 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(buf + k * TILE_N), w1 = _mm256_loadu_ps(buf + k * TILE_N + 8);
    for (int m = 0; m < ROWS; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + (m0 + m) * K + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  store_rows<ROWS>(acc, bias, y, N, t, m0);
}

constexpr int64_t BUFFERED_ROWS = 6;

}  // namespace

// x [M, K] float32; q packed [N / 16, K, 16] int8; scales and offsets packed [N / 16, K / group,
// 16] float32; bias [N] float32 or None. N a multiple of 16, group a divisor of K.
at::Tensor int8_linear(at::Tensor x, at::Tensor q, at::Tensor scales,
                          at::Tensor offsets, int64_t group, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_linear: x must be a contiguous float32 [M, K] matrix");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == TILE_N && q.scalar_type() == at::kChar &&
                  q.is_contiguous() && q.size(1) == x.size(1),
              "int8_linear: q must be packed int8 [N / 16, K, 16], K as x's");
  const int64_t M = x.size(0), tiles = q.size(0), N = tiles * TILE_N, K = q.size(1);
  TORCH_CHECK(group > 0 && K % group == 0, "int8_linear: group must divide K");
  for (const auto& t : {scales, offsets}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.numel() == tiles * (K / group) * TILE_N,
                "int8_linear: scales and offsets must be packed float32 [N / 16, K / group, 16]");
  }
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "int8_linear: bias must be contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // torch's own OpenMP team (at::parallel_for; the libgomp it binds to is torch's).
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(M > ROWS_M ? K * TILE_N : 0);
    for (int64_t t = begin; t < end; ++t) {  // a tile's weights once; x rows stay in cache
      if (M > ROWS_M) {  // widened once into buf, then 6 rows of x per pass
        widen_tile(qp, sp, op, K, group, t, buf.data());
        for (int64_t m0 = 0; m0 < M; m0 += BUFFERED_ROWS) {
          switch (std::min(BUFFERED_ROWS, M - m0)) {
            case 6: buffered_rows<6>(xp, buf.data(), b, yp, N, K, t, m0); break;
            case 5: buffered_rows<5>(xp, buf.data(), b, yp, N, K, t, m0); break;
            case 4: buffered_rows<4>(xp, buf.data(), b, yp, N, K, t, m0); break;
            case 3: buffered_rows<3>(xp, buf.data(), b, yp, N, K, t, m0); break;
            case 2: buffered_rows<2>(xp, buf.data(), b, yp, N, K, t, m0); break;
            default: buffered_rows<1>(xp, buf.data(), b, yp, N, K, t, m0); break;
          }
        }
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += ROWS_M) {
        switch (std::min(ROWS_M, M - m0)) {
          case 4: tile_rows<4>(xp, qp, sp, op, b, yp, N, K, group, t, m0); break;
          case 3: tile_rows<3>(xp, qp, sp, op, b, yp, N, K, group, t, m0); break;
          case 2: tile_rows<2>(xp, qp, sp, op, b, yp, N, K, group, t, m0); break;
          default: tile_rows<1>(xp, qp, sp, op, b, yp, N, K, group, t, m0); break;
        }
      }
    }
  });
  return y;
}

// The packed weight widened to float32 into out [N, K] (N a multiple of 16): for products of
// many rows (prefill), where oneDNN's GEMM on the widened weight is faster than the micro-kernel.
void int8_widen(at::Tensor q, at::Tensor scales, at::Tensor offsets, int64_t group,
                at::Tensor out) {
  const int64_t tiles = q.size(0), K = q.size(1), groups = K / group;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.numel() == tiles * TILE_N * K,
              "int8_widen: out must be contiguous float32 [N, K]");
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* wp = out.data_ptr<float>();
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t g = (t * groups + k / group) * TILE_N;
        for (int64_t j = 0; j < TILE_N; ++j) {
          wp[(t * TILE_N + j) * K + k] = qp[(t * K + k) * TILE_N + j] * sp[g + j] + op[g + j];
        }
      }
    }
  });
}

TORCH_LIBRARY(llmserve_cpu_int8, m) {
  m.def("int8_linear", &int8_linear);  // weight-only int8 linear on packed tiles (AVX2)
  m.def("int8_widen", &int8_widen);    // a packed int8 weight widened to float32 [N, K]
}
