// Multi-head latent attention (MLA) decode over the latent KV pool (DeepSeek-V2/V3, Kimi K2),
// with the up-projections absorbed (engine/model/families/deepseek.py): every query head attends
// over the same one latent "head" per token, [c_t | k_rope_t] of kv_lora_rank + qk_rope_head_dim
// values, used as the key whole and as the value through its first kv_lora_rank values:
//     out[b, h, :] = softmax(scale * q[b, h, :] . L[b, j, :] for j < seq_lens[b]) @ L[b, :, :rank]
// q arrives absorbed (q_nope W_UK concatenated with q_rope); the engine applies W_UV to out.
// fp32 scores, softmax and accumulators; q, pool and out in T (fp16 or bf16). A sequence with
// seq_lens[b] <= 0 gets zeros. kernels/reference.py's mla_decode_attention is the reference.
//
// Layout (D = kv_lora_rank + rope_dim, even; rank <= 128 * DPT):
//   q            [num_seqs, num_heads, D] T, any sequence / head strides (even), last dim contiguous
//   latent_cache [num_blocks, block_size, 1, D] T, contiguous (engine/kv/cache.py's MLA pool);
//                token j of sequence b is row j % block_size of block block_tables[b, j /
//                block_size]; any block_size >= 1
//   block_tables [num_seqs, >= ceil(seq_len / block_size)] int32; seq_lens [num_seqs] int32
//   out          [num_seqs, num_heads, rank] T, any sequence / head strides, last dim contiguous
//
// mla_decode_kernel<T, DPT> launch shape: grid (ceil(num_heads / 16), num_seqs), block 128, no
// split-K. One CTA serves up to MLA_HEADS = 16 query heads of one sequence (heads past num_heads
// are masked), so the latent is read once per 16 heads. The context is walked in 16-token tiles:
//   1. the tile's valid rows are copied into shared memory (4-byte words, coalesced); rows past
//      seq_len are zero-filled and never read from the pool (unused slots may hold anything);
//   2. the 16 x 16 scores (head, token): thread i of 128 takes pairs i and i + 128, a dot over D
//      of q (shared) and the tile (row stride D + 2 elements, so 16 rows hit 16 banks);
//   3. threads 0..15 update their head's running max (log2 units) and sum and write the tile's
//      probabilities and the rescale factor;
//   4. each thread rescales and accumulates the output dims tid + 128 i (i < DPT) of every head.
// Dynamic shared memory: 16 * D (q) + 16 * (D + 2) (tile) elements of T, then 16 * 16 + 3 * 16
// floats: (32 D + 32) * 2 + 1216 bytes (38,144 for D = 576).

#include "common.cu"

#define MLA_HEADS 16
#define MLA_TILE 16
#define MLA_THREADS 128

template <typename T, int DPT>
__global__ void __launch_bounds__(MLA_THREADS)
    mla_decode_kernel(const T* __restrict__ q, long long q_stride_s, long long q_stride_h,
                      const T* __restrict__ latent_cache, const int* __restrict__ block_tables,
                      long long bt_stride, const int* __restrict__ seq_lens, T* __restrict__ out,
                      long long o_stride_s, long long o_stride_h, int num_heads, int rank,
                      int dim, int block_size, float scale_log2) {
  using D = DType<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int row = dim + 2;  // tile row stride in elements (even: 4-byte words stay aligned)
  unsigned short* sq = reinterpret_cast<unsigned short*>(smem_raw);  // [16][dim]
  unsigned short* st = sq + MLA_HEADS * dim;                          // [16][dim + 2]
  float* sp = reinterpret_cast<float*>(st + MLA_TILE * row);          // [16 heads][16 tokens]
  float* sm = sp + MLA_HEADS * MLA_TILE;                              // running max per head
  float* sl = sm + MLA_HEADS;                                         // running sum per head
  float* sc = sl + MLA_HEADS;                                         // this tile's rescale

  const int tid = threadIdx.x;
  const int seq = blockIdx.y;
  const int head0 = blockIdx.x * MLA_HEADS;
  const int seq_len = max(seq_lens[seq], 0);
  const int words = dim / 2;

  // q of this CTA's heads (zeros past num_heads), and the softmax state.
  for (int i = tid; i < MLA_HEADS * words; i += MLA_THREADS) {
    const int g = i / words;
    const int w = i % words;
    unsigned int v = 0u;
    if (head0 + g < num_heads) {
      const T* src = q + seq * q_stride_s + static_cast<long long>(head0 + g) * q_stride_h;
      v = reinterpret_cast<const unsigned int*>(src)[w];
    }
    reinterpret_cast<unsigned int*>(sq)[i] = v;
  }
  if (tid < MLA_HEADS) {
    sm[tid] = LLMSERVE_NEG_BIG;
    sl[tid] = 0.f;
  }

  float acc[MLA_HEADS][DPT];
#pragma unroll
  for (int g = 0; g < MLA_HEADS; ++g) {
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[g][i] = 0.f;
  }

  const int* table = block_tables + seq * bt_stride;
  for (int tok0 = 0; tok0 < seq_len; tok0 += MLA_TILE) {
    const int n_valid = min(MLA_TILE, seq_len - tok0);
    __syncthreads();  // the previous tile's readers are done (and q / state are written)
    // 1. the tile, rows past seq_len zero-filled
    for (int i = tid; i < MLA_TILE * words; i += MLA_THREADS) {
      const int r = i / words;
      const int w = i % words;
      unsigned int v = 0u;
      if (r < n_valid) {
        const int tok = tok0 + r;
        const long long slot =
            static_cast<long long>(table[tok / block_size]) * block_size + tok % block_size;
        v = reinterpret_cast<const unsigned int*>(latent_cache + slot * dim)[w];
      }
      reinterpret_cast<unsigned int*>(st + r * row)[w] = v;
    }
    __syncthreads();
    // 2. scores (log2 units); masked tokens get -inf
    for (int pair = tid; pair < MLA_HEADS * MLA_TILE; pair += MLA_THREADS) {
      const int g = pair / MLA_TILE;
      const int r = pair % MLA_TILE;
      const unsigned short* qg = sq + g * dim;
      const unsigned short* kr = st + r * row;
      float s = 0.f;
      for (int k = 0; k < dim; k += 2) {
        s += D::to_float(qg[k]) * D::to_float(kr[k]);
        s += D::to_float(qg[k + 1]) * D::to_float(kr[k + 1]);
      }
      sp[pair] = r < n_valid ? s * scale_log2 : neg_inf();
    }
    __syncthreads();
    // 3. online softmax per head
    if (tid < MLA_HEADS) {
      float* p = sp + tid * MLA_TILE;
      float mx = sm[tid];
      for (int r = 0; r < n_valid; ++r) mx = fmaxf(mx, p[r]);
      const float corr = exp2f(sm[tid] - mx);
      float sum = 0.f;
      for (int r = 0; r < MLA_TILE; ++r) {
        const float e = r < n_valid ? exp2f(p[r] - mx) : 0.f;
        p[r] = e;
        sum += e;
      }
      sm[tid] = mx;
      sl[tid] = sl[tid] * corr + sum;
      sc[tid] = corr;
    }
    __syncthreads();
    // 4. out += P V over the valid rows, V = the tile's first `rank` values
#pragma unroll
    for (int g = 0; g < MLA_HEADS; ++g) {
      const float corr = sc[g];
#pragma unroll
      for (int i = 0; i < DPT; ++i) acc[g][i] *= corr;
    }
    for (int r = 0; r < n_valid; ++r) {
      float v[DPT];
#pragma unroll
      for (int i = 0; i < DPT; ++i) {
        const int d = tid + i * MLA_THREADS;
        v[i] = d < rank ? D::to_float(st[r * row + d]) : 0.f;
      }
#pragma unroll
      for (int g = 0; g < MLA_HEADS; ++g) {
        const float p = sp[g * MLA_TILE + r];
#pragma unroll
        for (int i = 0; i < DPT; ++i) acc[g][i] += p * v[i];
      }
    }
  }
  __syncthreads();

#pragma unroll
  for (int g = 0; g < MLA_HEADS; ++g) {
    const int head = head0 + g;
    if (head >= num_heads) break;
    const float l = sl[g];
    unsigned short* dst =
        reinterpret_cast<unsigned short*>(out + seq * o_stride_s + head * o_stride_h);
#pragma unroll
    for (int i = 0; i < DPT; ++i) {
      const int d = tid + i * MLA_THREADS;
      if (d < rank) dst[d] = D::from_float(l > 0.f ? acc[g][i] / l : 0.f);
    }
  }
}
