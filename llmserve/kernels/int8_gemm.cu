// Weight-only int8 linear: y = x @ W^T with W held as int8 plus one float32 scale per output
// channel (symmetric: W[n, k] ~= q[n, k] * scales[n], |q| <= 127), x and y in T = fp16 or bf16,
// products summed in fp32:
//     y[m, n] = T(scales[n] * sum_k float(x[m, k]) * q[n, k])
// Two kernels: a GEMV for a few rows of x (decode), bound by reading the weight bytes, and a
// tensor-core GEMM (mma.sync m16n8k16, fp32 accumulate) for more rows (prefill).
//
// Layout:
//   x      [m, k] T, any row stride (a multiple of 8 elements), contiguous rows, 16-byte aligned.
//   y      [m, n] T, any row stride, contiguous rows (written one element at a time).
//   w      [n, k] int8, contiguous, 16-byte aligned, k % 16 == 0, each row's k values permuted
//          within every group of 16 (kernels/int8.py's pack_weight does it once, at load):
//              stored byte 4j + t of a group holds k = 2j + (t & 1) + 8 * (t >> 1)
//          i.e. the order 0 1 8 9 | 2 3 10 11 | 4 5 12 13 | 6 7 14 15, so that 32-bit word j of a
//          group holds exactly the four weights one lane (j = lane % 4) needs for an m16n8k16 B
//          fragment (k = 2j, 2j + 1 in b0; 2j + 8, 2j + 9 in b1), and pairs with word j of the
//          two 16-byte halves of x[k .. k + 16) in the GEMV.
//   scales [n] float32.
// int8 -> float: the byte, with its sign bit flipped, is the low mantissa byte of 2^23
// (prmt), and 2^23 + 128 is subtracted: exact, two instructions, no slow I2F conversion.
//
// int8_gemv_kernel<T, M, R>: m <= M rows of x (M = 1, 2, 4, 8). Each warp owns R consecutive
//   output channels; each lane streams 16-byte weight chunks of its R rows (k = 16 * lane + 512 i:
//   every weight byte is read once per launch, in 512-byte coalesced warp loads, bypassing L1),
//   and the matching x chunks (L1 / L2 hits: every warp of the GPU reads the same x), then the
//   R x M sums are reduced across the warp with shuffles.
//   Launch: grid ceil(n / (4 * R)), block 128 (4 warps), no shared memory.
//   Instances: <T, 1, 2>, <T, 2, 2>, <T, 4, 4>, <T, 8, 4>.
//
// int8_gemm_kernel<T>: any m. A CTA computes a 64 x 128 tile of y (4 warps, each 64 rows x 32
//   channels: 4 m-tiles x 4 n-tiles of m16n8k16) over k in steps of 32, through two cp.async
//   stages: an x tile [64][32 + 8 pad] T and a weight tile [128][32 + 16 pad] bytes (the pads
//   make ldmatrix and the 4-byte B fragment reads conflict-free). Each B fragment is converted
//   from int8 in registers and feeds 4 MMAs. Rows past m / n and k past k are zero-filled.
//   Split-K over gridDim.z when the tiles alone cannot fill the GPU (decode batches of 9-64 rows:
//   N / 128 tiles): split z sums k tiles [z * ceil(T / S), ...) of the T = ceil(k / 32) and
//   writes its unscaled fp32 sums to partial [S, m, n]; without splits partial is null and y is
//   written directly.
//   Launch: grid (ceil(m / 64), ceil(n / 128), S) (the m tiles of one weight tile run together,
//   so the weight tile is read from memory once and from L2 after), block 128, dynamic shared
//   memory GEMM_SMEM_BYTES = 2 * (64 * 40 * 2 + 128 * 48) = 22,528 bytes.
//
// int8_gemm_finalize_kernel<T>: with S > 1 splits, y = T(scales * sum of the S partials, in split
//   order: deterministic). Launch: grid ceil(m * n / 256), block 256.

#include "common.cu"

#define INT8_GEMV_WARPS 4
#define INT8_GEMM_BM 64
#define INT8_GEMM_BN 128
#define INT8_GEMM_BK 32
#define INT8_GEMM_A_ROW (INT8_GEMM_BK + 8)   // elements of T
#define INT8_GEMM_B_ROW (INT8_GEMM_BK + 16)  // bytes
#define INT8_MAGIC 8388736.0f                // 2^23 + 128

// Selects bytes of {b:a} (a = bytes 0-3, b = bytes 4-7) by the four nibbles of s (PTX prmt).
LLMSERVE_DEVICE unsigned int int8_byte_perm(unsigned int a, unsigned int b, unsigned int s) {
#ifdef __CUDA_ARCH__
  unsigned int r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
#else
  const unsigned long long both = (static_cast<unsigned long long>(b) << 32) | a;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned int byte = (both >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu;
    r |= byte << (8 * i);
  }
  return r;
#endif
}

// Byte j (0..3) of `flipped` (= four int8 values ^ 0x80808080) as a float, exactly.
template <int J>
LLMSERVE_DEVICE float int8_at(unsigned int flipped) {
  return __uint_as_float(int8_byte_perm(flipped, 0x4B000000u, 0x7540u + J)) - INT8_MAGIC;
}

// 16 weight bytes that are read once: skip L1 (the stream would only evict x).
LLMSERVE_DEVICE vec16_t load_weights_16(const signed char* p) {
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

// One 16-k chunk of the GEMV: acc[r][i] += sum over the chunk of x[i, k] * q[r, k], the
// weights already loaded (wv[r], packed order), x read here (L1 / L2 hits).
template <typename T, int M, int R>
LLMSERVE_DEVICE void int8_gemv_chunk(float (&acc)[R][M], const vec16_t (&wv)[R],
                                     const T* const* xs, int kk) {
  vec16_t xv[M][2];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    xv[i][0] = *reinterpret_cast<const vec16_t*>(xs[i] + kk);
    xv[i][1] = *reinterpret_cast<const vec16_t*>(xs[i] + kk + 8);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float xf[M][4];  // k = 2j, 2j + 1, 2j + 8, 2j + 9 of this chunk
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const unsigned int lo = xv[i][0].w[j], hi = xv[i][1].w[j];
      xf[i][0] = DType<T>::to_float(static_cast<unsigned short>(lo & 0xffffu));
      xf[i][1] = DType<T>::to_float(static_cast<unsigned short>(lo >> 16));
      xf[i][2] = DType<T>::to_float(static_cast<unsigned short>(hi & 0xffffu));
      xf[i][3] = DType<T>::to_float(static_cast<unsigned short>(hi >> 16));
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const unsigned int flipped = wv[r].w[j] ^ 0x80808080u;
      const float q0 = int8_at<0>(flipped), q1 = int8_at<1>(flipped);
      const float q2 = int8_at<2>(flipped), q3 = int8_at<3>(flipped);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        float a = acc[r][i];
        a = fmaf(xf[i][0], q0, a);
        a = fmaf(xf[i][1], q1, a);
        a = fmaf(xf[i][2], q2, a);
        acc[r][i] = fmaf(xf[i][3], q3, a);
      }
    }
  }
}

template <typename T, int M, int R>
__global__ void __launch_bounds__(INT8_GEMV_WARPS * 32)
    int8_gemv_kernel(const T* __restrict__ x, long long x_stride, const signed char* __restrict__ w,
                     const float* __restrict__ scales, T* __restrict__ y, long long y_stride, int m,
                     int n, int k) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * INT8_GEMV_WARPS + warp) * R;
  if (n0 >= n) return;  // a whole warp; no CTA barrier follows
  const signed char* rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = w + static_cast<long long>(min(n0 + r, n - 1)) * k;
  const T* xs[M];
#pragma unroll
  for (int i = 0; i < M; ++i) xs[i] = x + static_cast<long long>(min(i, m - 1)) * x_stride;

  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

  // Weight chunks in flight per lane: U x R x 16 bytes, loaded before any is used (U = 4 for
  // M <= 2, decode proper: one round trip to memory per 4 chunks; 2 for more rows, whose x
  // takes M x 32 bytes of registers per chunk).
  constexpr int U = M <= 2 ? 4 : 2;
  int kk = lane * 16;
  for (; kk + (U - 1) * 512 < k; kk += U * 512) {
    vec16_t wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) wv[u][r] = load_weights_16(rows[r] + kk + u * 512);
#pragma unroll
    for (int u = 0; u < U; ++u) int8_gemv_chunk<T, M, R>(acc, wv[u], xs, kk + u * 512);
  }
  for (; kk < k; kk += 512) {  // the last < U chunks of this lane
    vec16_t wv[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wv[r] = load_weights_16(rows[r] + kk);
    int8_gemv_chunk<T, M, R>(acc, wv, xs, kk);
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float total = warp_sum(acc[r][i]);
      if (lane == 0 && i < m && n0 + r < n) {
        unsigned short* out = reinterpret_cast<unsigned short*>(y + i * y_stride + n0 + r);
        *out = DType<T>::from_float(total * scales[n0 + r]);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(128)
    int8_gemm_kernel(const T* __restrict__ x, long long x_stride, const signed char* __restrict__ w,
                     const float* __restrict__ scales, T* __restrict__ y, long long y_stride,
                     float* __restrict__ partial, int m, int n, int k) {
  constexpr int BM = INT8_GEMM_BM, BN = INT8_GEMM_BN, BK = INT8_GEMM_BK;
  constexpr int A_ROW = INT8_GEMM_A_ROW, B_ROW = INT8_GEMM_B_ROW;
  constexpr int A_STAGE = BM * A_ROW * 2, B_STAGE = BN * B_ROW;  // bytes
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* s_a = smem_raw;                // 2 stages of [BM][A_ROW] T
  unsigned char* s_b = smem_raw + 2 * A_STAGE;  // 2 stages of [BN][B_ROW] int8

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  // Split-K: CTA z of gridDim.z takes k tiles [t0, t1) (the caller leaves no split empty).
  const int num_tiles = (k + BK - 1) / BK;
  const int per_split = (num_tiles + gridDim.z - 1) / gridDim.z;
  const int t0 = blockIdx.z * per_split, t1 = min(t0 + per_split, num_tiles);

  // Tile t into stage s: x is 64 rows x 4 chunks of 8 elements, w 128 rows x 2 chunks of 16
  // bytes; 256 chunks each, two per thread. k % 16 == 0, so a chunk is wholly in or out.
  auto load_tile = [&](int t, int s) {
    const int k0 = t * BK;
#pragma unroll
    for (int c = tid; c < BM * 4; c += 128) {
      const int row = c / 4, col = (c % 4) * 8;
      const bool valid = m0 + row < m && k0 + col < k;
      const T* src = valid ? x + static_cast<long long>(m0 + row) * x_stride + k0 + col : x;
      cp_async_16(smem_addr(s_a + s * A_STAGE + (row * A_ROW + col) * 2), src, valid);
    }
#pragma unroll
    for (int c = tid; c < BN * 2; c += 128) {
      const int row = c / 2, col = (c % 2) * 16;
      const bool valid = n0 + row < n && k0 + col < k;
      const signed char* src = valid ? w + static_cast<long long>(n0 + row) * k + k0 + col : w;
      cp_async_16(smem_addr(s_b + s * B_STAGE + row * B_ROW + col), src, valid);
    }
    cp_async_commit();
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

  if (t0 < t1) load_tile(t0, 0);
  for (int t = t0; t < t1; ++t) {
    const int s = (t - t0) % 2;
    if (t + 1 < t1) {
      load_tile(t + 1, 1 - s);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const unsigned char* a_tile = s_a + s * A_STAGE;
    const unsigned char* b_tile = s_b + s * B_STAGE;
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      unsigned int a[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = i * 16 + lane % 16, col = ks * 16 + (lane / 16) * 8;
        ldmatrix_x4(a[i], smem_addr(a_tile + (row * A_ROW + col) * 2));
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = warp * 32 + j * 8 + lane / 4;
        const unsigned int word =
            *reinterpret_cast<const unsigned int*>(b_tile + row * B_ROW + ks * 16 + (lane % 4) * 4);
        const unsigned int flipped = word ^ 0x80808080u;
        const unsigned int b0 = DType<T>::pack2(int8_at<0>(flipped), int8_at<1>(flipped));
        const unsigned int b1 = DType<T>::pack2(int8_at<2>(flipped), int8_at<3>(flipped));
#pragma unroll
        for (int i = 0; i < 4; ++i) DType<T>::mma(acc[i][j], a[i], b0, b1);
      }
    }
    __syncthreads();  // the next iteration refills the stage just read
  }

  // Accumulator c of tile (i, j): row i * 16 + lane / 4 (+ 8 for c >= 2), column
  // warp * 32 + j * 8 + 2 * (lane % 4) + (c & 1). One split: y directly; several: this split's
  // unscaled sums into partial[z][row][col], which int8_gemm_finalize_kernel adds up.
  float* part =
      partial == nullptr ? nullptr : partial + static_cast<long long>(blockIdx.z) * m * n;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = n0 + warp * 32 + j * 8 + 2 * (lane % 4) + c;
      if (col >= n) continue;
      const float scale = scales[col];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = m0 + i * 16 + lane / 4 + 8 * half;
          const float sum = acc[i][j][2 * half + c];
          if (row >= m) continue;
          if (part != nullptr) {
            part[static_cast<long long>(row) * n + col] = sum;
          } else {
            unsigned short* out = reinterpret_cast<unsigned short*>(y + row * y_stride + col);
            *out = DType<T>::from_float(sum * scale);
          }
        }
      }
    }
  }
}

// y[row, col] = T(scales[col] * sum over the splits, in order, of partial[z][row][col]).
template <typename T>
__global__ void __launch_bounds__(256)
    int8_gemm_finalize_kernel(const float* __restrict__ partial, const float* __restrict__ scales,
                              T* __restrict__ y, long long y_stride, int splits, int m, int n) {
  const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= static_cast<long long>(m) * n) return;
  const int row = static_cast<int>(index / n), col = static_cast<int>(index % n);
  float sum = 0.f;
  for (int z = 0; z < splits; ++z) sum += partial[z * static_cast<long long>(m) * n + index];
  unsigned short* out = reinterpret_cast<unsigned short*>(y + row * y_stride + col);
  *out = DType<T>::from_float(sum * scales[col]);
}
