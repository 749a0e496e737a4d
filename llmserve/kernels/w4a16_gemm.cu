// W4A16 linear: y = x @ W^T with W held as 4-bit integers plus a float32 scale and zero point per
// `group` weights along K (GPTQ, AWQ, compressed-tensors pack-quantized), x and y in T = fp16 or
// bf16, products summed in fp32:
//     W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g],  g = k / group
// The kernels take scale and offset = -zero * scale, so a weight is one fma: q * scale + offset.
//
// Layout (kernels/w4a16.py's pack_w4a16 builds it once, at load, from the kept form of
// engine/model/kept_weights.py):
//   x       [m, k] T, contiguous rows, 16-byte aligned, k % 32 == 0. Act-order checkpoints: x is
//           gathered into the weight's column order first (w4a16.py), the weight never moves.
//   y       [m, n] T, any row stride, contiguous rows.
//   w       [n, k / 8] uint32, contiguous: word j of row n holds k = 8j .. 8j + 7 in its nibbles
//           0 .. 7 (bits 4i .. 4i + 3), unsigned levels 0 .. 15 (signed checkpoints shift by 8,
//           the zero point alike).
//   scales, offsets [n, g_count] float32, g_count = ceil(k / group); group % 32 == 0, so a 32-k
//           chunk lies in one group; the last group may be partial (k % group != 0).
// nibble -> float: the nibble is the low mantissa bits of 2^23 (one lop3), minus 2^23: exact.
//
// w4a16_gemv_kernel<T, M, R>: m <= M rows of x (M = 1, 2, 4, 8), decode: bound by reading the
//   weight bytes (half a byte per weight). Each warp owns R consecutive output channels; each lane
//   streams 16-byte chunks (32 weights) of its R rows, chunk c = lane + 32 i (k = 32 c: a warp
//   load is 512 contiguous bytes, every weight byte read once, L1 bypassed), U chunks per row in
//   flight before any is used, dequantizes each weight once in registers (one fma with its
//   group's scale and offset) and uses it for the M rows of x (L1 / L2 hits: every warp reads the
//   same x); the R x M sums are reduced across the warp with shuffles.
//   Launch: grid ceil(n / (4 * R)), block 128, no shared memory.
//   Instances: <T, 1, 2>, <T, 2, 2>, <T, 4, 4>, <T, 8, 4>.
//
// w4a16_dequant_kernel<T>: W [n, k] T, dense, in the packed (gathered) column order: more rows
//   than the GEMV serves go to cuBLAS on it (w4a16.py says why). One thread per word (8 weights,
//   one 16-byte store). Launch: grid ceil(n * k / 8 / 256), block 256.

#include "common.cu"

#define W4_GEMV_WARPS 4
#define W4_MAGIC 8388608.0f  // 2^23

// 16 weight bytes that are read once: skip L1 (the stream would only evict x).
LLMSERVE_DEVICE vec16_t w4_load_16(const unsigned int* p) {
#ifdef __CUDA_ARCH__
  vec16_t v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
      : "l"(p));
  return v;
#else
  return *reinterpret_cast<const vec16_t*>(p);
#endif
}

// Nibble E of `word` as a float, exactly.
template <int E>
LLMSERVE_DEVICE float w4_level(unsigned int word) {
  return __uint_as_float(((word >> (4 * E)) & 0xfu) | 0x4B000000u) - W4_MAGIC;
}

// One 32-k chunk: acc[r][i] += sum over the chunk of x[i, k] * W[r, k]; wv[r] holds the chunk's
// 32 levels of row r, s / o[r] its group's scale and offset.
template <typename T, int M, int R>
LLMSERVE_DEVICE void w4_gemv_chunk(float (&acc)[R][M], const vec16_t (&wv)[R],
                                   const float (&s)[R], const float (&o)[R], const T* const* xs,
                                   int kk) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // word j: k = kk + 8j .. kk + 8j + 7
    vec16_t xv[M];
#pragma unroll
    for (int i = 0; i < M; ++i) xv[i] = *reinterpret_cast<const vec16_t*>(xs[i] + kk + 8 * j);
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      float w[R][2];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        w[r][0] = fmaf(w4_level<0>(wv[r].w[j] >> (4 * e)), s[r], o[r]);
        w[r][1] = fmaf(w4_level<1>(wv[r].w[j] >> (4 * e)), s[r], o[r]);
      }
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const unsigned int two = xv[i].w[e / 2];
        const float x0 = DType<T>::to_float(static_cast<unsigned short>(two & 0xffffu));
        const float x1 = DType<T>::to_float(static_cast<unsigned short>(two >> 16));
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][i] = fmaf(x1, w[r][1], fmaf(x0, w[r][0], acc[r][i]));
      }
    }
  }
}

// Loads chunk kk's words of the R rows and their group's scale and offset.
template <int R>
LLMSERVE_DEVICE void w4_load_chunk(vec16_t (&wv)[R], float (&s)[R], float (&o)[R],
                                   const unsigned int* const* rows, const float* const* srow,
                                   const float* const* orow, int kk, int group) {
  const int g = kk / group;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    wv[r] = w4_load_16(rows[r] + kk / 8);
    s[r] = srow[r][g];
    o[r] = orow[r][g];
  }
}

template <typename T, int M, int R>
__global__ void __launch_bounds__(W4_GEMV_WARPS * 32)
    w4a16_gemv_kernel(const T* __restrict__ x, long long x_stride,
                      const unsigned int* __restrict__ w, const float* __restrict__ scales,
                      const float* __restrict__ offsets, T* __restrict__ y, long long y_stride,
                      int m, int n, int k, int group) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * W4_GEMV_WARPS + warp) * R;
  if (n0 >= n) return;  // a whole warp; no CTA barrier follows
  const int g_count = (k + group - 1) / group;
  const unsigned int* rows[R];
  const float* srow[R];
  const float* orow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const long long row = min(n0 + r, n - 1);
    rows[r] = w + row * (k / 8);
    srow[r] = scales + row * g_count;
    orow[r] = offsets + row * g_count;
  }
  const T* xs[M];
#pragma unroll
  for (int i = 0; i < M; ++i) xs[i] = x + static_cast<long long>(min(i, m - 1)) * x_stride;

  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

  // U chunks of R rows in flight per lane (2 x 4 x 16 bytes at most), loaded before any is used.
  constexpr int U = 2;
  int kk = lane * 32;
  for (; kk + (U - 1) * 1024 < k; kk += U * 1024) {
    vec16_t wv[U][R];
    float s[U][R], o[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
      w4_load_chunk<R>(wv[u], s[u], o[u], rows, srow, orow, kk + u * 1024, group);
#pragma unroll
    for (int u = 0; u < U; ++u) w4_gemv_chunk<T, M, R>(acc, wv[u], s[u], o[u], xs, kk + u * 1024);
  }
  for (; kk < k; kk += 1024) {  // the lane's last chunk, if any
    vec16_t wv[R];
    float s[R], o[R];
    w4_load_chunk<R>(wv, s, o, rows, srow, orow, kk, group);
    w4_gemv_chunk<T, M, R>(acc, wv, s, o, xs, kk);
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float total = warp_sum(acc[r][i]);
      if (lane == 0 && i < m && n0 + r < n) {
        unsigned short* out = reinterpret_cast<unsigned short*>(y + i * y_stride + n0 + r);
        *out = DType<T>::from_float(total);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256)
    w4a16_dequant_kernel(const unsigned int* __restrict__ w, const float* __restrict__ scales,
                         const float* __restrict__ offsets, T* __restrict__ out, int n, int k,
                         int group) {
  const long long words = static_cast<long long>(n) * (k / 8);
  const long long idx = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
  if (idx >= words) return;
  const long long row = idx / (k / 8);
  const int k0 = static_cast<int>(idx % (k / 8)) * 8;
  const int g_count = (k + group - 1) / group;
  const float s = scales[row * g_count + k0 / group], o = offsets[row * g_count + k0 / group];
  const unsigned int word = w[idx];
  vec16_t v;
#pragma unroll
  for (int e = 0; e < 8; e += 2) {
    const float lo = fmaf(w4_level<0>(word >> (4 * e)), s, o);
    const float hi = fmaf(w4_level<1>(word >> (4 * e)), s, o);
    v.w[e / 2] = DType<T>::pack2(lo, hi);
  }
  *reinterpret_cast<vec16_t*>(out + row * k + k0) = v;
}
