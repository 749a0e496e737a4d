// FP8 block-scaled linear, weight-only: y = x @ W^T with W held as float8 e4m3 plus a float32
// scale per (output channel, `group` weights along K), x and y in T = fp16 or bf16, products
// summed in fp32:
//     W[n, k] = e4m3(q[n, k]) * scale[n, k / group]
// DeepSeek-V3 / Qwen3 FP8 (`weight_block_size: [128, 128]`, `weight_scale_inv` per block) is
// the case group = 128 with the scales of a 128-row block repeated per row (kept_weights.py's
// fp8_weight does it at load); per-channel (group = k) and per-tensor scales fit the same form.
// x is not quantized: this is the dequantize-in-register path (sm_80 has no FP8 tensor cores;
// on sm_90 kernels/fp8_block.py sends more than 8 rows to torch._scaled_mm, which quantizes x
// per token-group of 128 as the checkpoint's recipe does).
//
// Layout:
//   x       [m, k] T, contiguous rows, 16-byte aligned, k % 16 == 0.
//   y       [m, n] T, any row stride, contiguous rows.
//   w       [n, k] e4m3 bytes, contiguous, 16-byte aligned, plain order.
//   scales  [n, g_count] float32, g_count = ceil(k / group), group % 16 == 0 (a 16-k chunk lies
//           in one group; the last group may be partial).
// e4m3 -> float: two at a time through fp16 (cvt.rn.f16x2.e4m3x2 on sm_89+, common.cu's integer
// conversion below), exact.
//
// fp8_block_gemv_kernel<T, M, R>: m <= M rows of x (M = 1, 2, 4, 8), decode. As int8_gemm.cu's
//   GEMV: each warp owns R output channels, each lane streams 16-byte weight chunks
//   (k = 16 lane + 512 i), U per row in flight, converted and scaled in registers, used for the
//   M rows, reduced across the warp. Launch: grid ceil(n / (4 R)), block 128, no shared memory.
//   Instances: <T, 1, 2>, <T, 2, 2>, <T, 4, 4>, <T, 8, 4>.
//
// fp8_block_dequant_kernel<T>: W [n, k] T, dense (for cuBLAS above the GEMV's rows where
//   torch._scaled_mm does not take the layout). One thread per 16 weights.
//   Launch: grid ceil(n * k / 16 / 256), block 256.

#include "common.cu"

#define FP8B_GEMV_WARPS 4

LLMSERVE_DEVICE vec16_t fp8b_load_16(const unsigned char* p) {
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

// Bytes 2h and 2h + 1 of `word` (h = 0, 1) as floats times `s`.
template <int H>
LLMSERVE_DEVICE void fp8b_pair(float (&out)[2], unsigned int word, float s) {
  const unsigned int h2 = e4m3x2_to_f16x2((word >> (16 * H)) & 0xffffu);
  out[0] = DType<f16_t>::to_float(static_cast<unsigned short>(h2 & 0xffffu)) * s;
  out[1] = DType<f16_t>::to_float(static_cast<unsigned short>(h2 >> 16)) * s;
}

// One 16-k chunk: acc[r][i] += sum over the chunk of x[i, k] * W[r, k].
template <typename T, int M, int R>
LLMSERVE_DEVICE void fp8b_gemv_chunk(float (&acc)[R][M], const vec16_t (&wv)[R],
                                     const float (&s)[R], const T* const* xs, int kk) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // k = kk + 8 half .. + 7: words 2 half, 2 half + 1
    vec16_t xv[M];
#pragma unroll
    for (int i = 0; i < M; ++i) xv[i] = *reinterpret_cast<const vec16_t*>(xs[i] + kk + 8 * half);
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // weights 2p, 2p + 1 of the eight
      float w[R][2];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const unsigned int word = wv[r].w[2 * half + p / 2];
        if (p % 2 == 0) {
          fp8b_pair<0>(w[r], word, s[r]);
        } else {
          fp8b_pair<1>(w[r], word, s[r]);
        }
      }
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const unsigned int two = xv[i].w[p];
        const float x0 = DType<T>::to_float(static_cast<unsigned short>(two & 0xffffu));
        const float x1 = DType<T>::to_float(static_cast<unsigned short>(two >> 16));
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][i] = fmaf(x1, w[r][1], fmaf(x0, w[r][0], acc[r][i]));
      }
    }
  }
}

template <int R>
LLMSERVE_DEVICE void fp8b_load_chunk(vec16_t (&wv)[R], float (&s)[R],
                                     const unsigned char* const* rows, const float* const* srow,
                                     int kk, int group) {
  const int g = kk / group;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    wv[r] = fp8b_load_16(rows[r] + kk);
    s[r] = srow[r][g];
  }
}

template <typename T, int M, int R>
__global__ void __launch_bounds__(FP8B_GEMV_WARPS * 32)
    fp8_block_gemv_kernel(const T* __restrict__ x, long long x_stride,
                          const unsigned char* __restrict__ w, const float* __restrict__ scales,
                          T* __restrict__ y, long long y_stride, int m, int n, int k, int group) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * FP8B_GEMV_WARPS + warp) * R;
  if (n0 >= n) return;  // a whole warp; no CTA barrier follows
  const int g_count = (k + group - 1) / group;
  const unsigned char* rows[R];
  const float* srow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const long long row = min(n0 + r, n - 1);
    rows[r] = w + row * k;
    srow[r] = scales + row * g_count;
  }
  const T* xs[M];
#pragma unroll
  for (int i = 0; i < M; ++i) xs[i] = x + static_cast<long long>(min(i, m - 1)) * x_stride;

  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

  constexpr int U = M <= 2 ? 4 : 2;
  int kk = lane * 16;
  for (; kk + (U - 1) * 512 < k; kk += U * 512) {
    vec16_t wv[U][R];
    float s[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) fp8b_load_chunk<R>(wv[u], s[u], rows, srow, kk + u * 512, group);
#pragma unroll
    for (int u = 0; u < U; ++u) fp8b_gemv_chunk<T, M, R>(acc, wv[u], s[u], xs, kk + u * 512);
  }
  for (; kk < k; kk += 512) {  // the last < U chunks of this lane
    vec16_t wv[R];
    float s[R];
    fp8b_load_chunk<R>(wv, s, rows, srow, kk, group);
    fp8b_gemv_chunk<T, M, R>(acc, wv, s, xs, kk);
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
    fp8_block_dequant_kernel(const unsigned char* __restrict__ w, const float* __restrict__ scales,
                             T* __restrict__ out, int n, int k, int group) {
  const long long chunks = static_cast<long long>(n) * (k / 16);
  const long long idx = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
  if (idx >= chunks) return;
  const long long row = idx / (k / 16);
  const int k0 = static_cast<int>(idx % (k / 16)) * 16;
  const int g_count = (k + group - 1) / group;
  const float s = scales[row * g_count + k0 / group];
  const vec16_t wv = *reinterpret_cast<const vec16_t*>(w + row * k + k0);
  vec16_t v[2];
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // word q: weights 4q .. 4q + 3
    float a[2], b[2];
    fp8b_pair<0>(a, wv.w[q], s);
    fp8b_pair<1>(b, wv.w[q], s);
    v[q / 2].w[2 * (q % 2)] = DType<T>::pack2(a[0], a[1]);
    v[q / 2].w[2 * (q % 2) + 1] = DType<T>::pack2(b[0], b[1]);
  }
  T* dst = out + row * k + k0;
  reinterpret_cast<vec16_t*>(dst)[0] = v[0];
  reinterpret_cast<vec16_t*>(dst)[1] = v[1];
}
