// One decode step of Mamba-2's selective state space (kernels/ssd_step_reference.py, after
// transformers' Mamba2Mixer.torch_forward with a cache): per sequence b, head h, channel p,
//   dt = softplus(dt_raw + dt_bias[h])   (torch's threshold 20: dt = x above it)
//   S[p, :] <- exp(dt * A[h]) * S[p, :] + dt * x[p] * B[group(h), :]
//   y[p] = S[p, :] . C[group(h), :] + D[h] * x[p]
// with group(h) = h / (heads / groups). The gate and norm after it are the model's.
//
// Layouts (T = f16_t or bf16_t; IdxT = int or long long):
//   x, out [num_rows, heads, head_dim] T contiguous; dt [num_rows, heads] float;
//   dt_bias, a, d [heads] float (a = -exp(A_log)); b, c [num_rows, groups, d_state] T contiguous;
//   state [num_slots, heads, head_dim, d_state] float contiguous, updated in place at
//   slot_ids[row]; a row whose slot is outside 0 .. num_slots - 1 is skipped.
//
// ssd_step_kernel<T, IdxT>: one warp per channel p, its lanes strided over d_state (consecutive
//   floats of S's row: coalesced), y by warp_sum. Launch: grid (num_rows, heads,
//   ceil(head_dim / 4)), block 128, no shared memory.

#include "common.cu"

constexpr int SSD_WARPS = 4;

template <typename T>
LLMSERVE_DEVICE float ssd_load(const T* p, long long i) {
  return DType<T>::to_float(reinterpret_cast<const unsigned short*>(p)[i]);
}

template <typename T, typename IdxT>
__global__ void __launch_bounds__(128)
    ssd_step_kernel(const T* __restrict__ x, const float* __restrict__ dt_raw,
                    const float* __restrict__ dt_bias, const float* __restrict__ a,
                    const T* __restrict__ b, const T* __restrict__ c, const float* __restrict__ d,
                    float* __restrict__ state, const IdxT* __restrict__ slot_ids,
                    T* __restrict__ out, int num_slots, int heads, int groups, int head_dim,
                    int d_state) {
  const long long row = blockIdx.x;
  const int head = blockIdx.y;
  const int p = blockIdx.z * SSD_WARPS + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const long long slot = static_cast<long long>(slot_ids[row]);
  if (slot < 0 || slot >= num_slots || p >= head_dim) return;  // whole warps leave together
  const long long rh = row * heads + head;
  const float raw = dt_raw[rh] + dt_bias[head];
  const float dt = raw > 20.f ? raw : log1pf(expf(raw));
  const float decay = expf(dt * a[head]);
  const float xp = ssd_load(x, rh * head_dim + p);
  const long long bc = (row * groups + head / (heads / groups)) * d_state;
  float* s = state + ((slot * heads + head) * head_dim + p) * static_cast<long long>(d_state);
  float y = 0.f;
  for (int n = lane; n < d_state; n += 32) {
    const float updated = s[n] * decay + dt * xp * ssd_load(b, bc + n);
    s[n] = updated;
    y += updated * ssd_load(c, bc + n);
  }
  y = warp_sum(y);
  if (lane == 0) {
    const unsigned short bits = DType<T>::from_float(y + d[head] * xp);
    reinterpret_cast<unsigned short*>(out)[rh * head_dim + p] = bits;
  }
}
