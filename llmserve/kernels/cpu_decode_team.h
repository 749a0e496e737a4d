// decode_layer on GGUF blocks as ONE OpenMP region (issue 42): the team's threads run the
// layer's phases in turn and meet at a spin-then-sleep barrier between them, as ggml's graph
// does, where the per-phase path (cpu_decode_layer.h) opens a region per product and for the
// attention: five a layer, each a wake of the sleeping workers (a futex and, on a VM, an
// inter-processor interrupt) and a join.
//
//   P0  rows split:        h = x + residual; a = rms_norm(h); a quantized      | barrier
//   P1  outputs split:     qkv = a Wqkv^T                                      | barrier
//   P2  (row, kv head):    rotate q and k, store k and v, attend the group's
//                          q heads, quantize their outputs                     | barrier
//   P3  outputs split:     h2 = o Wo^T                                         | barrier
//   P4  rows split:        h2 += h; a = rms_norm(h2); a quantized              | barrier
//   P5  outputs split:     gu = a Wgate_up^T                                   | barrier
//   P6  blocks of 32:      act = silu(g) * u, quantized                        | barrier
//   P7  outputs split:     out = act Wdown^T                                   (region's end)
//
// The same arithmetic as the per-phase path, in the same order per value: outputs are bit-equal.
// The barrier spins for spin_us microseconds, then sleeps on a futex until the last thread
// arrives: under load a descheduled peer costs at most spin_us of a core per barrier (the
// omp_wait study: spinning without a bound made a loaded machine's steps 1.5-7x slower).
#include <linux/futex.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>

namespace team {

class Barrier {
 public:
  explicit Barrier(int64_t spin_us) : spin_(spin_us * 1000) {}

  // The team's size: every thread sets it (the same value) before its first wait.
  void set_threads(int threads) { threads_.store(threads, std::memory_order_relaxed); }

  // Returns once every thread of the team has called wait() as often as this one.
  void wait() {
    const int threads = threads_.load(std::memory_order_relaxed);
    if (threads == 1) return;
    const int gen = gen_.load();
    if (arrived_.fetch_add(1) == threads - 1) {
      arrived_.store(0);
      gen_.store(gen + 1);
      if (sleepers_.load() > 0) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    while (gen_.load() == gen) {
      for (int i = 0; i < 32; ++i) _mm_pause();
      if (std::chrono::steady_clock::now() - start > spin_) break;
    }
    if (gen_.load() == gen) {
      sleepers_.fetch_add(1);  // seq_cst with gen_: the last arrival sees it, or we see gen + 1
      while (gen_.load() == gen) futex(FUTEX_WAIT_PRIVATE, gen);
      sleepers_.fetch_sub(1);
    }
  }

 private:
  void futex(int op, int value) {
    syscall(SYS_futex, reinterpret_cast<int*>(&gen_), op, value, nullptr, nullptr, 0);
  }

  std::atomic<int> arrived_{0}, gen_{0}, sleepers_{0}, threads_{1};
  const std::chrono::nanoseconds spin_;
};
static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the atomic's int");

inline std::pair<int64_t, int64_t> share(int64_t total, int tid, int threads) {
  const int64_t chunk = (total + threads - 1) / threads;
  return {std::min(total, tid * chunk), std::min(total, (tid + 1) * chunk)};
}

// The buffers and settings every phase reads, made before the region. Product p (qkv, o,
// gate_up, down) reads its quantized input from xq[p], xd[p], xs[p] (all rows).
struct Layer {
  int64_t B, H, dim, kvh, heads, q_size, kv_size, width, inter, act_bits;
  bool vnni;
  Problem proj[4];
  void* xq[4];
  float *xd[4], *xs[4];
  const float *x, *res, *norm_w, *post_norm_w, *cos_sin;
  double eps;
  const int64_t *pos, *slots;
  float *h, *a, *qkv, *attn, *h2, *gu, *act, *kc, *vc;
  decode::Attn spec;
  int64_t longest;

  void quantize(int p, const float* src, int64_t i0, int64_t i1) const {
    quantize_span(src, i0, i1, act_bits, xq[p], xd[p], xs[p]);
  }
};

// Outputs of product p in this thread's share; more than 4 int16 rows land in y^T [N, M] first
// (cpu_gguf_dot.h: unpacked_range), this share transposed back into y [M, N] here.
inline void product(const Layer& L, int p, float* y, int tid, int threads) {
  const Problem& pr = L.proj[p];
  const auto [n0, n1] = share(pr.N, tid, threads);
  if (L.vnni) {
    vnni::outputs(pr, n0, n1);
  } else {
    avx2::outputs(pr, n0, n1);
  }
  if (pr.y == y) return;
  for (int64_t m = 0; m < pr.M; ++m) {
    for (int64_t n = n0; n < n1; ++n) y[m * pr.N + n] = pr.y[n * pr.M + m];
  }
}

// P0 / P4: row b's residual sum into h (x + add, or x), its norm into a, a quantized for
// product p.
inline void norm_row(const Layer& L, int64_t b, const float* x, const float* add, float* h,
                     const float* w, int p) {
  const int64_t at = b * L.H;
  for (int64_t i = at; i < at + L.H; ++i) h[i] = add ? x[i] + add[i] : x[i];
  decode::rms_norm(h + at, w, L.eps, L.H, L.a + at);
  L.quantize(p, L.a, b * (L.H / 32), (b + 1) * (L.H / 32));
}

// P2: row b, kv head g: k rotated and stored with v, then the group's q heads rotated, attended
// and their outputs quantized for the o product (a group's outputs are whole blocks of 32:
// `fits` checks).
inline void attend_group(const Layer& L, int64_t b, int64_t g, std::vector<float>& scores) {
  float* row = L.qkv + b * L.width;
  const float* cs = L.cos_sin + L.pos[b] * L.dim;
  float* k = row + L.q_size + g * L.dim;
  decode::rotate(k, cs, L.dim / 2);
  std::memcpy(L.kc + L.slots[b] * L.kv_size + g * L.dim, k, L.dim * sizeof(float));
  std::memcpy(L.vc + L.slots[b] * L.kv_size + g * L.dim, k + L.kv_size, L.dim * sizeof(float));
  const int64_t group = L.heads / L.kvh;
  for (int64_t hd = g * group; hd < (g + 1) * group; ++hd) {
    decode::rotate(row + hd * L.dim, cs, L.dim / 2);
    decode::attend(L.spec, row + hd * L.dim, b, hd, scores.data(),
                   L.attn + b * L.q_size + hd * L.dim);
  }
  const int64_t first = b * (L.q_size / 32) + g * group * L.dim / 32;
  L.quantize(1, L.attn, first, first + group * L.dim / 32);
}

// P6: blocks [i0, i1) of 32 of act = silu(gate) * up, each quantized for the down product.
inline void silu_blocks(const Layer& L, int64_t i0, int64_t i1) {
  const int64_t per_row = L.inter / 32;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / per_row, j = (i % per_row) * 32;
    const float* g = L.gu + b * 2 * L.inter + j;
    decode::silu_mul(g, g + L.inter, 32, L.act + b * L.inter + j);
  }
  L.quantize(3, L.act, i0, i1);
}

// One thread's part of the layer (the phases above); out: the down product's y.
inline void run(const Layer& L, Barrier& barrier, float* out, int tid, int threads) {
  auto [r0, r1] = share(L.B, tid, threads);
  for (int64_t b = r0; b < r1; ++b) norm_row(L, b, L.x, L.res, L.h, L.norm_w, 0);
  barrier.wait();
  product(L, 0, L.qkv, tid, threads);
  barrier.wait();
  std::vector<float> scores(L.longest);
  const auto [g0, g1] = share(L.B * L.kvh, tid, threads);
  for (int64_t i = g0; i < g1; ++i) attend_group(L, i / L.kvh, i % L.kvh, scores);
  barrier.wait();
  product(L, 1, L.h2, tid, threads);
  barrier.wait();
  for (int64_t b = r0; b < r1; ++b) norm_row(L, b, L.h2, L.h, L.h2, L.post_norm_w, 2);
  barrier.wait();
  product(L, 2, L.gu, tid, threads);
  barrier.wait();
  const auto [s0, s1] = share(L.B * (L.inter / 32), tid, threads);
  silu_blocks(L, s0, s1);
  barrier.wait();
  product(L, 3, out, tid, threads);
}

// Whether the one-region layer can run these weights: all four GGUF blocks, and a kv group's
// attention outputs whole blocks of 32 (P2 quantizes them).
inline bool fits(const std::vector<at::Tensor>& weights, int64_t num_heads, int64_t kvh,
                 int64_t dim) {
  for (const at::Tensor& w : weights) {
    if (w.scalar_type() != at::kByte) return false;
  }
  return (num_heads / kvh * dim) % 32 == 0;
}

// Product p's Problem over B rows of K, its quantized input allocated in L (keep: the tensors).
inline void plan_product(Layer& L, int p, const at::Tensor& w, int64_t fmt, int64_t K, float* y,
                         float* yt, std::vector<at::Tensor>& keep) {
  check_weight(w, fmt, K);
  const auto opts = at::TensorOptions().dtype(L.act_bits == 8 ? at::kChar : at::kShort);
  keep.push_back(at::empty({L.B, K}, opts));
  L.xq[p] = keep.back().data_ptr();
  keep.push_back(at::empty({2, L.B, K / 32}, at::TensorOptions().dtype(at::kFloat)));
  L.xd[p] = keep.back().data_ptr<float>();
  L.xs[p] = L.xd[p] + L.B * (K / 32);
  const bool transposed = L.act_bits == 16 && L.B > 4;
  L.proj[p] = Problem{w.data_ptr<uint8_t>(), w.size(1), fmt, L.B, w.size(0), K, L.act_bits,
                      L.xq[p], L.xd[p], L.xs[p], transposed ? yt : y};
}

// decode_layer's arguments (checked there) as one region: returns (out, h2) as it does.
inline std::tuple<at::Tensor, at::Tensor> layer(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& norm_w,
    const at::Tensor& post_norm_w, double eps, const std::vector<at::Tensor>& weights,
    const std::vector<int64_t>& fmts, const at::Tensor& cos_sin, const at::Tensor& positions,
    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const decode::Attn& spec,
    int64_t num_heads, bool vnni, int64_t act_bits, int64_t spin_us) {
  Layer L{};
  L.B = x.size(0), L.H = x.size(1), L.dim = k_cache.size(3), L.kvh = k_cache.size(2);
  L.heads = num_heads, L.q_size = num_heads * L.dim, L.kv_size = L.kvh * L.dim;
  L.width = L.q_size + 2 * L.kv_size, L.inter = weights[2].size(0) / 2, L.act_bits = act_bits;
  TORCH_CHECK(weights[0].size(0) == L.width && weights[1].size(0) == L.H &&
                  weights[3].size(0) == L.H && weights[2].size(0) == 2 * L.inter,
              "decode_layer: the projections' output sizes do not match the layer's");
  L.vnni = vnni, L.eps = eps, L.spec = spec;
  const auto f32 = x.options();
  at::Tensor h = at::empty_like(x), a = at::empty_like(x), h2 = at::empty_like(x);
  at::Tensor out = at::empty_like(x), qkv = at::empty({L.B, L.width}, f32);
  at::Tensor attn = at::empty({L.B, L.q_size}, f32), gu = at::empty({L.B, 2 * L.inter}, f32);
  at::Tensor act = at::empty({L.B, L.inter}, f32);
  at::Tensor yt = at::empty({L.B * std::max({L.width, L.H, 2 * L.inter})}, f32);
  std::vector<at::Tensor> keep;
  const int64_t K[4] = {L.H, L.q_size, L.H, L.inter};
  float* ys[4] = {qkv.data_ptr<float>(), h2.data_ptr<float>(), gu.data_ptr<float>(),
                  out.data_ptr<float>()};
  for (int p = 0; p < 4; ++p) {
    plan_product(L, p, weights[p], fmts[p], K[p], ys[p], yt.data_ptr<float>(), keep);
  }
  L.x = x.data_ptr<float>(), L.res = residual ? residual->data_ptr<float>() : nullptr;
  L.norm_w = norm_w.data_ptr<float>(), L.post_norm_w = post_norm_w.data_ptr<float>();
  L.cos_sin = cos_sin.data_ptr<float>(), L.pos = positions.data_ptr<int64_t>();
  L.slots = slots.data_ptr<int64_t>(), L.h = h.data_ptr<float>(), L.a = a.data_ptr<float>();
  L.qkv = ys[0], L.attn = attn.data_ptr<float>(), L.h2 = ys[1], L.gu = ys[2];
  L.act = act.data_ptr<float>(), L.kc = k_cache.data_ptr<float>();
  L.vc = v_cache.data_ptr<float>();
  L.longest = 0;
  for (int64_t b = 0; b < L.B; ++b) L.longest = std::max(L.longest, spec.lens[b]);
  Barrier barrier(spin_us);
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (threads == 1) {
    run(L, barrier, ys[3], 0, 1);
  } else {
#pragma omp parallel num_threads(threads)
    {
      barrier.set_threads(omp_get_num_threads());
      run(L, barrier, ys[3], omp_get_thread_num(), omp_get_num_threads());
    }
  }
  return {out, h2};
}

}  // namespace team
