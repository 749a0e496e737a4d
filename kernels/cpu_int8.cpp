// Weight-only int8 linear for x86 CPUs with AVX2 + FMA: y = x W^T + b, W = q * scale + offset
// with q int8 [N, K] and one float scale and offset per group of `group` weights along K.
//
// Small batches (decode steps, M <= SMALL_M) are memory-bound: each thread takes tiles of TILE_N
// output rows and widens their int8 weights in registers as it multiplies: the weights cross
// the memory bus as int8, a quarter of float32's bytes. Larger batches are compute-bound: the
// weights are widened into a float32 scratch matrix once per call (N * K conversions, against
// M * N * K multiply-adds) and oneDNN's GEMM does the product.
#include <torch/extension.h>
#include <immintrin.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t TILE_N = 4;
constexpr int64_t FUSED_M = 4;
constexpr int64_t SMALL_M = 64;

// One row's int8 weights times their group scales plus offsets, into out[0..K).
inline void widen_row(const int8_t* q, const float* scales, const float* offsets, int64_t K,
                      int64_t group, float* out) {
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    const __m256 s = _mm256_set1_ps(scales[g0 / group]);
    const __m256 o = _mm256_set1_ps(offsets[g0 / group]);
    for (int64_t k = g0; k < g0 + group; k += 8) {
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
      __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      _mm256_storeu_ps(out + k, _mm256_fmadd_ps(f, s, o));
    }
  }
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// Decode-sized batches (M <= FUSED_M): each weight is widened in registers as it is used, the
// group's scale applied to the group's partial dot product and its offset through the x row's
// group sums (dot(x, q s + o) = s dot(x, q) + o sum(x)).
void fused_rows(const float* x, const float* xsum, const int8_t* q, const float* scales,
                const float* offsets, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                int64_t group, int64_t n0, int64_t rows) {
  const int64_t groups = K / group;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 total[TILE_N];
    for (int64_t r = 0; r < TILE_N; ++r) total[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 part[TILE_N];
      for (int64_t r = 0; r < TILE_N; ++r) part[r] = _mm256_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
        const __m256 xv = _mm256_loadu_ps(xm + k);
        for (int64_t r = 0; r < TILE_N; ++r) {
          const int8_t* qr = q + (n0 + (r < rows ? r : 0)) * K + k;
          __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr));
          part[r] = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), part[r]);
        }
      }
      for (int64_t r = 0; r < TILE_N; ++r) {
        const int64_t row = n0 + (r < rows ? r : 0);
        total[r] = _mm256_fmadd_ps(part[r], _mm256_set1_ps(scales[row * groups + g]), total[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = n0 + r;
      float out = hsum(total[r]) + (bias ? bias[row] : 0.0f);
      for (int64_t g = 0; g < groups; ++g) out += offsets[row * groups + g] * xsum[m * groups + g];
      y[m * N + row] = out;
    }
  }
}

// Larger batches: each tile's rows are widened once into an L1-sized buffer (scale and offset
// applied), then every x row is multiplied against it, four rows at a time.
void widened_rows(const float* x, const int8_t* q, const float* scales, const float* offsets,
                  const float* bias, float* y, int64_t M, int64_t N, int64_t K, int64_t group,
                  int64_t n0, int64_t rows, float* tile) {
  const int64_t groups = K / group;
  for (int64_t r = 0; r < TILE_N; ++r) {
    const int64_t row = n0 + (r < rows ? r : 0);
    widen_row(q + row * K, scales + row * groups, offsets + row * groups, K, group, tile + r * K);
  }
  int64_t m = 0;
  for (; m + 1 < M; m += 2) {  // two x rows per pass: each tile load feeds two FMAs
    const float* x0 = x + m * K;
    const float* x1 = x0 + K;
    __m256 a0[TILE_N], a1[TILE_N];
    for (int64_t r = 0; r < TILE_N; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 xv0 = _mm256_loadu_ps(x0 + k), xv1 = _mm256_loadu_ps(x1 + k);
      for (int64_t r = 0; r < TILE_N; ++r) {
        const __m256 w = _mm256_loadu_ps(tile + r * K + k);
        a0[r] = _mm256_fmadd_ps(xv0, w, a0[r]);
        a1[r] = _mm256_fmadd_ps(xv1, w, a1[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float b = bias ? bias[n0 + r] : 0.0f;
      y[m * N + n0 + r] = hsum(a0[r]) + b;
      y[(m + 1) * N + n0 + r] = hsum(a1[r]) + b;
    }
  }
  for (; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 acc[TILE_N];
    for (int64_t r = 0; r < TILE_N; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 xv = _mm256_loadu_ps(xm + k);
      for (int64_t r = 0; r < TILE_N; ++r) {
        acc[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(tile + r * K + k), acc[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      y[m * N + n0 + r] = hsum(acc[r]) + (bias ? bias[n0 + r] : 0.0f);
    }
  }
}

void small_batch(const float* x, const int8_t* q, const float* scales, const float* offsets,
                 const float* bias, float* y, int64_t M, int64_t N, int64_t K, int64_t group) {
  const int64_t groups = K / group, num_tiles = (N + TILE_N - 1) / TILE_N;
  std::vector<float> xsum(M * groups);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += x[m * K + k];
      xsum[m * groups + g] = sum;
    }
  }
  // torch's own OpenMP team (at::parallel_for; torch's libgomp is the one loaded).
  at::parallel_for(0, num_tiles, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(M > FUSED_M ? TILE_N * K : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE_N, rows = std::min(TILE_N, N - n0);
      if (M > FUSED_M) {
        widened_rows(x, q, scales, offsets, bias, y, M, N, K, group, n0, rows, tile.data());
      } else {
        fused_rows(x, xsum.data(), q, scales, offsets, bias, y, M, N, K, group, n0, rows);
      }
    }
  });
}

}  // namespace

// x [M, K] float32, q [N, K] int8, scales and offsets [N, K / group] float32, bias [N] float32
// or None.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                          torch::Tensor offsets, int64_t group, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "int8_linear: x must be a contiguous float32 [M, K] matrix");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.size(1) == x.size(1),
              "int8_linear: q must be a contiguous int8 [N, K] matrix, K as x's");
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1);
  TORCH_CHECK(group % 8 == 0 && K % group == 0, "int8_linear: group must be a multiple of 8 dividing K");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
                  scales.numel() == N * (K / group),
              "int8_linear: scales must be contiguous float32 [N, K / group]");
  TORCH_CHECK(offsets.scalar_type() == torch::kFloat32 && offsets.is_contiguous() &&
                  offsets.numel() == scales.numel(),
              "int8_linear: offsets must be contiguous float32 [N, K / group]");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == N, "int8_linear: bias");
    b = bias->data_ptr<float>();
  }
  if (M > SMALL_M) {
    auto w = torch::empty({N, K}, x.options());
    float* wp = w.data_ptr<float>();
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* sp = scales.data_ptr<float>();
    const float* op = offsets.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        widen_row(qp + n * K, sp + n * (K / group), op + n * (K / group), K, group, wp + n * K);
      }
    });
    return bias.has_value() ? torch::addmm(*bias, x, w.t()) : torch::mm(x, w.t());
  }
  auto y = torch::empty({M, N}, x.options());
  small_batch(x.data_ptr<float>(), q.data_ptr<int8_t>(), scales.data_ptr<float>(),
              offsets.data_ptr<float>(), b, y.data_ptr<float>(), M, N, K, group);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "weight-only int8 linear (AVX2)");
}
