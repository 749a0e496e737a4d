// The inner loops of kernels/cpu_gguf.cpp, included there once per instruction set (plain AVX2,
// and AVX-512 VNNI + VL under `#pragma GCC target`), each time inside its own namespace after
// definitions of
//     __m256i dot_u8s8(u, s)            // 8 int32 lanes, each the sum of 4 u8 * s8 products
//     __m256i dot_s16(a0, x0, a1, x1)   // 8 int32 lanes, each the sum of 4 s16 * s16 products
// The weights are GGUF blocks as stored (one row of N: K / 32 blocks, or K / 256 for Q4_K);
// x arrives quantized per block of 32 (q int8 or int16, d its scale, s = d * sum(q)). Per block:
//     w = dw * level + mw   (Q4_0: level 0..15, mw = -8 dw; Q4_1: level 0..15, mw = m;
//                            Q8_0: level -128..127, mw = 0; Q4_K: per sub-block of 32,
//                            dw = d * scale, mw = -dmin * min)
//     sum(w x) = dw dx sum(level q) + mw s
// The integer sum is a dot product of the unpacked levels with x's block, widened to float and
// accumulated per lane.

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 bytes of nibbles -> 32 levels in element order (low nibbles first, as GGUF's Q4_0 / Q4_1).
inline __m256i nibbles16(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

// ROWS rows of x, quantized to ACT (int8_t or int16_t) per block of 32, and their accumulators.
template <int ROWS, typename ACT>
struct Rows {
  __m256 acc[ROWS];
  float corr[ROWS];
  const ACT* xq;    // [ROWS][K]
  const float* xd;  // [ROWS][K / 32]
  const float* xs;
  int64_t K, blocks;

  Rows(const ACT* q, const float* d, const float* s, int64_t k)
      : xq(q), xd(d), xs(s), K(k), blocks(k / 32) {
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = _mm256_setzero_ps();
      corr[r] = 0.0f;
    }
  }

  inline void add(int r, __m256i dot, int64_t b, float dw, float mw) {
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * xd[r * blocks + b]),
                             acc[r]);
    corr[r] += mw * xs[r * blocks + b];
  }

  // One block b with weights dw * level + mw: levels unsigned in u, or (SIGNED, Q8_0) signed
  // in w. int8 x: u8 * s8 products, so a signed block takes |w| and moves w's signs onto x.
  // int16 x: the levels widened to int16, s16 * s16 products.
  template <bool SIGNED>
  inline void block(__m256i u, __m256i w, int64_t b, float dw, float mw) {
    if constexpr (sizeof(ACT) == 1) {
      const __m256i levels = SIGNED ? _mm256_abs_epi8(w) : u;
      for (int r = 0; r < ROWS; ++r) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * 32));
        if (SIGNED) x = _mm256_sign_epi8(x, w);
        add(r, dot_u8s8(levels, x), b, dw, mw);
      }
    } else {
      const __m256i v = SIGNED ? w : u;
      const __m128i v0 = _mm256_castsi256_si128(v), v1 = _mm256_extracti128_si256(v, 1);
      const __m256i a0 = SIGNED ? _mm256_cvtepi8_epi16(v0) : _mm256_cvtepu8_epi16(v0);
      const __m256i a1 = SIGNED ? _mm256_cvtepi8_epi16(v1) : _mm256_cvtepu8_epi16(v1);
      for (int r = 0; r < ROWS; ++r) {
        const ACT* x = xq + r * K + b * 32;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
        add(r, dot_s16(a0, x0, a1, x1), b, dw, mw);
      }
    }
  }

  inline void store(float* y, int64_t ldy) {
    for (int r = 0; r < ROWS; ++r) y[r * ldy] = hsum(acc[r]) + corr[r];
  }
};

// y[r * ldy] = sum over K of row w (GGUF blocks of format FMT) times x row r, r < ROWS.
template <int64_t FMT, int ROWS, typename ACT>
void dot_rows(const uint8_t* w, Rows<ROWS, ACT>& rows) {
  const __m256i nib = _mm256_set1_epi8(15);
  if constexpr (FMT == Q4_K) {
    uint8_t sc[8], mn[8];
    for (int64_t sb = 0; sb < rows.K / 256; ++sb) {
      const uint8_t* p = w + sb * 144;
      const float d = f16(p), dmin = f16(p + 2);
      q4k_scales(p + 4, sc, mn);
      for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in low nibbles, 2c + 1 in high
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * c));
        const __m256i lo = _mm256_and_si256(q, nib);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
        const int j = 2 * c;
        rows.template block<false>(lo, lo, sb * 8 + j, d * sc[j], -dmin * mn[j]);
        rows.template block<false>(hi, hi, sb * 8 + j + 1, d * sc[j + 1], -dmin * mn[j + 1]);
      }
    }
  } else {
    for (int64_t b = 0; b < rows.blocks; ++b) {
      if constexpr (FMT == Q4_0) {
        const uint8_t* p = w + b * 18;
        const float dw = f16(p);
        const __m256i u = nibbles16(p + 2);
        rows.template block<false>(u, u, b, dw, -8.0f * dw);
      } else if constexpr (FMT == Q4_1) {
        const uint8_t* p = w + b * 20;
        const __m256i u = nibbles16(p + 4);
        rows.template block<false>(u, u, b, f16(p), f16(p + 2));
      } else {  // Q8_0
        const uint8_t* p = w + b * 34;
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
        rows.template block<true>(q, q, b, f16(p), 0.0f);
      }
    }
  }
}

template <int64_t FMT, typename ACT>
void output_range(const Problem& pr, int64_t n0, int64_t n1) {
  const ACT* xq = static_cast<const ACT*>(pr.xq);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = pr.w + n * pr.row_bytes;
    for (int64_t m0 = 0; m0 < pr.M; m0 += 4) {
      const ACT* q = xq + m0 * pr.K;
      const float* d = pr.xd + m0 * (pr.K / 32);
      const float* s = pr.xs + m0 * (pr.K / 32);
      float* y = pr.y + m0 * pr.N + n;
      switch (std::min<int64_t>(4, pr.M - m0)) {
        case 4: { Rows<4, ACT> r(q, d, s, pr.K); dot_rows<FMT>(w, r); r.store(y, pr.N); break; }
        case 3: { Rows<3, ACT> r(q, d, s, pr.K); dot_rows<FMT>(w, r); r.store(y, pr.N); break; }
        case 2: { Rows<2, ACT> r(q, d, s, pr.K); dot_rows<FMT>(w, r); r.store(y, pr.N); break; }
        default: { Rows<1, ACT> r(q, d, s, pr.K); dot_rows<FMT>(w, r); r.store(y, pr.N); break; }
      }
    }
  }
}

template <typename ACT>
void outputs_of(const Problem& pr, int64_t n0, int64_t n1) {
  switch (pr.fmt) {
    case Q4_0: output_range<Q4_0, ACT>(pr, n0, n1); break;
    case Q4_1: output_range<Q4_1, ACT>(pr, n0, n1); break;
    case Q8_0: output_range<Q8_0, ACT>(pr, n0, n1); break;
    default: output_range<Q4_K, ACT>(pr, n0, n1); break;
  }
}

// Outputs [n0, n1) of the product (every row of x).
inline void outputs(const Problem& pr, int64_t n0, int64_t n1) {
  if (pr.act_bits == 8) {
    outputs_of<int8_t>(pr, n0, n1);
  } else {
    outputs_of<int16_t>(pr, n0, n1);
  }
}
