// Batched LoRA (kernels/lora_reference.py's lora_add): each row of a step adds its own adapter's
// low-rank update to one projection's output, out[t] += B_s (A_s x[t]) with s = slot_ids[t],
// as two gathered products over the rows (Punica's BGMV: a per-row index, no sort, no host
// synchronization, so a decode step can be captured in a CUDA graph). The shrink x A^T to rank
// r is one kernel, the expand by B added into out the other. A projection may fuse parts that
// have their own A and B (q, k, v in qkv_proj; gate, up in gate_up_proj): part p's columns of
// out follow part p - 1's.
//
// Layouts (T = f16_t or bf16_t; IdxT = int or long long):
//   x [num_rows, in] T, any row stride (a multiple of 8 elements), contiguous rows;
//   slot_ids [num_rows] IdxT: the row's slot in the tables, 0 .. num_slots - 1; -1 (or any value
//     outside that range) for a row without an adapter: nothing of it is read or written;
//   a [num_slots, max_rank, num_parts, in] T, contiguous: slot s's row j of part p's A (rank
//     before part, so that the first r ranks of every part are one contiguous block);
//   b_p [num_slots, max_rank, out_p] T, contiguous, one tensor per part (up to 3): B^T, with
//     the adapter's scaling folded in (engine/lora_files.py), zero past an adapter's rank;
//   only the first `rank` (<= max_rank) rows of each A and B are used;
//   h [num_rows, rank * num_parts] T: the workspace between the kernels (column j * num_parts
//     + p: part p's rank j; rows without an adapter are left unwritten and never read);
//   out [num_rows, out_0 + out_1 + out_2] T, row stride a multiple of 8, updated in place.
//   in % 8 == 0 and every out_p % 8 == 0 (16-byte vector loads and stores).
//
// lora_shrink_kernel<T, IdxT>: one warp per (row, column c of h); its lanes stride over in in
//   16-byte chunks of x's row and A's row, in fp32, summed by shuffles; h[t, c] = T(sum) (the
//   reference's product rounds to T there too); column c reads A's row c of slot s (row j * parts
//   + p). Launch: grid (num_rows, ceil(num_parts * rank / 4)), block 128 (4 warps, 4 columns of
//   h), no shared memory.
// lora_expand_kernel<T, IdxT>: one thread per 8 consecutive columns of one part: acc[i] =
//   sum over j < rank of h[t, j * num_parts + p] * b_p[s, j, n + i] in fp32 (each j's 8 values one
//   16-byte load, a warp's loads 512 contiguous bytes), then out = T(out + T(acc)) (the
//   reference's T product, then its T add). Launch: grid (num_rows, ceil(max_p out_p / 1024),
//   num_parts), block 128, no shared memory.
//
// A GEMV per row: rows that share an adapter read its A and B again (from L2: 16 adapters of rank
// 16 on the 8B shape's qkv are 6 MB of A). The decode shape; a long prefill segment of one
// adapter wants a tensor-core GEMM over its rows (the engine sends those steps to torch's
// matmuls per segment, engine/lora.py).

#include "common.cu"

constexpr int LORA_WARPS = 4;
constexpr int LORA_EXPAND_THREADS = 128;

template <typename IdxT>
LLMSERVE_DEVICE long long lora_slot(const IdxT* slot_ids, long long row, int num_slots) {
  const long long s = static_cast<long long>(slot_ids[row]);
  return (s < 0 || s >= num_slots) ? -1 : s;
}

template <typename T, typename IdxT>
__global__ void __launch_bounds__(128)
    lora_shrink_kernel(const T* __restrict__ x, long long x_stride,
                       const IdxT* __restrict__ slot_ids, const T* __restrict__ a,
                       T* __restrict__ h, int num_slots, int num_parts, int max_rank, int rank,
                       int in_features) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const long long row = blockIdx.x;
  const int width = num_parts * rank;
  const int c = blockIdx.y * LORA_WARPS + warp;
  const long long s = lora_slot(slot_ids, row, num_slots);
  // Both conditions are the same for the 32 lanes of a warp: whole warps leave together.
  if (s < 0 || c >= width) return;
  const T* a_row = a + (s * max_rank * num_parts + c) * static_cast<long long>(in_features);
  const T* x_row = x + row * x_stride;
  float acc = 0.f;
  for (int k = lane; k < in_features / 8; k += 32) {
    const vec16_t xv = *reinterpret_cast<const vec16_t*>(x_row + k * 8);
    const vec16_t av = *reinterpret_cast<const vec16_t*>(a_row + k * 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += vec_get<T>(xv, i) * vec_get<T>(av, i);
  }
  acc = warp_sum(acc);
  if (lane == 0) h[row * width + c].bits = DType<T>::from_float(acc);
}

template <typename T, typename IdxT>
__global__ void __launch_bounds__(LORA_EXPAND_THREADS)
    lora_expand_kernel(const T* __restrict__ h, const IdxT* __restrict__ slot_ids,
                       const T* __restrict__ b0, const T* __restrict__ b1,
                       const T* __restrict__ b2, T* __restrict__ out, long long out_stride,
                       int num_slots, int num_parts, int max_rank, int rank, int out0, int out1,
                       int out2) {
  const long long row = blockIdx.x;
  const int p = blockIdx.z;
  const long long s = lora_slot(slot_ids, row, num_slots);
  const int width = p == 0 ? out0 : (p == 1 ? out1 : out2);
  const int n = (blockIdx.y * LORA_EXPAND_THREADS + threadIdx.x) * 8;
  if (s < 0 || n >= width) return;
  const T* b = p == 0 ? b0 : (p == 1 ? b1 : b2);
  const int first_column = p == 0 ? 0 : (p == 1 ? out0 : out0 + out1);
  const T* h_row = h + row * (num_parts * rank) + p;
  const T* b_col = b + s * max_rank * static_cast<long long>(width) + n;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
  for (int j = 0; j < rank; ++j) {
    const float hj = DType<T>::to_float(h_row[j * num_parts].bits);
    const vec16_t bv = *reinterpret_cast<const vec16_t*>(b_col + j * static_cast<long long>(width));
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += hj * vec_get<T>(bv, i);
  }
  vec16_t* dst = reinterpret_cast<vec16_t*>(out + row * out_stride + first_column + n);
  vec16_t o = *dst;
#pragma unroll
  for (int i = 0; i < 8; ++i) vec_set<T>(o, i, vec_get<T>(o, i) + round_to<T>(acc[i]));
  *dst = o;
}
