// store_kv: write this step's K and V rows into the paged KV pool by slot mapping.
//
// Computes, for every token t with slot_mapping[t] >= 0:
//     k_cache[slot / block_size, slot % block_size, h, :] = key[t, h, :]   (same for value)
// A slot of -1 marks a padding row (CUDA-graph batches) and is skipped.
// store_kv_fp8_kernel stores into an FP8 E4M3 pool instead: key[t, h, :] / k_scale (float32
// division) rounded to nearest even and saturated to +-448 (value: / v_scale), as
// kernels/reference.py's quantize_kv does, bit for bit.
//
// Layout: key / value are [num_tokens, num_kv_heads, head_dim] with any token and head strides
// (the engine hands views of its fused qkv output) but a contiguous last dimension, every row
// 16-byte aligned. k_cache / v_cache are one layer's halves of the pool, contiguous
// [num_blocks, block_size, num_kv_heads, head_dim], so slot s starts at element
// s * num_kv_heads * head_dim. Elements are 16-bit (fp16 or bf16: the copy does not convert, so
// one instantiation per index type serves both); head_dim must be a multiple of 8.
//
// store_kv_fp8_kernel<T, IdxT>: key / value T = fp16 or bf16 as above; k_cache / v_cache the
// same layout in 1-byte elements (rows 8-byte aligned).
//
// Launch shape (both kernels): 1-D grid, one thread per 8 elements of one token's K row and V
// row: threads = num_tokens * num_kv_heads * head_dim / 8, blockDim.x = 256.

#include "common.cu"

template <typename IdxT>
__global__ void __launch_bounds__(256)
    store_kv_kernel(const unsigned short* key, long long key_stride_t, long long key_stride_h,
                    const unsigned short* value, long long value_stride_t,
                    long long value_stride_h, unsigned short* k_cache, unsigned short* v_cache,
                    const IdxT* slot_mapping, int num_tokens, int num_kv_heads, int head_dim) {
  const int chunks_per_head = head_dim / 8;
  const int chunks_per_token = num_kv_heads * chunks_per_head;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<long long>(num_tokens) * chunks_per_token) return;
  const int t = static_cast<int>(idx / chunks_per_token);
  const int c = static_cast<int>(idx % chunks_per_token);
  const int h = c / chunks_per_head;
  const int d = (c % chunks_per_head) * 8;

  const long long slot = static_cast<long long>(slot_mapping[t]);
  if (slot < 0) return;

  const vec16_t k = *reinterpret_cast<const vec16_t*>(key + t * key_stride_t + h * key_stride_h + d);
  const vec16_t v =
      *reinterpret_cast<const vec16_t*>(value + t * value_stride_t + h * value_stride_h + d);
  const long long dst = (slot * num_kv_heads + h) * head_dim + d;
  *reinterpret_cast<vec16_t*>(k_cache + dst) = k;
  *reinterpret_cast<vec16_t*>(v_cache + dst) = v;
}

// Eight T values / scale -> eight E4M3 bytes.
template <typename T>
__device__ __forceinline__ vec8_t quantize_e4m3x8(const vec16_t& v, float scale) {
  vec8_t r;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const unsigned int lo = float2_to_e4m3x2(vec_get<T>(v, 4 * i) / scale,
                                             vec_get<T>(v, 4 * i + 1) / scale);
    const unsigned int hi = float2_to_e4m3x2(vec_get<T>(v, 4 * i + 2) / scale,
                                             vec_get<T>(v, 4 * i + 3) / scale);
    r.w[i] = lo | (hi << 16);
  }
  return r;
}

template <typename T, typename IdxT>
__global__ void __launch_bounds__(256)
    store_kv_fp8_kernel(const T* key, long long key_stride_t, long long key_stride_h,
                        const T* value, long long value_stride_t, long long value_stride_h,
                        fp8e4m3_t* k_cache, fp8e4m3_t* v_cache, const IdxT* slot_mapping,
                        int num_tokens, int num_kv_heads, int head_dim, float k_scale,
                        float v_scale) {
  const int chunks_per_head = head_dim / 8;
  const int chunks_per_token = num_kv_heads * chunks_per_head;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<long long>(num_tokens) * chunks_per_token) return;
  const int t = static_cast<int>(idx / chunks_per_token);
  const int c = static_cast<int>(idx % chunks_per_token);
  const int h = c / chunks_per_head;
  const int d = (c % chunks_per_head) * 8;

  const long long slot = static_cast<long long>(slot_mapping[t]);
  if (slot < 0) return;

  const vec16_t k =
      *reinterpret_cast<const vec16_t*>(key + t * key_stride_t + h * key_stride_h + d);
  const vec16_t v =
      *reinterpret_cast<const vec16_t*>(value + t * value_stride_t + h * value_stride_h + d);
  const long long dst = (slot * num_kv_heads + h) * head_dim + d;
  *reinterpret_cast<vec8_t*>(k_cache + dst) = quantize_e4m3x8<T>(k, k_scale);
  *reinterpret_cast<vec8_t*>(v_cache + dst) = quantize_e4m3x8<T>(v, v_scale);
}
