// The ISA-neutral part of kernels/cpu_wq.cpp, included once per ISA inside a namespace that
// defines W16 (16 float32 lanes: the weights of one tile at one k) and its operations:
// load16 / store16, widen<KIND> (16 stored weights -> float32 in registers, w = q * s + o),
// fma16 (acc += x * w) and add_store (acc + bias -> y). Nothing here names an intrinsic.

// bytes of one k of one tile: 16 int8 or fp8 weights, or 16 int4 / fp4 nibbles in 8 bytes
template <int KIND>
constexpr int64_t step_bytes() {
  return KIND == KIND_INT4 || KIND == KIND_FP4 ? 8 : 16;
}

// y[m0 .. m0 + ROWS)[n0 .. n0 + 16) for tile t, the weights widened in registers at each k.
template <int KIND, int ROWS>
void tile_rows(const Args& a, int64_t t, int64_t m0) {
  const int64_t groups = (a.K + a.group - 1) / a.group;  // the last may be partial
  const uint8_t* qt = a.q + t * a.K * step_bytes<KIND>();
  const float* st = a.scales + t * groups * TILE_N;
  const float* ot = a.offsets + t * groups * TILE_N;
  W16 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = zero16();
  for (int64_t g = 0; g < groups; ++g) {
    const W16 s = load16(st + g * TILE_N), o = load16(ot + g * TILE_N);
    for (int64_t k = g * a.group; k < std::min((g + 1) * a.group, a.K); ++k) {
      const W16 w = widen<KIND>(qt + k * step_bytes<KIND>(), s, o);
      for (int m = 0; m < ROWS; ++m) fma16(a.x[(m0 + m) * a.K + k], w, acc[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    add_store(acc[m], a.bias ? a.bias + t * TILE_N : nullptr, a.y + (m0 + m) * a.N + t * TILE_N);
  }
}

// Tile t's weights widened once into buf [K][16].
template <int KIND>
void widen_tile(const Args& a, int64_t t, float* buf) {
  const int64_t groups = (a.K + a.group - 1) / a.group;  // the last may be partial
  const uint8_t* qt = a.q + t * a.K * step_bytes<KIND>();
  const float* st = a.scales + t * groups * TILE_N;
  const float* ot = a.offsets + t * groups * TILE_N;
  for (int64_t g = 0; g < groups; ++g) {
    const W16 s = load16(st + g * TILE_N), o = load16(ot + g * TILE_N);
    for (int64_t k = g * a.group; k < std::min((g + 1) * a.group, a.K); ++k) {
      store16(buf + k * TILE_N, widen<KIND>(qt + k * step_bytes<KIND>(), s, o));
    }
  }
}

// y[m0 .. m0 + ROWS) of tile t from its widened weights: no widening in the inner loop.
template <int ROWS>
void buffered_rows(const Args& a, const float* buf, int64_t t, int64_t m0) {
  W16 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = zero16();
  for (int64_t k = 0; k < a.K; ++k) {
    const W16 w = load16(buf + k * TILE_N);
    for (int m = 0; m < ROWS; ++m) fma16(a.x[(m0 + m) * a.K + k], w, acc[m]);
  }
  for (int m = 0; m < ROWS; ++m) {
    add_store(acc[m], a.bias ? a.bias + t * TILE_N : nullptr, a.y + (m0 + m) * a.N + t * TILE_N);
  }
}

template <int KIND>
void tile(const Args& a, int64_t t, std::vector<float>& buf) {
  if (a.M > ROWS_M) {  // widened once into buf, then 6 rows of x per pass
    widen_tile<KIND>(a, t, buf.data());
    for (int64_t m0 = 0; m0 < a.M; m0 += BUFFERED_ROWS) {
      switch (std::min(BUFFERED_ROWS, a.M - m0)) {
        case 6: buffered_rows<6>(a, buf.data(), t, m0); break;
        case 5: buffered_rows<5>(a, buf.data(), t, m0); break;
        case 4: buffered_rows<4>(a, buf.data(), t, m0); break;
        case 3: buffered_rows<3>(a, buf.data(), t, m0); break;
        case 2: buffered_rows<2>(a, buf.data(), t, m0); break;
        default: buffered_rows<1>(a, buf.data(), t, m0); break;
      }
    }
    return;
  }
  switch (a.M) {
    case 4: tile_rows<KIND, 4>(a, t, 0); break;
    case 3: tile_rows<KIND, 3>(a, t, 0); break;
    case 2: tile_rows<KIND, 2>(a, t, 0); break;
    default: tile_rows<KIND, 1>(a, t, 0); break;
  }
}

template <int KIND>
void run_kind(const Args& a) {
  at::parallel_for(0, a.tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(a.M > ROWS_M ? a.K * TILE_N : 0);
    for (int64_t t = begin; t < end; ++t) tile<KIND>(a, t, buf);
  });
}

inline void run(const Args& a) {
  switch (a.kind) {
    case KIND_INT8: run_kind<KIND_INT8>(a); break;
    case KIND_INT4: run_kind<KIND_INT4>(a); break;
    case KIND_FP4: run_kind<KIND_FP4>(a); break;
    default: run_kind<KIND_FP8>(a); break;
  }
}

template <int KIND>
void widen_all_kind(const Args& a, float* out) {
  at::parallel_for(0, a.tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(a.K * TILE_N);
    for (int64_t t = begin; t < end; ++t) {
      widen_tile<KIND>(a, t, buf.data());
      for (int64_t j = 0; j < TILE_N; ++j) {
        float* row = out + (t * TILE_N + j) * a.K;
        for (int64_t k = 0; k < a.K; ++k) row[k] = buf[k * TILE_N + j];
      }
    }
  });
}

inline void widen_all(const Args& a, float* out) {
  switch (a.kind) {
    case KIND_INT8: widen_all_kind<KIND_INT8>(a, out); break;
    case KIND_INT4: widen_all_kind<KIND_INT4>(a, out); break;
    case KIND_FP4: widen_all_kind<KIND_FP4>(a, out); break;
    default: widen_all_kind<KIND_FP8>(a, out); break;
  }
}
