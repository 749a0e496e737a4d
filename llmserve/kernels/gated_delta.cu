// One decode step of the gated delta rule (Qwen3-Next's GatedDeltaNet linear attention;
// kernels/gated_delta_reference.py, after transformers' torch_recurrent_gated_delta_rule):
// per sequence b and value head h, with the state S [dk, dv] in fp32,
//   q, k <- l2norm(q), l2norm(k) (when l2norm != 0; rsqrt(sum x^2 + 1e-6)), q <- q / sqrt(dk)
//   S <- exp(g) * S
//   delta = beta * (v - S^T k)            [dv]
//   S <- S + k delta^T
//   out = S^T q                           [dv]
//
// Layouts (T = f16_t or bf16_t; IdxT = int or long long):
//   q, k [num_rows, num_heads, dk] T contiguous; v, out [num_rows, num_heads, dv] T contiguous;
//   g, beta [num_rows, num_heads] float (g the log of the decay, beta already sigmoid-ed);
//   state [num_slots, num_heads, dk, dv] float contiguous, updated in place at slot_ids[row];
//   a row whose slot is outside 0 .. num_slots - 1 is skipped (nothing read or written).
//   dk <= GDN_MAX_DK (256).
//
// gated_delta_step_kernel<T, IdxT>: one thread per column j of S (a value channel); the CTA's
//   threads read one row of S as consecutive floats (coalesced). q and k go to shared memory in
//   fp32, every warp sums their squares itself (no second barrier). Two passes over the column:
//   S^T k with the decay applied, then the update, out and the store. Launch: grid (num_rows,
//   num_heads, ceil(dv / 128)), block 128, no dynamic shared memory. The state is read twice
//   and written once (a register-resident column would read it once; dk up to 256 floats per
//   thread is too many registers).

#include "common.cu"

constexpr int GDN_THREADS = 128;
constexpr int GDN_MAX_DK = 256;

LLMSERVE_DEVICE float gdn_sumsq(const float* x, int n) {
  float s = 0.f;
  for (int i = threadIdx.x % 32; i < n; i += 32) s += x[i] * x[i];
  return warp_sum(s);
}

template <typename T, typename IdxT>
__global__ void __launch_bounds__(GDN_THREADS)
    gated_delta_step_kernel(const T* __restrict__ q, const T* __restrict__ k,
                            const T* __restrict__ v, const float* __restrict__ g,
                            const float* __restrict__ beta, float* __restrict__ state,
                            const IdxT* __restrict__ slot_ids, T* __restrict__ out,
                            int num_slots, int num_heads, int dk, int dv, int l2norm) {
  __shared__ float s_q[GDN_MAX_DK];
  __shared__ float s_k[GDN_MAX_DK];
  const long long row = blockIdx.x;
  const int head = blockIdx.y;
  const long long slot = static_cast<long long>(slot_ids[row]);
  if (slot < 0 || slot >= num_slots) return;
  const long long rh = row * num_heads + head;
  for (int i = threadIdx.x; i < dk; i += GDN_THREADS) {
    s_q[i] = DType<T>::to_float(reinterpret_cast<const unsigned short*>(q)[rh * dk + i]);
    s_k[i] = DType<T>::to_float(reinterpret_cast<const unsigned short*>(k)[rh * dk + i]);
  }
  __syncthreads();
  float q_scale = rsqrtf(static_cast<float>(dk));
  float k_scale = 1.f;
  if (l2norm) {
    q_scale *= rsqrtf(gdn_sumsq(s_q, dk) + 1e-6f);
    k_scale = rsqrtf(gdn_sumsq(s_k, dk) + 1e-6f);
  }
  const int j = blockIdx.z * GDN_THREADS + threadIdx.x;
  if (j >= dv) return;
  const float decay = expf(g[rh]);
  float* s = state + (slot * num_heads + head) * static_cast<long long>(dk) * dv + j;
  float kv_mem = 0.f;
  for (int i = 0; i < dk; ++i) {
    kv_mem += s[static_cast<long long>(i) * dv] * decay * (s_k[i] * k_scale);
  }
  const float vj = DType<T>::to_float(reinterpret_cast<const unsigned short*>(v)[rh * dv + j]);
  const float delta = beta[rh] * (vj - kv_mem);
  float acc = 0.f;
  for (int i = 0; i < dk; ++i) {
    const long long at = static_cast<long long>(i) * dv;
    const float updated = s[at] * decay + (s_k[i] * k_scale) * delta;
    s[at] = updated;
    acc += updated * (s_q[i] * q_scale);
  }
  reinterpret_cast<unsigned short*>(out)[rh * dv + j] = DType<T>::from_float(acc);
}
