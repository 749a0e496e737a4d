// One Llama decoder layer for the rows of a decode-only step (one query each), in one call:
// kernels/cpu_gguf.cpp includes this after gguf_linear, whose products it runs. float32
// throughout; every projection GGUF blocks without a bias (engine/cpu_fused.py checks), or, on
// --quantization auto's steps of many rows, each its oneDNN-packed dense copy (`project`).
// Attention, softmax and SiLU are AVX2 (8-lane dot products, a vectorized exp; the row's KV
// blocks walked block by block, no division per position).
//
//   h  = x + residual (no residual: x)          a  = rms_norm(h) * norm_w
//   qkv = a Wqkv^T; q and k rotated (NeoX pairs (i, i + d/2), cos_sin[positions] = [cos | sin])
//   k, v stored at slots[b]                    o  = attention of each q over the row's first
//                                                   seq_lens[b] positions (block_tables[b])
//   h2 = o Wo^T + h                            a2 = rms_norm(h2) * post_norm_w
//   out = (silu(a2 Wgate^T) * a2 Wup^T) Wdown^T
// returns (out, h2): the next layer's (hidden, residual), as engine.layers.DecoderLayer does.
// KV pool: float32 [num_blocks, block_size, kv_heads, head_dim]; block_tables int64 [B, max],
// slots, seq_lens, positions int64 [B].
namespace decode {

// out = x / rms(x) * w (the reference's order: x scaled first, then times w)
inline void rms_norm(const float* x, const float* w, double eps, int64_t n, float* out) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

inline void rotate(float* x, const float* cs, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half], c = cs[i], s = cs[half + i];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  }
}

struct Attn {
  const float *kc, *vc;
  const int64_t *tables, *lens;
  int64_t max_blocks, block_size, kv_heads, dim, heads, ld;
  float scale;
};

// exp of 8 floats (Cephes' expf: n = round(x / ln 2), r = x - n ln 2 in two parts, a degree-6
// polynomial, times 2^n; within 2 ulp of std::exp over [-87, 88], clamped outside).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// scores[t] = exp(scores[t] - top) for t < len; their sum.
inline float exp_shifted(float* scores, int64_t len, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
    _mm256_storeu_ps(scores + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  for (; t < len; ++t) {
    scores[t] = std::exp(scores[t] - top);
    sum += scores[t];
  }
  return sum;
}

// out[j] = silu(g[j]) * u[j] for j < n (g / (1 + exp(-g)), 8 at a time).
inline void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  int64_t j = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; j + 8 <= n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + j)));
  }
  for (; j < n; ++j) out[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
}

inline const float* at_pos(const Attn& a, const float* cache, int64_t b, int64_t kvh, int64_t t) {
  const int64_t slot = a.tables[b * a.max_blocks + t / a.block_size] * a.block_size +
                       t % a.block_size;
  return cache + (slot * a.kv_heads + kvh) * a.dim;
}

// q . k over dim (a multiple of 8): 8 lanes of fused multiply-adds, then the lanes summed.
inline float dot8(const float* q, const float* k, int64_t dim) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
  }
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// out = inv * sum_t weights[t] v_t over the row's positions, head_dim = 8 * L (the L sums in
// registers).
template <int L>
inline void weighted_sum(const Attn& a, int64_t b, int64_t kvh, const float* weights, float inv,
                         float* out) {
  __m256 acc[L];
  for (int j = 0; j < L; ++j) acc[j] = _mm256_setzero_ps();
  const int64_t len = a.lens[b], stride = a.kv_heads * a.dim;
  for (int64_t t0 = 0, blk = 0; t0 < len; t0 += a.block_size, ++blk) {
    const float* v = a.vc + (a.tables[b * a.max_blocks + blk] * a.block_size * a.kv_heads + kvh) *
                                a.dim;
    const int64_t n = std::min(a.block_size, len - t0);
    for (int64_t i = 0; i < n; ++i, v += stride) {
      const __m256 w = _mm256_set1_ps(weights[t0 + i]);
      for (int j = 0; j < L; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * j), acc[j]);
    }
  }
  const __m256 scale = _mm256_set1_ps(inv);
  for (int j = 0; j < L; ++j) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(acc[j], scale));
}

// Head h of row b: softmax(q k^T * scale) v over the row's context, into out [dim]. With dim a
// multiple of 8 (up to 256), AVX2: the scores by 8-lane dot products, the weighted sum of V
// kept in registers across the row's positions.
inline void attend(const Attn& a, const float* q, int64_t b, int64_t h, float* scores, float* out) {
  const int64_t kvh = h / (a.heads / a.kv_heads), len = a.lens[b];
  const bool simd = a.dim % 8 == 0 && a.dim <= 256;
  float top = -INFINITY;
  // blocked over the row's KV blocks: a block's positions are consecutive slots
  for (int64_t t0 = 0, blk = 0; t0 < len; t0 += a.block_size, ++blk) {
    const float* k = a.kc + (a.tables[b * a.max_blocks + blk] * a.block_size * a.kv_heads + kvh) *
                                a.dim;
    const int64_t n = std::min(a.block_size, len - t0), stride = a.kv_heads * a.dim;
    for (int64_t i = 0; i < n; ++i, k += stride) {
      float s = 0.0f;
      if (simd) {
        s = dot8(q, k, a.dim);
      } else {
        for (int64_t d = 0; d < a.dim; ++d) s += q[d] * k[d];
      }
      scores[t0 + i] = s * a.scale;
      top = std::max(top, scores[t0 + i]);
    }
  }
  if (simd) {
    const float inv = 1.0f / exp_shifted(scores, len, top);
    if (a.dim == 64) {
      weighted_sum<8>(a, b, kvh, scores, inv, out);
    } else if (a.dim == 128) {
      weighted_sum<16>(a, b, kvh, scores, inv, out);
    } else {
      for (int64_t j = 0; j < a.dim / 8; ++j) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; ++t) {
          acc = _mm256_fmadd_ps(_mm256_set1_ps(scores[t]),
                                _mm256_loadu_ps(at_pos(a, a.vc, b, kvh, t) + 8 * j), acc);
        }
        _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
      }
    }
    return;
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < a.dim; ++i) out[i] = 0.0f;
  for (int64_t t = 0; t < len; ++t) {
    const float e = std::exp(scores[t] - top);
    sum += e;
    const float* v = at_pos(a, a.vc, b, kvh, t);
    for (int64_t i = 0; i < a.dim; ++i) out[i] += e * v[i];
  }
  for (int64_t i = 0; i < a.dim; ++i) out[i] /= sum;
}

// y = x W^T for W as GGUF blocks (uint8: gguf_linear's dot products) or as a dense weight
// prepacked by oneDNN (mkldnn::_reorder_linear_weight, float32 or bfloat16: the --quantization
// auto path past its crossover, engine/cpu_weights.py), float32 out either way.
inline at::Tensor project(const at::Tensor& x, const at::Tensor& w, int64_t fmt, bool vnni,
                          int64_t act_bits) {
  if (w.scalar_type() == at::kByte) return gguf_linear(x, w, fmt, vnni, act_bits);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{w.scalar_type() == at::kFloat ? x : x.to(w.scalar_type()),
                          w,
                          c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  at::Tensor y = stack[0].toTensor();
  return y.scalar_type() == at::kFloat ? y : y.to(at::kFloat);
}

}  // namespace decode

#include "cpu_decode_team.h"

// one_region: on GGUF blocks, the layer as one OpenMP region (cpu_decode_team.h; its barriers
// spin spin_us microseconds, then sleep); else, or on dense weights, a region per phase (below).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor x, std::optional<at::Tensor> residual, at::Tensor norm_w, at::Tensor post_norm_w,
    double eps, std::vector<at::Tensor> weights, std::vector<int64_t> fmts, at::Tensor cos_sin,
    at::Tensor positions, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
    at::Tensor block_tables, at::Tensor seq_lens, int64_t num_heads, double scale, bool vnni,
    int64_t act_bits, bool one_region, int64_t spin_us) {
  TORCH_CHECK(weights.size() == 4 && fmts.size() == 4, "decode_layer: qkv, o, gate_up, down");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "decode_layer: x must be contiguous float32 [B, hidden]");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && k_cache.dim() == 4 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat,
              "decode_layer: the KV pool must be float32 [blocks, block_size, kv_heads, dim]");
  for (const at::Tensor& t : {positions, slots, block_tables, seq_lens}) {
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.size(0) == x.size(0),
                "decode_layer: positions, slots, block_tables, seq_lens: int64, one per row");
  }
  const int64_t B = x.size(0), H = x.size(1), dim = k_cache.size(3), kvh = k_cache.size(2);
  const int64_t q_size = num_heads * dim, kv_size = kvh * dim, half = dim / 2;
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
                  cos_sin.size(1) == dim && num_heads % kvh == 0,
              "decode_layer: cos_sin float32 [positions, head_dim], heads a multiple of kv_heads");
  const decode::Attn spec{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                          block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                          block_tables.size(1), k_cache.size(1), kvh, dim, num_heads,
                          q_size + 2 * kv_size, static_cast<float>(scale)};
  if (one_region && team::fits(weights, num_heads, kvh, dim)) {
    TORCH_CHECK(!residual.has_value() || (residual->is_contiguous() &&
                                          residual->sizes() == x.sizes() &&
                                          residual->scalar_type() == at::kFloat),
                "decode_layer: residual must be like x");
    return team::layer(x, residual, norm_w, post_norm_w, eps, weights, fmts, cos_sin, positions,
                       k_cache, v_cache, slots, spec, num_heads, vnni, act_bits, spin_us);
  }
  at::Tensor h = at::empty_like(x);  // the new residual
  at::Tensor a = at::empty_like(x);
  float* hp = h.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == at::kFloat,
                "decode_layer: residual must be like x");
    const float* rp = residual->data_ptr<float>();
    for (int64_t i = 0; i < B * H; ++i) hp[i] = xp[i] + rp[i];
  } else {
    std::memcpy(hp, xp, B * H * sizeof(float));
  }
  for (int64_t b = 0; b < B; ++b) {
    decode::rms_norm(hp + b * H, norm_w.data_ptr<float>(), eps, H, a.data_ptr<float>() + b * H);
  }
  at::Tensor qkv = decode::project(a, weights[0], fmts[0], vnni, act_bits);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decode_layer: qkv width");
  float* qp = qkv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    float* row = qp + b * qkv.size(1);
    const float* cs = cos_sin.data_ptr<float>() + pos[b] * dim;
    for (int64_t hh = 0; hh < num_heads + kvh; ++hh) decode::rotate(row + hh * dim, cs, half);
    std::memcpy(kc + sl[b] * kv_size, row + q_size, kv_size * sizeof(float));
    std::memcpy(vc + sl[b] * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, spec.lens[b]);
  at::Tensor attn = at::empty({B, q_size}, x.options());
  float* ap = attn.data_ptr<float>();
  at::parallel_for(0, B * num_heads, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(longest);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / num_heads, hd = i % num_heads;
      decode::attend(spec, qp + b * spec.ld + hd * dim, b, hd, scores.data(),
                     ap + b * q_size + hd * dim);
    }
  });
  at::Tensor h2 = decode::project(attn, weights[1], fmts[1], vnni, act_bits);
  float* h2p = h2.data_ptr<float>();
  for (int64_t i = 0; i < B * H; ++i) h2p[i] += hp[i];
  for (int64_t b = 0; b < B; ++b) {
    decode::rms_norm(h2p + b * H, post_norm_w.data_ptr<float>(), eps, H,
                     a.data_ptr<float>() + b * H);
  }
  at::Tensor gu = decode::project(a, weights[2], fmts[2], vnni, act_bits);
  const int64_t inter = gu.size(1) / 2;
  at::Tensor act = at::empty({B, inter}, x.options());
  const float* gp = gu.data_ptr<float>();
  float* mp = act.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      decode::silu_mul(gp + b * 2 * inter, gp + b * 2 * inter + inter, inter, mp + b * inter);
    }
  });
  return {decode::project(act, weights[3], fmts[3], vnni, act_bits), h2};
}
