// Batch-invariant LoRA for the CPU engine (engine/lora.py, kernels/cpu_lora.py): for every row t
// of the step with a slot s = slots[t] >= 0, and each part p of the projection,
//
//     out[t, columns[p] : columns[p] + OUT_p] += B_p[s]^T (A_p[s] x[t])      (first `rank` ranks)
//
// Each row is computed alone and always in the same order, whatever else the step holds: the
// shrink sums its input features in 8 fixed lanes (k = lane mod 8), then the lanes in a fixed
// order; the expand adds the ranks in ascending order. BLAS (torch.mm / bmm) picks its kernel by
// the number of rows (a row's update differed between a step of 1 and of 4 rows), which made a
// request's greedy tokens depend on its neighbours.
//
// Layout (float32, contiguous): x [T, IN]; out [T, OUT] (row stride OUT); slots [T] int32;
// a [S, R, P, IN] (ranks before parts: engine/lora.py's table); b: P tensors [S, R, OUT_p];
// columns: P offsets into a row of out. Rows are spread over torch's OpenMP team; each row is
// one thread's, so the split changes nothing in it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t LANES = 8;

// x . w over n features: 8 lanes of partial sums (k % 8), then the lanes summed in order.
inline float dot_fixed(const float* x, const float* w, int64_t n) {
  float lane[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + LANES <= n; k += LANES) {
    for (int64_t l = 0; l < LANES; ++l) lane[l] += x[k + l] * w[k + l];
  }
  for (int64_t l = 0; k < n; ++k, ++l) lane[l] += x[k] * w[k];
  float sum = 0.0f;
  for (int64_t l = 0; l < LANES; ++l) sum += lane[l];
  return sum;
}

}  // namespace

void lora_rows(const at::Tensor& x, const at::Tensor& out, const at::Tensor& slots,
               const at::Tensor& a, const std::vector<at::Tensor>& b,
               const std::vector<int64_t>& columns, int64_t rank) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && a.is_contiguous(), "contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32");
  TORCH_CHECK(a.dim() == 4 && slots.scalar_type() == at::kInt, "a [S, R, P, IN], int32 slots");
  const int64_t T = x.size(0), IN = x.size(1), OUT = out.size(1);
  const int64_t R = a.size(1), P = a.size(2);
  TORCH_CHECK(a.size(3) == IN && out.size(0) == T && slots.size(0) == T, "shapes");
  TORCH_CHECK(static_cast<int64_t>(b.size()) == P && static_cast<int64_t>(columns.size()) == P,
              "one b and one column offset per part");
  TORCH_CHECK(0 < rank && rank <= R, "rank outside 1..R");
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(b[p].is_contiguous() && b[p].size(1) == R, "b[p] [S, R, OUT_p]");
    TORCH_CHECK(columns[p] + b[p].size(2) <= OUT, "a part's columns run past out");
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* sp = slots.data_ptr<int32_t>();
  const float* ap = a.data_ptr<float>();
  std::vector<const float*> bp(P);
  std::vector<int64_t> widths(P);
  for (int64_t p = 0; p < P; ++p) {
    bp[p] = b[p].data_ptr<float>();
    widths[p] = b[p].size(2);
  }
  int64_t widest = 0;
  for (int64_t p = 0; p < P; ++p) widest = std::max(widest, widths[p]);
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> shrunk(rank * P);
    std::vector<float> acc(widest);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = sp[t];
      if (s < 0) continue;
      const float* row = xp + t * IN;
      for (int64_t r = 0; r < rank; ++r) {
        for (int64_t p = 0; p < P; ++p) {
          shrunk[r * P + p] = dot_fixed(row, ap + ((s * R + r) * P + p) * IN, IN);
        }
      }
      for (int64_t p = 0; p < P; ++p) {
        float* dst = op + t * OUT + columns[p];
        const int64_t width = widths[p];
        const float* bs = bp[p] + s * R * width;
        // acc[j] = sum over r ascending of shrunk[r] * B[r, j] (vectorized across j).
        std::fill(acc.begin(), acc.begin() + width, 0.0f);
        for (int64_t r = 0; r < rank; ++r) {
          const float coef = shrunk[r * P + p];
          const float* brow = bs + r * width;
          for (int64_t j = 0; j < width; ++j) acc[j] += coef * brow[j];
        }
        for (int64_t j = 0; j < width; ++j) dst[j] += acc[j];
      }
    }
  });
}

TORCH_LIBRARY(llmserve_cpu_lora, m) {
  m.def("lora_rows", &lora_rows);  // out[t] += B (A x[t]) per adapted row, batch-invariant
}
