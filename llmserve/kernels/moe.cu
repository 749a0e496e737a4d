// The routed experts of a mixture-of-experts layer (kernels/moe_reference.py's moe_experts), as
// two kernels that read each (token, expert) pair's expert weights by its id: no sort, no host
// synchronization, so a decode step runs in a CUDA graph. The gate / up / SiLU-and-mul of every
// pair is one kernel, the down projection with the top-k weighted sum (the combine) the other.
//
// Layouts (T = f16_t or bf16_t; IdxT = int or long long):
//   x [num_tokens, hidden], any row stride (a multiple of 8 elements), contiguous rows;
//   ids [num_tokens, top_k] IdxT, weights [num_tokens, top_k] float32, both contiguous;
//   pair p = t * top_k + j uses expert ids[p]; this rank holds experts first_expert ..
//   first_expert + num_local - 1 (expert parallelism) and skips the others' pairs;
//   w13 [num_local, 2 * inter, hidden]: each expert's gate rows, then its up rows; w2 [num_local,
//   hidden, inter]; both contiguous. hidden % 8 == 0, inter % 8 == 0 (16-byte vector loads).
//   h [num_tokens * top_k, inter] T: the workspace between the two kernels (rows of other ranks'
//   pairs are left unwritten and never read).
//   out [num_tokens, hidden], row stride a multiple of 8: every element written (0 for a token
//   none of whose experts is local).
//   gpt-oss (b13 not null): b13 [num_local, 2 * inter] (gate, then up) and b2 [num_local, hidden]
//   biases, and the clamped SwiGLU in place of SiLU-and-mul: with g = min(gate + b, limit) and
//   u = clamp(up + b, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g), in fp32, rounded to
//   T once; the down product adds b2[e, n] before the weight.
//
// moe_gate_up_kernel<T, IdxT>: one warp per (pair, intermediate row n); its lanes stride over
//   hidden in 16-byte chunks, computing gate_n . x and up_n . x in fp32, summed by shuffles;
//   h[p, n] = T(T(silu(T(gate))) * T(up)), the roundings of the reference (a T product, then
//   reference.silu_and_mul). Launch: grid (num_pairs, ceil(inter / 4)), block 128 (4 warps,
//   4 rows of n), no shared memory.
// moe_down_kernel<T, IdxT>: one warp per (token, output column n); for each of the token's
//   top_k pairs whose expert is local, in j order: d = w2[e, n] . h[p] in fp32, then
//   acc += T(T(d) * T(weights[p])) in fp32; out[t, n] = T(acc). (The reference adds its T rows
//   in expert order, rounding after each add: the two agree to the tests' tolerances, not bit
//   for bit.) Launch: grid (num_tokens, ceil(hidden / 4)), block 128, no shared memory.
//
// A GEMV per pair: each pair streams its expert's 3 * inter * hidden weights, so pairs that share
// an expert within a step read it again (from L2 when it fits). The shape for decode; a prefill
// of many tokens per expert wants a grouped tensor-core GEMM over tokens sorted by expert.

#include "common.cu"

constexpr int MOE_WARPS = 4;

template <typename T>
LLMSERVE_DEVICE void dot8(const vec16_t& a, const vec16_t& b, float& acc) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc += vec_get<T>(a, i) * vec_get<T>(b, i);
}

template <typename T, typename IdxT>
__global__ void __launch_bounds__(128)
    moe_gate_up_kernel(const T* __restrict__ x, long long x_stride, const IdxT* __restrict__ ids,
                       const T* __restrict__ w13, T* __restrict__ h, int top_k, int first_expert,
                       int num_local, int hidden, int inter, const T* __restrict__ b13,
                       float alpha, float limit) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const long long p = blockIdx.x;
  const int n = blockIdx.y * MOE_WARPS + warp;
  const long long e = static_cast<long long>(ids[p]) - first_expert;
  // Both conditions are the same for the 32 lanes of a warp: whole warps leave together.
  if (n >= inter || e < 0 || e >= num_local) return;
  const T* xr = x + (p / top_k) * x_stride;
  const T* gate_row = w13 + (e * 2 * inter + n) * static_cast<long long>(hidden);
  const T* up_row = gate_row + static_cast<long long>(inter) * hidden;
  float gate = 0.f, up = 0.f;
  for (int c = lane; c < hidden / 8; c += 32) {
    const vec16_t xv = *reinterpret_cast<const vec16_t*>(xr + c * 8);
    dot8<T>(xv, *reinterpret_cast<const vec16_t*>(gate_row + c * 8), gate);
    dot8<T>(xv, *reinterpret_cast<const vec16_t*>(up_row + c * 8), up);
  }
  gate = warp_sum(gate);
  up = warp_sum(up);
  if (lane == 0 && b13 != nullptr) {  // gpt-oss: biases, clamped SwiGLU
    const T* bias = b13 + e * 2 * inter;
    const float g = fminf(round_to<T>(gate) + DType<T>::to_float(bias[n].bits), limit);
    const float u = fminf(fmaxf(round_to<T>(up) + DType<T>::to_float(bias[inter + n].bits), -limit),
                          limit);
    h[p * inter + n].bits = DType<T>::from_float((u + 1.f) * g / (1.f + expf(-alpha * g)));
  } else if (lane == 0) {
    const float g = round_to<T>(gate);
    const float silu = round_to<T>(g / (1.f + expf(-g)));
    h[p * inter + n].bits = DType<T>::from_float(silu * round_to<T>(up));
  }
}

template <typename T, typename IdxT>
__global__ void __launch_bounds__(128)
    moe_down_kernel(const T* __restrict__ h, const IdxT* __restrict__ ids,
                    const float* __restrict__ weights, const T* __restrict__ w2,
                    T* __restrict__ out, long long out_stride, int top_k, int first_expert,
                    int num_local, int hidden, int inter, const T* __restrict__ b2) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const long long t = blockIdx.x;
  const int n = blockIdx.y * MOE_WARPS + warp;
  if (n >= hidden) return;
  float acc = 0.f;
  for (int j = 0; j < top_k; ++j) {
    const long long p = t * top_k + j;
    const long long e = static_cast<long long>(ids[p]) - first_expert;
    if (e < 0 || e >= num_local) continue;
    const T* hr = h + p * inter;
    const T* w_row = w2 + (e * hidden + n) * static_cast<long long>(inter);
    float d = 0.f;
    for (int c = lane; c < inter / 8; c += 32) {
      dot8<T>(*reinterpret_cast<const vec16_t*>(hr + c * 8),
              *reinterpret_cast<const vec16_t*>(w_row + c * 8), d);
    }
    d = warp_sum(d);
    if (b2 != nullptr) d = round_to<T>(d) + DType<T>::to_float(b2[e * hidden + n].bits);
    acc += round_to<T>(round_to<T>(d) * round_to<T>(weights[p]));
  }
  if (lane == 0) out[t * out_stride + n].bits = DType<T>::from_float(acc);
}
