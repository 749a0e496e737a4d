// One Llama decoder layer for the rows of a decode-only step (one query each), in one call:
// kernels/cpu_gguf.cpp includes this after gguf_linear, whose products it runs. float32
// throughout; every projection GGUF blocks without a bias (engine/cpu_fused.py checks).
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

// Head h of row b: softmax(q k^T * scale) v over the row's context, into out [dim].
inline void attend(const Attn& a, const float* q, int64_t b, int64_t h, float* scores, float* out) {
  const int64_t kvh = h / (a.heads / a.kv_heads), len = a.lens[b];
  float top = -INFINITY;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = a.tables[b * a.max_blocks + t / a.block_size] * a.block_size +
                         t % a.block_size;
    const float* k = a.kc + (slot * a.kv_heads + kvh) * a.dim;
    float s = 0.0f;
    for (int64_t i = 0; i < a.dim; ++i) s += q[i] * k[i];
    scores[t] = s * a.scale;
    top = std::max(top, scores[t]);
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < a.dim; ++i) out[i] = 0.0f;
  for (int64_t t = 0; t < len; ++t) {
    const float e = std::exp(scores[t] - top);
    sum += e;
    const int64_t slot = a.tables[b * a.max_blocks + t / a.block_size] * a.block_size +
                         t % a.block_size;
    const float* v = a.vc + (slot * a.kv_heads + kvh) * a.dim;
    for (int64_t i = 0; i < a.dim; ++i) out[i] += e * v[i];
  }
  for (int64_t i = 0; i < a.dim; ++i) out[i] /= sum;
}

}  // namespace decode

std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor x, std::optional<at::Tensor> residual, at::Tensor norm_w, at::Tensor post_norm_w,
    double eps, std::vector<at::Tensor> weights, std::vector<int64_t> fmts, at::Tensor cos_sin,
    at::Tensor positions, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
    at::Tensor block_tables, at::Tensor seq_lens, int64_t num_heads, double scale, bool vnni,
    int64_t act_bits) {
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
  at::Tensor qkv = gguf_linear(a, weights[0], fmts[0], vnni, act_bits);
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
  const decode::Attn spec{kc, vc, block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                          block_tables.size(1), k_cache.size(1), kvh, dim, num_heads,
                          qkv.size(1), static_cast<float>(scale)};
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
  at::Tensor h2 = gguf_linear(attn, weights[1], fmts[1], vnni, act_bits);
  float* h2p = h2.data_ptr<float>();
  for (int64_t i = 0; i < B * H; ++i) h2p[i] += hp[i];
  for (int64_t b = 0; b < B; ++b) {
    decode::rms_norm(h2p + b * H, post_norm_w.data_ptr<float>(), eps, H,
                     a.data_ptr<float>() + b * H);
  }
  at::Tensor gu = gguf_linear(a, weights[2], fmts[2], vnni, act_bits);
  const int64_t inter = gu.size(1) / 2;
  at::Tensor act = at::empty({B, inter}, x.options());
  const float* gp = gu.data_ptr<float>();
  float* mp = act.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < inter; ++j) {
      const float g = gp[b * 2 * inter + j];
      mp[b * inter + j] = g / (1.0f + std::exp(-g)) * gp[b * 2 * inter + inter + j];
    }
  }
  return {gguf_linear(act, weights[3], fmts[3], vnni, act_bits), h2};
}
