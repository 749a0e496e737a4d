// Paged prefill attention: variable-length query chunks (cu_seqlens_q) attending causally to their
// own new tokens and to the context already in the KV pool (chunked prefill, prefix-cache hits).
//
// Computes, for sequence b with n_q = cu_seqlens_q[b+1] - cu_seqlens_q[b] new tokens and context
// length seq_len = seq_lens[b] (this step's tokens included, their K/V already stored):
//     query i of b sits at position p = seq_len - n_q + i and, for each query head h,
//     out[cu_seqlens_q[b] + i, h, :] = softmax_j<=p(scale * q . K[b, j, h / group]) @ V[b, :, h / group]
// Flash-attention style: online softmax in fp32, K/V tiles in shared memory, tensor-core MMA
// (mma.sync m16n8k16, fp32 accumulate); the score matrix is never materialised. One-token queries
// (decode rows) are handled too, just less efficiently than by decode_attention.cu.
// Sliding window (window > 0): query p sees keys p - window + 1 .. p only, and a CTA skips the key
// tiles wholly before its first row's window. softcap_log2 > 0 (cap * log2 e): each score becomes
// cap * tanh(score / cap) before the mask (Gemma 2). With sinks (not null; fp32 [num_heads],
// gpt-oss) head h's learned logit joins each row's softmax denominator only (common.cu add_sink).
//
// Token trees (speculation, engine/features/token_tree.py), when tree_bits is not null: sequence
// b's keys from tree_start[b] on are its tree's nodes (node i at tree_start[b] + i, at most 64);
// query t sees key tree_start[b] + i only where bit i of tree_bits[t] is set (its ancestors and
// itself; 0 for the known tokens, which see no node anyway). A sequence without a tree has
// tree_start[b] >= seq_len. Sliding windows compare stored positions: not with trees.
//
// KV cache element type KV: T itself, or fp8e4m3_t (an FP8 pool; per-layer scales): each K/V tile
// is copied as FP8 and converted to T exactly in shared memory before the MMAs, and the scales
// are applied in fp32 as softmax(scale * k_scale * q . K) @ V * v_scale. With KV = T they are
// unused.
//
//     sequence b: |<------- context already in the pool ------->|<-- this step's n_q tokens -->|
//                 0                                   seq_len - n_q                      seq_len
//
// Layout:
//   q, out      [num_tokens, num_heads, HD]: any token / head strides (multiples of 8 elements),
//               last dim contiguous, 16-byte aligned rows.
//   k/v_cache   [num_blocks, block_size, num_kv_heads, HD] of KV, contiguous (reference.py's
//               layout); token j of sequence b is row j % block_size of block
//               block_tables[b, j / block_size]; any block_size.
//   block_tables[num_seqs, >= ceil(seq_len / block_size)] int32; seq_lens [num_seqs] int32;
//   cu_seqlens_q [num_seqs + 1] int32, non-decreasing, cu_seqlens_q[0] = 0.
//
// Rows: a sequence's (query token, head of the kv head's group) pairs are flattened,
// row R = i * group + g, so that one CTA serves several heads of a GQA group from one K/V tile.
// A CTA owns BM = 16 * MT * NW consecutive rows of one sequence for one kv head; each of its NW
// warps owns MT m-tiles of 16 rows, so every K/V fragment read from shared memory feeds MT MMAs.
// Key tiles of BN tokens stream through two cp.async stages.
//
// paged_prefill_kernel<T, KV, HD, NW, MT, BN> launch shape:
//   grid  (floor(num_tokens * group / BM) + num_seqs, num_kv_heads), block NW * 32 threads.
//   Sequence b's row tiles start at CTA floor(cu_seqlens_q[b] * group / BM) + b, which leaves room
//   for ceil(n_q * group / BM) tiles; each CTA finds its sequence by binary search and CTAs past
//   a sequence's last tile exit at once. CTAs run in reverse order, so that the latest (longest)
//   causal tiles start first. No host-side metadata is needed (CUDA-graph friendly).
//   dynamic shared memory, KV = T: (BM + 4 * BN) * (HD + 8) * 2 bytes: the Q tile, and K and V
//   tiles in two stages each (above 48 KB for HD 128: the caller raises the limit). KV = fp8:
//   (BM + 2 * BN) * (HD + 8) * 2 + 4 * BN * HD bytes: the Q tile, one converted K and V tile,
//   and the FP8 K and V tiles as copied, in two stages.
//   Instances used by kernels/cuda.py: block_m 64 = <NW 4, MT 1, BN 64> (87,040 bytes at HD 128;
//   fp8 84,992) and block_m 128 = <NW 4, MT 2, BN 32> (69,632 bytes at HD 128; fp8 68,608).

#include "common.cu"

template <typename T, typename KV, int HD, int NW, int MT, int BN>
__global__ void __launch_bounds__(NW * 32)
    paged_prefill_kernel(const T* __restrict__ q, long long q_stride_t, long long q_stride_h,
                         const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                         const int* __restrict__ block_tables, long long bt_stride,
                         const int* __restrict__ seq_lens, const int* __restrict__ cu_seqlens_q,
                         T* __restrict__ out, long long o_stride_t, long long o_stride_h,
                         int num_seqs, int num_heads, int num_kv_heads, int block_size,
                         float scale_log2, float k_scale, float v_scale, int window,
                         float softcap_log2, const unsigned long long* __restrict__ tree_bits,
                         const int* __restrict__ tree_start, const float* __restrict__ sinks) {
  static_assert(HD % 16 == 0, "head_dim must be a multiple of 16");
  static_assert(BN % 16 == 0, "key tile must be a multiple of 16");
  constexpr bool kFp8 = IsFp8<KV>::value;
  static_assert(kFp8 || sizeof(KV) == sizeof(T), "the cache holds T or FP8");
  constexpr int BM = 16 * MT * NW;   // rows per CTA; each warp owns MT m-tiles of 16 rows
  constexpr int NT = BN / 8;         // n-tiles of 8 keys in S
  constexpr int ROW = HD + 8;        // padded smem row (elements), ldmatrix conflict-free
  constexpr int CHUNKS = HD / 8;     // 16-byte chunks per row
  constexpr int FP8_CHUNKS = HD / 16;         // 16-byte chunks per FP8 K/V row
  constexpr int KV_STAGES = kFp8 ? 1 : 2;     // T tiles of K (and of V) in shared memory
  constexpr int THREADS = NW * 32;
  using D = DType<T>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);  // [BM][ROW]
  T* s_k = s_q + BM * ROW;                  // [KV_STAGES][BN][ROW]
  T* s_v = s_k + KV_STAGES * BN * ROW;      // [KV_STAGES][BN][ROW]
  // FP8 only: the copied tiles, [2 stages][K, V][BN][HD] bytes, converted into s_k / s_v.
  unsigned char* s_fp8 = reinterpret_cast<unsigned char*>(s_v + KV_STAGES * BN * ROW);

  const int group = num_heads / num_kv_heads;
  const int kvh = blockIdx.y;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int gid = lane >> 2;
  const int tig = lane & 3;

  // Which sequence and row tile: the largest b whose first tile index is <= linear.
  const int linear = gridDim.x - 1 - blockIdx.x;
  int b = 0;
  {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      const long long start = static_cast<long long>(cu_seqlens_q[mid]) * group / BM + mid;
      if (start <= linear) lo = mid;
      else hi = mid - 1;
    }
    b = lo;
  }
  const int q_start = cu_seqlens_q[b];
  const int n_q = cu_seqlens_q[b + 1] - q_start;
  const int tile = linear - static_cast<int>(static_cast<long long>(q_start) * group / BM + b);
  const int num_rows = n_q * group;
  const int row0 = tile * BM;
  if (n_q <= 0 || row0 >= num_rows) return;  // uniform over the CTA, before any barrier
  const int seq_len = seq_lens[b];
  const int ctx = seq_len - n_q;  // position of query 0
  // The tree's first key and the row offset of this sequence's bits, kept in shared memory and
  // read where a tile needs them (held in registers through the key loop, they made ptxas
  // spill on sm_90). Written before the first barrier of the key loop, read after it.
  __shared__ int tree_info[2];
  if (threadIdx.x == 0) {
    tree_info[0] = tree_bits != nullptr ? tree_start[b] : seq_len;
    tree_info[1] = q_start - ctx;
  }

  // Positions covered by this tile: keys [0, n_kv) are needed; key tiles ending at or before
  // first_pos + 1 are visible to every row and skip the mask.
  const int last_row = min(row0 + BM, num_rows) - 1;
  const int first_pos = ctx + row0 / group;
  const int n_kv = ctx + last_row / group + 1;
  const int num_kv_tiles = (n_kv + BN - 1) / BN;
  // With a sliding window, keys before the first row's window are never read (their blocks may
  // be freed): the key tiles wholly before it are skipped, and the first tile's rows before it
  // zero-filled (masked for every row).
  const int kv_lo = window > 0 ? max(first_pos - window + 1, 0) : 0;
  const int first_kv_tile = kv_lo / BN;

  // Q tile -> smem (rows past the sequence's rows are zero-filled and never written back).
#pragma unroll
  for (int c = tid; c < BM * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS;
    const int col = (c % CHUNKS) * 8;
    const int row = row0 + r;
    const bool valid = row < num_rows;
    const int token = valid ? row / group : 0;
    const int head = kvh * group + (valid ? row % group : 0);
    const T* src = q + static_cast<long long>(q_start + token) * q_stride_t + head * q_stride_h + col;
    cp_async_16(smem_addr(s_q + r * ROW + col), valid ? src : q, valid);
  }
  cp_async_commit();

  const int* table = block_tables + b * bt_stride;
  const long long kv_row_stride = static_cast<long long>(num_kv_heads) * HD;
  const long long head_off = static_cast<long long>(kvh) * HD;
  auto load_kv = [&](int kv_tile, int stage) {
    T* sk = s_k + stage * BN * ROW;
    T* sv = s_v + stage * BN * ROW;
#pragma unroll
    for (int c = tid; c < BN * CHUNKS; c += THREADS) {
      const int r = c / CHUNKS;
      const int col = (c % CHUNKS) * 8;
      const int tok = kv_tile * BN + r;
      const bool valid = tok >= kv_lo && tok < n_kv;  // read only the keys needed
      long long off = 0;
      if (valid) {
        const long long block = table[tok / block_size];
        off = (block * block_size + tok % block_size) * kv_row_stride + head_off + col;
      }
      cp_async_16(smem_addr(sk + r * ROW + col), k_cache + off, valid);
      cp_async_16(smem_addr(sv + r * ROW + col), v_cache + off, valid);
    }
    cp_async_commit();
  };
  // FP8: the same copies, into unpadded rows of the staging area (s_k / s_v hold what the
  // previous stage converted to; the MMAs read only those).
  auto load_kv_fp8 = [&](int kv_tile, int stage) {
    unsigned char* sk = s_fp8 + stage * 2 * BN * HD;
    unsigned char* sv = sk + BN * HD;
#pragma unroll
    for (int c = tid; c < BN * FP8_CHUNKS; c += THREADS) {
      const int r = c / FP8_CHUNKS;
      const int col = (c % FP8_CHUNKS) * 16;
      const int tok = kv_tile * BN + r;
      const bool valid = tok >= kv_lo && tok < n_kv;  // read only the keys needed
      long long off = 0;
      if (valid) {
        const long long block = table[tok / block_size];
        off = (block * block_size + tok % block_size) * kv_row_stride + head_off + col;
      }
      cp_async_16(smem_addr(sk + r * HD + col), k_cache + off, valid);
      cp_async_16(smem_addr(sv + r * HD + col), v_cache + off, valid);
    }
    cp_async_commit();
  };
  // The scores' factor: with an FP8 cache, q . K_stored * k_scale is q . K.
  const float score_scale = kFp8 ? scale_log2 * k_scale : scale_log2;

  // This lane's rows: gid and gid + 8 of each of its warp's m-tiles, and their query positions.
  // Rows past the end borrow the last row's position, so their arithmetic stays ordinary.
  int pos[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + (warp * MT + mt) * 16 + gid + 8 * h, num_rows - 1);
      pos[mt][h] = ctx + row / group;
    }
  }

  // Q's A fragments stay in registers unless that would crowd out the accumulators (MT = 2 with
  // HD = 128: 64 more registers); then they are re-read from shared memory at every k-step.
  constexpr bool kQInRegs = MT * HD <= 128;
  constexpr int QF_STEPS = kQInRegs ? HD / 16 : 1;
  float m_run[MT][2], l_run[MT][2];
  float acc[MT][HD / 8][4];
  unsigned int qf[MT][QF_STEPS][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m_run[mt][0] = m_run[mt][1] = LLMSERVE_NEG_BIG;
    l_run[mt][0] = l_run[mt][1] = 0.f;
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
  }

  if constexpr (kFp8) load_kv_fp8(first_kv_tile, first_kv_tile & 1);
  else load_kv(first_kv_tile, first_kv_tile & 1);
  for (int j = first_kv_tile; j < num_kv_tiles; ++j) {
    if (j + 1 < num_kv_tiles) {
      if constexpr (kFp8) load_kv_fp8(j + 1, (j + 1) & 1);
      else load_kv(j + 1, (j + 1) & 1);
      cp_async_wait<1>();  // Q and tile j have landed; tile j+1 may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // A fragments of this warp's Q rows: matrices (rows 0-7, cols 0-7), (8-15, 0-7),
    // (0-7, 8-15), (8-15, 8-15) of each 16-column k-step.
    const T* q_row_ptr = s_q + (warp * MT * 16 + (lane & 15)) * ROW + (lane >> 4) * 8;
    if (kQInRegs && j == first_kv_tile) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int kk = 0; kk < QF_STEPS; ++kk)
          ldmatrix_x4(qf[mt][kk], smem_addr(q_row_ptr + mt * 16 * ROW + kk * 16));
      }
    }

    if constexpr (kFp8) {
      // Convert stage j&1's FP8 K and V rows into s_k / s_v (free: every warp finished its MMAs
      // on the previous tile before the barrier that ends the last iteration).
      const unsigned char* src = s_fp8 + (j & 1) * 2 * BN * HD;  // K rows, then V rows
#pragma unroll
      for (int c = tid; c < 2 * BN * HD / 8; c += THREADS) {
        const int r = c / (HD / 8);  // rows [0, BN): K, [BN, 2 BN): V (s_v follows s_k)
        const int col = (c % (HD / 8)) * 8;
        const vec8_t raw = *reinterpret_cast<const vec8_t*>(src + r * HD + col);
        *reinterpret_cast<vec16_t*>(s_k + r * ROW + col) = e4m3x8_to<T>(raw);
      }
      __syncthreads();
    }
    const T* sk = kFp8 ? s_k : s_k + (j & 1) * BN * ROW;
    const T* sv = kFp8 ? s_v : s_v + (j & 1) * BN * ROW;

    // S = Q K^T for 16 * MT rows x BN keys; K[key][dim] gives the B fragments directly, and
    // each one serves all MT m-tiles.
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
    }
    {
      const int jm = lane >> 3;
      const T* row_ptr = sk + ((lane & 7) + 8 * (jm >> 1)) * ROW + 8 * (jm & 1);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        if (!kQInRegs) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            ldmatrix_x4(qf[mt][0], smem_addr(q_row_ptr + mt * 16 * ROW + kk * 16));
        }
        const int qk = kQInRegs ? kk : 0;
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          unsigned int bf[4];
          ldmatrix_x4(bf, smem_addr(row_ptr + np * 16 * ROW + kk * 16));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            D::mma(s[mt][2 * np], qf[mt][qk], bf[0], bf[1]);
            D::mma(s[mt][2 * np + 1], qf[mt][qk], bf[2], bf[3]);
          }
        }
      }
    }

    // Scale into log2 units; causal mask only where some row cannot see the whole tile.
    // Accumulator element e of n-tile nt: row gid (e < 2) or gid + 8, key nt*8 + 2*tig + e%2.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[mt][nt][e] *= score_scale;
          if (softcap_log2 > 0.f) s[mt][nt][e] = softcap_log2 * tanhf(s[mt][nt][e] / softcap_log2);
        }
      }
    }
    const int t_start = tree_info[0];  // first tree key (seq_len: no tree)
    if ((j + 1) * BN > first_pos + 1 || window > 0 || (j + 1) * BN > t_start) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = j * BN + nt * 8 + 2 * tig + (e & 1);
            const int p = pos[mt][e >> 1];
            // A tree key (at or after t_start, before p + 1) is seen where the row's bit is
            // set, read here: the tree's keys are a few tiles at most (no registers held)
            if (key > p || (window > 0 && key <= p - window) ||
                (key >= t_start && !((tree_bits[tree_info[1] + p] >> (key - t_start)) & 1ull)))
              s[mt][nt][e] = neg_inf();
          }
        }
      }
    }

    // Online softmax per row: new running max, rescale what was accumulated, exponentiate.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = LLMSERVE_NEG_BIG;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        const float m_new = fmaxf(m_run[mt][h], quad_max(mx));
        const float corr = exp2f(m_run[mt][h] - m_new);
        m_run[mt][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          s[mt][nt][2 * h] = exp2f(s[mt][nt][2 * h] - m_new);
          s[mt][nt][2 * h + 1] = exp2f(s[mt][nt][2 * h + 1] - m_new);
          sum += s[mt][nt][2 * h] + s[mt][nt][2 * h + 1];
        }
        l_run[mt][h] = l_run[mt][h] * corr + sum;
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
          acc[mt][d][2 * h] *= corr;
          acc[mt][d][2 * h + 1] *= corr;
        }
      }
    }

    // O += P V, 16 keys per k-step: S n-tiles 2kc and 2kc+1 form the A fragment of step kc;
    // ldmatrix.trans of V[key][dim] gives the B fragments, each shared by the MT m-tiles.
    {
      const int jm = lane >> 3;
      const T* row_ptr = sv + ((lane & 7) + 8 * (jm & 1)) * ROW + 8 * (jm >> 1);
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        unsigned int pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = D::pack2(s[mt][2 * kc][0], s[mt][2 * kc][1]);
          pa[mt][1] = D::pack2(s[mt][2 * kc][2], s[mt][2 * kc][3]);
          pa[mt][2] = D::pack2(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
          pa[mt][3] = D::pack2(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
          unsigned int bf[4];
          ldmatrix_x4_trans(bf, smem_addr(row_ptr + kc * 16 * ROW + dp * 16));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            D::mma(acc[mt][2 * dp], pa[mt], bf[0], bf[1]);
            D::mma(acc[mt][2 * dp + 1], pa[mt], bf[2], bf[3]);
          }
        }
      }
    }
    __syncthreads();  // all warps are done with stage j&1 before tile j+2 overwrites it
  }
  cp_async_wait<0>();  // nothing left in flight, even when no tile was needed

  // Normalise and store this lane's rows (accumulator columns d*8 + 2tig, +1).
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = quad_sum(l_run[mt][h]);
      const int row = row0 + (warp * MT + mt) * 16 + gid + 8 * h;
      if (row >= num_rows) continue;
      const int token = q_start + row / group;
      const int head = kvh * group + row % group;
      float rebase = 1.f;  // the accumulators' factor when a sink rebases the row
      if (sinks != nullptr) add_sink(sinks[head] * LLMSERVE_LOG2E, m_run[mt][h], l, rebase);
      float inv = l > 0.f ? rebase / l : 0.f;
      if constexpr (kFp8) inv *= v_scale;  // P @ V_stored * v_scale is P @ V
      unsigned int* dst = reinterpret_cast<unsigned int*>(
          out + static_cast<long long>(token) * o_stride_t + head * o_stride_h);
#pragma unroll
      for (int d = 0; d < HD / 8; ++d) {
        dst[d * 4 + tig] = D::pack2(acc[mt][d][2 * h] * inv, acc[mt][d][2 * h + 1] * inv);
      }
    }
  }
}
