// decode_layer on GGUF blocks as ONE OpenMP region (issue 42): the team's threads run the
// layer's phases in turn and meet at a spin-then-sleep barrier between them, as ggml's graph
// does, where the per-phase path (cpu_decode_layer.h) opens a region per product and for the
// attention: five a layer, each a wake of the sleeping workers (a futex and, on a VM, an
// inter-processor interrupt) and a join.
//
//   P0  every thread:      h = x + residual; a = rms_norm(h), quantized
//   P1  outputs split:     qkv = a Wqkv^T                                      | barrier
//   P2  (row, kv head):    rotate q and k, store k and v, attend the group's
//                          q heads, quantize their outputs                     | barrier
//   P3  outputs split:     o = attn Wo^T                                       | barrier
//   P4  every thread:      h2 = o + h; a = rms_norm(h2), quantized
//   P5  outputs split:     gu = a Wgate_up^T                                   | barrier
//   P6  every thread:      act = silu(g) * u, quantized
//   P7  outputs split:     out = act Wdown^T                                   (region's end)
//
// P0, P4 and P6 are a few microseconds of arithmetic per row: every thread does them for all
// rows into its own buffers (thread 0 also writes h and h2) rather than meet at a barrier more.
// The same arithmetic as the per-phase path, in the same order per value: outputs are bit-equal.
// The barrier spins for at most spin_us microseconds (a budget it learns: Barrier), then sleeps
// on a futex until the last thread arrives: under load a descheduled peer costs at most that
// much of a core per barrier (the omp_wait study: spinning without a bound made a loaded
// machine's steps 1.5-7x slower).
#include <omp.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else  // elsewhere the sleeping wait yields the core in a loop instead of a futex
#define FUTEX_WAIT_PRIVATE 0
#define FUTEX_WAKE_PRIVATE 1
#endif

#include <atomic>
#include <chrono>
#include <climits>
#include <thread>

namespace team {

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// How long a waiting thread spins before it sleeps, learned from the waits themselves: where the
// last thread arrived within the longest spin allowed (spin_us), the budget grows by an eighth of
// it, else it halves. On an idle machine the threads arrive microseconds apart and the waits stay
// spins; on an oversubscribed one, where a peer is often descheduled for a whole time slice, the
// budget falls towards 0 and the team sleeps at once, as a passive OpenMP wait does.
inline std::atomic<int64_t> spin_budget_ns{0};

class Barrier {
 public:
  explicit Barrier(int64_t spin_us) : max_ns_(spin_us * 1000) {}

  // The team's size: every thread sets it (the same value) before its first wait.
  void set_threads(int threads) { threads_.store(threads, std::memory_order_relaxed); }

  // Returns once every thread of the team has called wait() as often as this one.
  void wait() {
    const int threads = threads_.load(std::memory_order_relaxed);
    if (threads == 1) return;
    const int gen = gen_.load();
    if (arrived_.fetch_add(1) == threads - 1) {
      arrived_.store(0);
      last_ns_.store(now_ns());
      gen_.store(gen + 1);
      if (sleepers_.load() > 0) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    const int64_t start = now_ns(), budget = spin_budget_ns.load(std::memory_order_relaxed);
    while (gen_.load() == gen && now_ns() - start < budget) {
      for (int i = 0; i < 32; ++i) _mm_pause();
    }
    if (gen_.load() == gen) {
      sleepers_.fetch_add(1);  // seq_cst with gen_: the last arrival sees it, or we see gen + 1
      while (gen_.load() == gen) futex(FUTEX_WAIT_PRIVATE, gen);
      sleepers_.fetch_sub(1);
    }
    learn(budget, last_ns_.load() - start);
  }

 private:
  void learn(int64_t budget, int64_t waited) const {
    const int64_t next = waited <= max_ns_ ? std::min(max_ns_, budget + max_ns_ / 8) : budget / 2;
    if (next != budget) spin_budget_ns.store(next, std::memory_order_relaxed);
  }

  void futex(int op, int value) {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<int*>(&gen_), op, value, nullptr, nullptr, 0);
#else
    if (op == FUTEX_WAIT_PRIVATE && gen_.load() == value) std::this_thread::yield();
#endif
  }

  std::atomic<int> arrived_{0}, gen_{0}, sleepers_{0}, threads_{1};
  std::atomic<int64_t> last_ns_{0};
  const int64_t max_ns_;
};
static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the atomic's int");

inline std::pair<int64_t, int64_t> share(int64_t total, int tid, int threads) {
  const int64_t chunk = (total + threads - 1) / threads;
  return {std::min(total, tid * chunk), std::min(total, (tid + 1) * chunk)};
}

// The buffers and settings every phase reads, made before the region. The o product reads its
// input from the shared xq (P2 writes it); the others from each thread's own (Private).
struct Layer {
  int64_t B, H, dim, kvh, heads, q_size, kv_size, width, inter, act_bits, k_max;
  bool vnni;
  Problem proj[4];
  const float *x, *res, *norm_w, *post_norm_w, *cos_sin;
  double eps;
  const int64_t *pos, *slots;
  float *h, *qkv, *attn, *o, *h2, *gu, *kc, *vc;
  void* xq;  // the o product's input, shared
  float *xd, *xs;
  char* own;  // each thread's Private buffers, own_bytes apart
  int64_t own_bytes;
  decode::Attn spec;
  int64_t longest;
};

// One thread's buffers: a float input ([B, k_max]: a norm's or the SiLU's output), the residual
// sum ([B, H]) and the quantized input of the product it feeds.
struct Private {
  float *a, *sum, *xd, *xs;
  void* xq;

  Private(const Layer& L, int tid) {
    char* p = L.own + tid * L.own_bytes;
    const int64_t n = L.B * L.k_max;
    a = reinterpret_cast<float*>(p);
    sum = a + n;
    xd = sum + L.B * L.H;
    xs = xd + n / 32;
    xq = xs + n / 32;
  }
  static int64_t bytes(int64_t B, int64_t H, int64_t k_max, int64_t act_bits) {
    const int64_t n = B * k_max;
    return (n + B * H + n / 16) * 4 + n * (act_bits == 8 ? 1 : 2) + 64;
  }
};

// Outputs of product p in this thread's share, its input the thread's own (mine) or, for the o
// product, the shared one; more than 4 int16 rows land in y^T [N, M] first (cpu_gguf_dot.h:
// unpacked_range), this share transposed back into y [M, N] here.
inline void product(const Layer& L, int p, const Private& mine, float* y, int tid, int threads) {
  Problem pr = L.proj[p];
  if (p != 1) pr.xq = mine.xq, pr.xd = mine.xd, pr.xs = mine.xs;
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

// P0 / P4, every row: sum = x + add (or x; thread 0 writes it to `shared`, the others to their
// own), a = rms_norm(sum) * w, quantized into this thread's input.
inline void norm_rows(const Layer& L, const Private& mine, const float* x, const float* add,
                      float* shared, const float* w, int tid) {
  float* sum = tid == 0 ? shared : mine.sum;
  for (int64_t i = 0; i < L.B * L.H; ++i) sum[i] = add ? x[i] + add[i] : x[i];
  for (int64_t b = 0; b < L.B; ++b) {
    decode::rms_norm(sum + b * L.H, w, L.eps, L.H, mine.a + b * L.H);
  }
  quantize_span(mine.a, 0, L.B * L.H / 32, L.act_bits, mine.xq, mine.xd, mine.xs);
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
  quantize_span(L.attn, first, first + group * L.dim / 32, L.act_bits, L.xq, L.xd, L.xs);
}

// P6, every row: act = silu(gate) * up into this thread's input, quantized for the down product.
inline void silu_rows(const Layer& L, const Private& mine) {
  for (int64_t b = 0; b < L.B; ++b) {
    const float* g = L.gu + b * 2 * L.inter;
    decode::silu_mul(g, g + L.inter, L.inter, mine.a + b * L.inter);
  }
  quantize_span(mine.a, 0, L.B * L.inter / 32, L.act_bits, mine.xq, mine.xd, mine.xs);
}

// One thread's part of the layer (the phases above); out: the down product's y.
inline void run(const Layer& L, Barrier& barrier, float* out, int tid, int threads) {
  const Private mine(L, tid);
  norm_rows(L, mine, L.x, L.res, L.h, L.norm_w, tid);
  product(L, 0, mine, L.qkv, tid, threads);
  barrier.wait();
  std::vector<float> scores(L.longest);
  const auto [g0, g1] = share(L.B * L.kvh, tid, threads);
  for (int64_t i = g0; i < g1; ++i) attend_group(L, i / L.kvh, i % L.kvh, scores);
  barrier.wait();
  product(L, 1, mine, L.o, tid, threads);
  barrier.wait();
  norm_rows(L, mine, L.o, L.h, L.h2, L.post_norm_w, tid);
  product(L, 2, mine, L.gu, tid, threads);
  barrier.wait();
  silu_rows(L, mine);
  product(L, 3, mine, out, tid, threads);
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
  L.k_max = std::max(L.H, L.inter), L.vnni = vnni, L.eps = eps, L.spec = spec;
  TORCH_CHECK(weights[0].size(0) == L.width && weights[1].size(0) == L.H &&
                  weights[3].size(0) == L.H && weights[2].size(0) == 2 * L.inter,
              "decode_layer: the projections' output sizes do not match the layer's");
  const int64_t K[4] = {L.H, L.q_size, L.H, L.inter};
  for (int p = 0; p < 4; ++p) check_weight(weights[p], fmts[p], K[p]);
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const auto f32 = x.options();
  at::Tensor h = at::empty_like(x), o = at::empty_like(x), h2 = at::empty_like(x);
  at::Tensor out = at::empty_like(x), qkv = at::empty({L.B, L.width}, f32);
  at::Tensor attn = at::empty({L.B, L.q_size}, f32), gu = at::empty({L.B, 2 * L.inter}, f32);
  at::Tensor yt = at::empty({L.B * std::max({L.width, L.H, 2 * L.inter})}, f32);
  at::Tensor xq = at::empty({L.B, L.q_size}, f32.dtype(act_bits == 8 ? at::kChar : at::kShort));
  at::Tensor xds = at::empty({2, L.B, L.q_size / 32}, f32);
  L.own_bytes = Private::bytes(L.B, L.H, L.k_max, act_bits) / 64 * 64 + 64;
  at::Tensor own = at::empty({threads * L.own_bytes}, f32.dtype(at::kByte));
  float* ys[4] = {qkv.data_ptr<float>(), o.data_ptr<float>(), gu.data_ptr<float>(),
                  out.data_ptr<float>()};
  const bool transposed = act_bits == 16 && L.B > 4;
  for (int p = 0; p < 4; ++p) {
    L.proj[p] = Problem{weights[p].data_ptr<uint8_t>(), weights[p].size(1), fmts[p], L.B,
                        weights[p].size(0), K[p], act_bits, nullptr, nullptr, nullptr,
                        transposed ? yt.data_ptr<float>() : ys[p]};
  }
  L.xq = xq.data_ptr(), L.xd = xds.data_ptr<float>(), L.xs = L.xd + L.B * (L.q_size / 32);
  L.proj[1].xq = L.xq, L.proj[1].xd = L.xd, L.proj[1].xs = L.xs;
  L.own = reinterpret_cast<char*>(own.data_ptr<uint8_t>());
  L.x = x.data_ptr<float>(), L.res = residual ? residual->data_ptr<float>() : nullptr;
  L.norm_w = norm_w.data_ptr<float>(), L.post_norm_w = post_norm_w.data_ptr<float>();
  L.cos_sin = cos_sin.data_ptr<float>(), L.pos = positions.data_ptr<int64_t>();
  L.slots = slots.data_ptr<int64_t>(), L.h = h.data_ptr<float>(), L.qkv = ys[0];
  L.attn = attn.data_ptr<float>(), L.o = ys[1], L.h2 = h2.data_ptr<float>(), L.gu = ys[2];
  L.kc = k_cache.data_ptr<float>(), L.vc = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < L.B; ++b) L.longest = std::max(L.longest, spec.lens[b]);
  Barrier barrier(spin_us);
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
