// Per-token layer ops of a Llama decoder: fused RMSNorm (+ residual add), rotary embedding
// (NeoX / HF rotate_half pairing) and SiLU-and-mul. Each matches kernels/reference.py's rounding:
// intermediate results that the reference rounds to T (fp16 or bf16) are rounded here too.
//
// rms_norm_kernel<T>: one CTA per token row.
//   x, residual, out, residual_out: [num_tokens, hidden] with any row stride (multiple of 8
//   elements), contiguous rows, 16-byte aligned; weight [hidden]. hidden % 8 == 0.
//   With residual: s = T(x + residual) is written to residual_out; otherwise s = x.
//   out = T(weight * T(s * rsqrt(mean(s^2) + eps))), sums and scaling in fp32.
//   Launch: grid num_tokens, block min(1024, round_up(hidden / 8, 32)) threads,
//   dynamic shared memory hidden * 2 bytes (the row, so it is read from memory once).
//
// rotary_kernel<T, PosT>: x, out [num_tokens, num_heads, head_dim], any token / head strides
//   (multiples of 8 elements), contiguous last dim; positions [num_tokens] (int32 or int64);
//   cos_sin [max_position, head_dim] fp32 contiguous = cat(cos, sin) of position * inv_freq.
//   For i < head_dim / 2, with c = cos_sin[p, i], s = cos_sin[p, head_dim / 2 + i]:
//     out[i] = x[i] * c - x[i + d/2] * s,   out[i + d/2] = x[i + d/2] * c + x[i] * s
//   out may be x itself (each thread reads its pairs before writing them).
//   Launch: 1-D grid, one thread per 8 pairs: num_tokens * num_heads * head_dim / 16 threads,
//   block 256. head_dim % 16 == 0.
//
// silu_and_mul_kernel<T>: x [num_tokens, 2 * d] = [gate | up] (row stride a multiple of 8),
//   out [num_tokens, d]: out = T(T(silu(gate)) * up). Launch: 1-D grid, one thread per 8 outputs,
//   block 256. d % 8 == 0.

#include "common.cu"

struct alignas(16) float4_t {
  float v[4];
};

template <typename T>
__global__ void __launch_bounds__(1024)
    rms_norm_kernel(const T* __restrict__ x, long long x_stride, const T* __restrict__ residual,
                    long long residual_stride, const T* __restrict__ weight, T* __restrict__ out,
                    long long out_stride, T* __restrict__ residual_out,
                    long long residual_out_stride, int hidden, float eps) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  vec16_t* s_row = reinterpret_cast<vec16_t*>(smem_raw);
  __shared__ float s_partial[32];

  const long long t = blockIdx.x;
  const int chunks = hidden / 8;
  float sum_sq = 0.f;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    vec16_t v = *reinterpret_cast<const vec16_t*>(x + t * x_stride + c * 8);
    if (residual != nullptr) {
      const vec16_t r = *reinterpret_cast<const vec16_t*>(residual + t * residual_stride + c * 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) vec_set<T>(v, i, vec_get<T>(v, i) + vec_get<T>(r, i));
      *reinterpret_cast<vec16_t*>(residual_out + t * residual_out_stride + c * 8) = v;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float f = vec_get<T>(v, i);
      sum_sq += f * f;
    }
    s_row[c] = v;
  }

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  sum_sq = warp_sum(sum_sq);
  if (lane == 0) s_partial[warp] = sum_sq;
  __syncthreads();
  if (warp == 0) {
    const int num_warps = (blockDim.x + 31) / 32;
    float v = lane < num_warps ? s_partial[lane] : 0.f;
    v = warp_sum(v);
    if (lane == 0) s_partial[0] = v;
  }
  __syncthreads();
  const float rstd = rsqrtf(s_partial[0] / static_cast<float>(hidden) + eps);

  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const vec16_t v = s_row[c];
    const vec16_t w = *reinterpret_cast<const vec16_t*>(weight + c * 8);
    vec16_t o = {};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float normed = round_to<T>(vec_get<T>(v, i) * rstd);
      vec_set<T>(o, i, vec_get<T>(w, i) * normed);
    }
    *reinterpret_cast<vec16_t*>(out + t * out_stride + c * 8) = o;
  }
}

template <typename T, typename PosT>
__global__ void __launch_bounds__(256)
    rotary_kernel(const PosT* __restrict__ positions, const T* x, long long x_stride_t,
                  long long x_stride_h, T* out, long long out_stride_t, long long out_stride_h,
                  const float* __restrict__ cos_sin, int num_tokens, int num_heads,
                  int head_dim) {
  const int half = head_dim / 2;
  const int chunks_per_head = half / 8;
  const int chunks_per_token = num_heads * chunks_per_head;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<long long>(num_tokens) * chunks_per_token) return;
  const long long t = idx / chunks_per_token;
  const int rem = static_cast<int>(idx % chunks_per_token);
  const int h = rem / chunks_per_head;
  const int i0 = (rem % chunks_per_head) * 8;

  const long long pos = static_cast<long long>(positions[t]);
  const float4_t* cs = reinterpret_cast<const float4_t*>(cos_sin + pos * head_dim + i0);
  const float4_t* sn = reinterpret_cast<const float4_t*>(cos_sin + pos * head_dim + half + i0);
  const float4_t cos_a = cs[0], cos_b = cs[1], sin_a = sn[0], sin_b = sn[1];

  const T* src = x + t * x_stride_t + h * x_stride_h + i0;
  const vec16_t x1 = *reinterpret_cast<const vec16_t*>(src);
  const vec16_t x2 = *reinterpret_cast<const vec16_t*>(src + half);
  vec16_t o1 = {}, o2 = {};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float c = i < 4 ? cos_a.v[i] : cos_b.v[i - 4];
    const float s = i < 4 ? sin_a.v[i] : sin_b.v[i - 4];
    const float a = vec_get<T>(x1, i);
    const float b = vec_get<T>(x2, i);
    // Separate roundings, as torch evaluates x1 * cos - x2 * sin (no fused multiply-add).
    vec_set<T>(o1, i, __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    vec_set<T>(o2, i, __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
  }
  T* dst = out + t * out_stride_t + h * out_stride_h + i0;
  *reinterpret_cast<vec16_t*>(dst) = o1;
  *reinterpret_cast<vec16_t*>(dst + half) = o2;
}

template <typename T>
__global__ void __launch_bounds__(256)
    silu_and_mul_kernel(const T* __restrict__ x, long long x_stride, T* __restrict__ out,
                        long long out_stride, int num_tokens, int d) {
  const int chunks_per_token = d / 8;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<long long>(num_tokens) * chunks_per_token) return;
  const long long t = idx / chunks_per_token;
  const int i0 = static_cast<int>(idx % chunks_per_token) * 8;
  const vec16_t gate = *reinterpret_cast<const vec16_t*>(x + t * x_stride + i0);
  const vec16_t up = *reinterpret_cast<const vec16_t*>(x + t * x_stride + d + i0);
  vec16_t o = {};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float g = vec_get<T>(gate, i);
    const float silu = round_to<T>(g / (1.f + expf(-g)));
    vec_set<T>(o, i, silu * vec_get<T>(up, i));
  }
  *reinterpret_cast<vec16_t*>(out + t * out_stride + i0) = o;
}
