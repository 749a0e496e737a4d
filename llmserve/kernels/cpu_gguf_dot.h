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
      block16(SIGNED ? _mm256_cvtepi8_epi16(v0) : _mm256_cvtepu8_epi16(v0),
              SIGNED ? _mm256_cvtepi8_epi16(v1) : _mm256_cvtepu8_epi16(v1), b, dw, mw);
    }
  }

  // One block b as int16 levels (a0: its values 0-15, a1: 16-31), int16 x: s16 * s16 products.
  inline void block16(__m256i a0, __m256i a1, int64_t b, float dw, float mw) {
    for (int r = 0; r < ROWS; ++r) {
      const ACT* x = xq + r * K + b * 32;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
      add(r, dot_s16(a0, x0, a1, x1), b, dw, mw);
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

// Row w's levels widened to int16 [K] once, with each block of 32's dw and mw (as dot_rows
// computes them), for products of more than 4 rows: every group of rows then reads them from L1
// instead of unpacking the nibbles again.
inline void put16(__m256i v, bool is_signed, int16_t* lv, float* dw, float* mw, int64_t b,
                  float d, float m) {
  const __m128i v0 = _mm256_castsi256_si128(v), v1 = _mm256_extracti128_si256(v, 1);
  __m256i* out = reinterpret_cast<__m256i*>(lv + 32 * b);
  _mm256_storeu_si256(out, is_signed ? _mm256_cvtepi8_epi16(v0) : _mm256_cvtepu8_epi16(v0));
  _mm256_storeu_si256(out + 1, is_signed ? _mm256_cvtepi8_epi16(v1) : _mm256_cvtepu8_epi16(v1));
  dw[b] = d;
  mw[b] = m;
}

template <int64_t FMT>
void unpack_row(const uint8_t* w, int64_t K, int16_t* lv, float* dw, float* mw) {
  if constexpr (FMT == Q4_K) {
    const __m256i nib = _mm256_set1_epi8(15);
    uint8_t sc[8], mn[8];
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* p = w + sb * 144;
      const float d = f16(p), dmin = f16(p + 2);
      q4k_scales(p + 4, sc, mn);
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * c));
        const int j = 2 * c;
        put16(_mm256_and_si256(q, nib), false, lv, dw, mw, sb * 8 + j, d * sc[j], -dmin * mn[j]);
        put16(_mm256_and_si256(_mm256_srli_epi16(q, 4), nib), false, lv, dw, mw, sb * 8 + j + 1,
              d * sc[j + 1], -dmin * mn[j + 1]);
      }
    }
  } else {
    for (int64_t b = 0; b < K / 32; ++b) {
      if constexpr (FMT == Q4_0) {
        const uint8_t* p = w + b * 18;
        put16(nibbles16(p + 2), false, lv, dw, mw, b, f16(p), -8.0f * f16(p));
      } else if constexpr (FMT == Q4_1) {
        const uint8_t* p = w + b * 20;
        put16(nibbles16(p + 4), false, lv, dw, mw, b, f16(p), f16(p + 2));
      } else {  // Q8_0
        const uint8_t* p = w + b * 34;
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
        put16(q, true, lv, dw, mw, b, f16(p), 0.0f);
      }
    }
  }
}

// ROWS rows of int16 x times one unpacked row of W, into y[r * ldy].
template <int ROWS>
inline void unpacked_rows(const int16_t* lv, const float* dw, const float* mw, const int16_t* q,
                          const float* d, const float* s, int64_t K, float* y, int64_t ldy) {
  Rows<ROWS, int16_t> rows(q, d, s, K);
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m256i* a = reinterpret_cast<const __m256i*>(lv + 32 * b);
    rows.block16(_mm256_loadu_si256(a), _mm256_loadu_si256(a + 1), b, dw[b], mw[b]);
  }
  rows.store(y, ldy);
}

// Outputs [n0, n1) of a product of more than 4 int16 rows: each row of W unpacked once, then
// 8 rows of x per pass (12 of the 16 ymm registers: 8 accumulators, 2 levels, 2 x), into y^T
// [N, M]: each output's M values land side by side. Written into y [M, N] directly, the M
// stores of an output sit N * 4 bytes apart, which for N = 3072 (or SmolLM2's 49152-row head)
// is a multiple of 4 KiB: every one maps to the same L1 set, and past 8 rows each evicts the
// last (a [3072, 576] product took 14 ms at 32 rows against 0.9 at 16).
template <int64_t FMT>
void unpacked_range(const Problem& pr, int64_t n0, int64_t n1) {
  const int16_t* xq = static_cast<const int16_t*>(pr.xq);
  const int64_t blocks = pr.K / 32;
  std::vector<int16_t> lv(pr.K);
  std::vector<float> dw(blocks), mw(blocks);
  for (int64_t n = n0; n < n1; ++n) {
    unpack_row<FMT>(pr.w + n * pr.row_bytes, pr.K, lv.data(), dw.data(), mw.data());
    for (int64_t m0 = 0; m0 < pr.M; m0 += 8) {
      const int16_t* q = xq + m0 * pr.K;
      const float *d = pr.xd + m0 * blocks, *s = pr.xs + m0 * blocks;
      float* y = pr.y + n * pr.M + m0;  // y^T [N, M] (gguf_linear transposes it back)
      const int16_t* l = lv.data();
      const float *pw = dw.data(), *pm = mw.data();
      switch (std::min<int64_t>(8, pr.M - m0)) {
        case 8: unpacked_rows<8>(l, pw, pm, q, d, s, pr.K, y, 1); break;
        case 7: unpacked_rows<7>(l, pw, pm, q, d, s, pr.K, y, 1); break;
        case 6: unpacked_rows<6>(l, pw, pm, q, d, s, pr.K, y, 1); break;
        case 5: unpacked_rows<5>(l, pw, pm, q, d, s, pr.K, y, 1); break;
        case 4: unpacked_rows<4>(l, pw, pm, q, d, s, pr.K, y, 1); break;
        case 3: unpacked_rows<3>(l, pw, pm, q, d, s, pr.K, y, 1); break;
        case 2: unpacked_rows<2>(l, pw, pm, q, d, s, pr.K, y, 1); break;
        default: unpacked_rows<1>(l, pw, pm, q, d, s, pr.K, y, 1); break;
      }
    }
  }
}

template <int64_t FMT, typename ACT>
void output_range(const Problem& pr, int64_t n0, int64_t n1) {
  if constexpr (sizeof(ACT) == 2) {
    if (pr.M > 4) return unpacked_range<FMT>(pr, n0, n1);
  }
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
