// Paged decode attention: one query token per sequence over its whole context in the KV pool,
// split-K ("flash-decoding") when the batch alone cannot fill the GPU.
//
// Computes, for sequence b and query head h (kv head h / group, group = num_heads / num_kv_heads):
//     out[b, h, :] = softmax(scale * q[b, h, :] . K[b, j, kvh, :] for j < seq_lens[b]) @ V[b, :, kvh, :]
// in fp32 (scores, softmax, accumulators); inputs and output in T (fp16 or bf16). A sequence with
// seq_lens[b] <= 0 gets zeros. With a sliding window (window > 0) only keys j >= seq_lens[b] -
// window count, and the tiles wholly before them are not read (their blocks may be freed);
// with softcap_log2 > 0 (cap * log2 e) each score becomes cap * tanh(score / cap) (Gemma 2).
// With sinks (not null; fp32 [num_heads], gpt-oss) head h's learned logit joins the softmax's
// denominator only: p_j = e^(s_j) / (sum_i e^(s_i) + e^(sinks[h])), applied where the partials
// are normalised (the CTA's merge with one split, paged_decode_merge_kernel with several).
//
// KV cache element type KV: T itself, or fp8e4m3_t (an FP8 pool; per-layer scales): K and V are
// then stored / k_scale and / v_scale, converted to T exactly on load, and the scales are applied
// in fp32 as softmax(scale * k_scale * q . K) @ V * v_scale. With KV = T the scales are unused.
//
// Layout:
//   q           [num_seqs, num_heads, HD], any sequence / head strides (even), last dim contiguous
//   k/v_cache   [num_blocks, block_size, num_kv_heads, HD] of KV, contiguous (reference.py's
//               layout); token j of sequence b is row j % block_size of block
//               block_tables[b, j / block_size]; any block_size >= 1. When it is a multiple of
//               16 a 16-token tile lies in one block (one table read per tile); otherwise
//               (token-level KV, `--block-size 1`, or 2-8) each row of a tile reads its own
//               table entry, and rows before a sliding window are zero-filled too (their blocks
//               may be freed and reused).
//   block_tables[num_seqs, >= ceil(seq_len / block_size)] int32; seq_lens [num_seqs] int32
//   out         [num_seqs, num_heads, HD], any sequence / head strides, last dim contiguous
//   part_acc    [num_splits, num_seqs, num_heads, HD] fp32 and part_ml [num_splits, num_seqs,
//               num_heads, 2] fp32 (running max in log2 units, sum of exponentials): the split
//               partials, used only when num_splits > 1.
//
// Work split: a sequence's context is cut into 16-token tiles, n_tiles = ceil(seq_len / 16); split
// s of num_splits owns tiles [s * tps, min((s + 1) * tps, n_tiles)) with tps = ceil(n_tiles /
// num_splits), so short sequences in a ragged batch get short splits (possibly empty ones).
//
//     context:  |tile 0|tile 1| ... |           ...           |last tile (partial)|
//     splits:   |<---- split 0 ---->|<---- split 1 ---->| ... |<-- split n-1 -->|
//     warps:    w0 w1 w2 w3 w0 w1 w2 w3 ... (warp w takes every 4th tile of its split)
//
// paged_decode_kernel<T, KV, HD> launch shape:
//   grid  (num_kv_heads * ceil(group / 16), num_seqs, num_splits), block 128 (4 warps)
//   dynamic shared memory, KV = T: 4 warps * 2 stages * (K + V) * 16 rows * (HD + 8) * 2 bytes
//   = 512 * (HD + 8) bytes (69,632 for HD 128, above the 48 KB default: the caller raises it).
//   KV = fp8: per warp, 2 stages * (K + V) * 16 rows * HD bytes of FP8 as copied, plus one
//   (K + V) tile of 16 rows * (HD + 8) T that the warp converts each stage into before its MMAs:
//   4 * (64 * HD + 64 * (HD + 8)) bytes (67,584 for HD 128).
//   One CTA handles up to 16 query heads of one kv head (the MMA's 16 rows; rows past the group
//   are zero and never written), so K and V are read once per kv head, whatever the GQA ratio.
//   Each warp streams its tiles through its own two-stage cp.async pipeline and runs
//   S = Q K^T and O += P V on tensor cores (mma.sync m16n8k16, fp32 accumulate) with an online
//   softmax; the 4 warps' partial results are merged through shared memory at the end. With
//   num_splits == 1 the CTA writes `out`; otherwise it writes its partial (unnormalised acc, max,
//   sum) and paged_decode_merge_kernel combines the splits.
//
// paged_decode_merge_kernel<T, HD> launch shape: grid (num_heads, num_seqs), block HD threads.
//   out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits that own tiles.

#include "common.cu"

#define DECODE_WARPS 4
#define DECODE_TILE 16

// Tiles [*t0, *t1) of split `split`; the same arithmetic decides which splits the merge reads.
// With a sliding window (window > 0) the splits share the tiles from the one holding the first
// key in the window (seq_len - window) on; earlier tiles are never read.
__device__ __forceinline__ void decode_split_range(int seq_len, int window, int num_splits,
                                                   int split, int* t0, int* t1, int* num_active) {
  const int first = window > 0 ? max(seq_len - window, 0) / DECODE_TILE : 0;
  const int n_tiles = (max(seq_len, 0) + DECODE_TILE - 1) / DECODE_TILE - first;
  const int tps = (max(n_tiles, 0) + num_splits - 1) / num_splits;
  *t0 = first + min(split * tps, max(n_tiles, 0));
  *t1 = min(*t0 + tps, first + max(n_tiles, 0));
  *num_active = tps > 0 ? (n_tiles + tps - 1) / tps : 0;
}

// __launch_bounds__(128, 3): at most 168 registers, so that three CTAs fit on an SM (as their
// shared memory does for HD 128); without the cap ptxas takes 214 and only two fit.
template <typename T, typename KV, int HD>
__global__ void __launch_bounds__(DECODE_WARPS * 32, 3)
    paged_decode_kernel(const T* __restrict__ q, long long q_stride_s, long long q_stride_h,
                        const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                        const int* __restrict__ block_tables, long long bt_stride,
                        const int* __restrict__ seq_lens, T* __restrict__ out,
                        long long o_stride_s, long long o_stride_h, float* __restrict__ part_acc,
                        float* __restrict__ part_ml, int num_seqs, int num_heads,
                        int num_kv_heads, int block_size, float scale_log2, int num_splits,
                        float k_scale, float v_scale, int window, float softcap_log2,
                        const float* __restrict__ sinks) {
  static_assert(HD % 16 == 0, "head_dim must be a multiple of 16");
  constexpr bool kFp8 = IsFp8<KV>::value;
  static_assert(kFp8 || sizeof(KV) == sizeof(T), "the cache holds T or FP8");
  constexpr int ROW = HD + 8;  // smem row stride in elements: +16 bytes keeps ldmatrix conflict-free
  constexpr int CHUNKS = HD / 8;                        // 16-byte chunks per K/V row
  constexpr int STAGE = 2 * DECODE_TILE * ROW;          // one stage: K tile then V tile
  constexpr int WARP_ELEMS = 2 * STAGE;                 // two stages per warp
  // FP8: per warp, one T tile of K and V (STAGE elements, converted from the stage just landed)
  // and two stages of the copied bytes (rows unpadded: only the warp's own conversion reads them).
  constexpr int FP8_CHUNKS = HD / 16;                   // 16-byte chunks per FP8 row
  constexpr int FP8_STAGE_BYTES = 2 * DECODE_TILE * HD;
  constexpr int FP8_WARP_BYTES = STAGE * 2 + 2 * FP8_STAGE_BYTES;
  using D = DType<T>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);

  const int group = num_heads / num_kv_heads;
  const int head_tiles = (group + 15) / 16;
  const int kvh = blockIdx.x / head_tiles;
  const int head_tile = blockIdx.x % head_tiles;
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int gid = lane >> 2;  // accumulator row (and row + 8)
  const int tig = lane & 3;   // accumulator column pair

  const int seq_len = max(seq_lens[seq], 0);
  int t0, t1, num_active;
  decode_split_range(seq_len, window, num_splits, split, &t0, &t1, &num_active);
  const int first_key = window > 0 ? seq_len - window : 0;  // keys before it are masked

  // Q as the MMA's A operand (16 rows = query heads of this tile, HD columns), kept in registers.
  // Row r is query head kvh * group + head_tile * 16 + r, valid while head_tile * 16 + r < group.
  unsigned int qf[HD / 16][4];
  {
    const int hig_lo = head_tile * 16 + gid;
    const int hig_hi = hig_lo + 8;
    const bool ok_lo = hig_lo < group;
    const bool ok_hi = hig_hi < group;
    const T* q_seq = q + seq * q_stride_s + static_cast<long long>(kvh) * group * q_stride_h;
    const unsigned int* q_lo =
        reinterpret_cast<const unsigned int*>(q_seq + (ok_lo ? hig_lo : 0) * q_stride_h);
    const unsigned int* q_hi =
        reinterpret_cast<const unsigned int*>(q_seq + (ok_hi ? hig_hi : 0) * q_stride_h);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      // a0a1: (row gid, cols 2tig..), a2a3: (row gid+8, same), a4a5 / a6a7: cols + 8.
      qf[kk][0] = ok_lo ? q_lo[kk * 8 + tig] : 0u;
      qf[kk][1] = ok_hi ? q_hi[kk * 8 + tig] : 0u;
      qf[kk][2] = ok_lo ? q_lo[kk * 8 + 4 + tig] : 0u;
      qf[kk][3] = ok_hi ? q_hi[kk * 8 + 4 + tig] : 0u;
    }
  }

  T* warp_smem = kFp8 ? reinterpret_cast<T*>(smem_raw + warp * FP8_WARP_BYTES)
                      : smem + warp * WARP_ELEMS;
  unsigned char* fp8_stages = reinterpret_cast<unsigned char*>(warp_smem + STAGE);  // FP8 only
  const int* table = block_tables + seq * bt_stride;
  const long long kv_row_stride = static_cast<long long>(num_kv_heads) * HD;

  // Issue the cp.async copies of 16-token tile `tile` (K and V) into `stage`; rows past the end
  // of the sequence are zero-filled, never read, so stale or NaN pool slots cannot leak in.
  // row_off(r): the pool offset of the tile's row r (token tok0 + r) for this kv head.
  const bool one_block_per_tile = block_size % DECODE_TILE == 0;
  const long long head_off = static_cast<long long>(kvh) * HD;
  auto load_tile = [&](int tile, int stage) {
    const int tok0 = tile * DECODE_TILE;
    const long long base =
        (static_cast<long long>(table[tok0 / block_size]) * block_size + tok0 % block_size) *
            kv_row_stride + head_off;
    auto row_off = [&](int r) -> long long {
      if (one_block_per_tile) return base + r * kv_row_stride;
      const int tok = tok0 + r;
      return (static_cast<long long>(table[tok / block_size]) * block_size + tok % block_size) *
                 kv_row_stride + head_off;
    };
    // With blocks smaller than a tile, rows before the window may sit in freed blocks.
    const int lo = one_block_per_tile ? 0 : max(first_key, 0);
    if constexpr (kFp8) {
      unsigned char* sk = fp8_stages + stage * FP8_STAGE_BYTES;
      unsigned char* sv = sk + DECODE_TILE * HD;
#pragma unroll
      for (int i = 0; i < DECODE_TILE * FP8_CHUNKS / 32; ++i) {
        const int c = i * 32 + lane;
        const int r = c / FP8_CHUNKS;
        const int col = (c % FP8_CHUNKS) * 16;
        const bool valid = tok0 + r < seq_len && tok0 + r >= lo;
        const long long off = valid ? row_off(r) + col : 0;
        cp_async_16(smem_addr(sk + r * HD + col), valid ? k_cache + off : k_cache, valid);
        cp_async_16(smem_addr(sv + r * HD + col), valid ? v_cache + off : v_cache, valid);
      }
    } else {
      T* sk = warp_smem + stage * STAGE;
      T* sv = sk + DECODE_TILE * ROW;
#pragma unroll
      for (int i = 0; i < DECODE_TILE * CHUNKS / 32; ++i) {
        const int c = i * 32 + lane;
        const int r = c / CHUNKS;
        const int col = (c % CHUNKS) * 8;
        const bool valid = tok0 + r < seq_len && tok0 + r >= lo;
        const long long off = valid ? row_off(r) + col : 0;
        cp_async_16(smem_addr(sk + r * ROW + col), valid ? k_cache + off : k_cache, valid);
        cp_async_16(smem_addr(sv + r * ROW + col), valid ? v_cache + off : v_cache, valid);
      }
    }
    cp_async_commit();
  };
  // The scores' factor: with an FP8 cache, q . K_stored * k_scale is q . K.
  const float score_scale = kFp8 ? scale_log2 * k_scale : scale_log2;

  float m_lo = LLMSERVE_NEG_BIG, m_hi = LLMSERVE_NEG_BIG;  // running max (log2 units) per row
  float l_lo = 0.f, l_hi = 0.f;                            // this lane's share of the row sums
  float acc[HD / 8][4];
#pragma unroll
  for (int i = 0; i < HD / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  const int first = t0 + warp;
  const int n_mine = first < t1 ? (t1 - first + DECODE_WARPS - 1) / DECODE_WARPS : 0;
  if (n_mine > 0) load_tile(first, 0);

  for (int i = 0; i < n_mine; ++i) {
    if (i + 1 < n_mine) {
      load_tile(first + (i + 1) * DECODE_WARPS, (i + 1) & 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();
    const T* sk;
    if constexpr (kFp8) {
      // Convert this stage's FP8 rows into the warp's T tile, 8 elements per lane per step.
      // (Unrolled 4x: fully, ptxas spills at head_dim 128 under the 168-register cap.)
      const unsigned char* src = fp8_stages + (i & 1) * FP8_STAGE_BYTES;  // K rows, then V rows
      T* dst = warp_smem;
#pragma unroll 4
      for (int j = 0; j < 2 * DECODE_TILE * HD / 8 / 32; ++j) {
        const int c = j * 32 + lane;
        const int r = c / (HD / 8);  // rows 0-15: K, 16-31: V
        const int col = (c % (HD / 8)) * 8;
        const vec8_t raw = *reinterpret_cast<const vec8_t*>(src + r * HD + col);
        *reinterpret_cast<vec16_t*>(dst + r * ROW + col) = e4m3x8_to<T>(raw);
      }
      __syncwarp();
      sk = dst;
    } else {
      sk = warp_smem + (i & 1) * STAGE;
    }
    const T* sv = sk + DECODE_TILE * ROW;
    const int tok0 = (first + i * DECODE_WARPS) * DECODE_TILE;

    // S = Q K^T: 16 rows x 16 tokens as two n-tiles of 8 tokens. K rows are the B operand's
    // columns ("col" layout), so a plain ldmatrix of K[token][dim] gives the B fragments:
    // matrices (tokens 0-7, dims 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) of this k-step.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    {
      const int j = lane >> 3;
      const T* row_ptr = sk + ((lane & 7) + 8 * (j >> 1)) * ROW + 8 * (j & 1);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        unsigned int b[4];
        ldmatrix_x4(b, smem_addr(row_ptr + kk * 16));
        D::mma(s[0], qf[kk], b[0], b[1]);
        D::mma(s[1], qf[kk], b[2], b[3]);
      }
    }

    // Scale into log2 units, soft-cap (softcap_log2 > 0: cap * tanh(score / cap), in log2
    // units), and mask the tokens past the end (only the last tile has any) and, with a window,
    // before its first key (only the first tile of the window has any).
    // Accumulator element e of n-tile nt: row gid (e < 2) or gid + 8, token nt*8 + 2*tig + e%2.
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = tok0 + nt * 8 + 2 * tig + (e & 1);
        float x = s[nt][e] * score_scale;
        if (softcap_log2 > 0.f) x = softcap_log2 * tanhf(x / softcap_log2);
        s[nt][e] = tok < seq_len && tok >= first_key ? x : neg_inf();
      }
    }

    // Online softmax: new running max, rescale what was accumulated, exponentiate.
    const float mx_lo = quad_max(fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1])));
    const float mx_hi = quad_max(fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3])));
    const float new_lo = fmaxf(m_lo, mx_lo);
    const float new_hi = fmaxf(m_hi, mx_hi);
    const float corr_lo = exp2f(m_lo - new_lo);
    const float corr_hi = exp2f(m_hi - new_hi);
    m_lo = new_lo;
    m_hi = new_hi;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - new_lo);
      s[nt][1] = exp2f(s[nt][1] - new_lo);
      s[nt][2] = exp2f(s[nt][2] - new_hi);
      s[nt][3] = exp2f(s[nt][3] - new_hi);
    }
    l_lo = l_lo * corr_lo + (s[0][0] + s[0][1] + s[1][0] + s[1][1]);
    l_hi = l_hi * corr_hi + (s[0][2] + s[0][3] + s[1][2] + s[1][3]);
#pragma unroll
    for (int d = 0; d < HD / 8; ++d) {
      acc[d][0] *= corr_lo;
      acc[d][1] *= corr_lo;
      acc[d][2] *= corr_hi;
      acc[d][3] *= corr_hi;
    }

    // P as the A operand of O += P V (16 rows x 16 tokens): the two S accumulators line up with
    // the A fragment registers (row gid / gid+8, tokens 2tig.. and 8+2tig..).
    unsigned int pa[4];
    pa[0] = D::pack2(s[0][0], s[0][1]);
    pa[1] = D::pack2(s[0][2], s[0][3]);
    pa[2] = D::pack2(s[1][0], s[1][1]);
    pa[3] = D::pack2(s[1][2], s[1][3]);

    // V[token][dim] is the B operand in row layout: ldmatrix.trans gives the fragments. Matrices
    // (tokens 0-7, dims d0..d0+7), (8-15, d0..), (0-7, d0+8..), (8-15, d0+8..).
    {
      const int j = lane >> 3;
      const T* row_ptr = sv + ((lane & 7) + 8 * (j & 1)) * ROW + 8 * (j >> 1);
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        unsigned int b[4];
        ldmatrix_x4_trans(b, smem_addr(row_ptr + dp * 16));
        D::mma(acc[2 * dp], pa, b[0], b[1]);
        D::mma(acc[2 * dp + 1], pa, b[2], b[3]);
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }

  l_lo = quad_sum(l_lo);
  l_hi = quad_sum(l_hi);

  // Merge the 4 warps through shared memory (reusing the K/V stages: all copies have landed).
  __syncthreads();
  float* red_acc = reinterpret_cast<float*>(smem_raw);       // [4][16][HD]
  float* red_ml = red_acc + DECODE_WARPS * 16 * HD;          // [4][16][2]
  {
    float* mine = red_acc + warp * 16 * HD;
#pragma unroll
    for (int d = 0; d < HD / 8; ++d) {
      const int col = d * 8 + 2 * tig;
      *reinterpret_cast<float2_t*>(mine + gid * HD + col) = float2_t{acc[d][0], acc[d][1]};
      *reinterpret_cast<float2_t*>(mine + (gid + 8) * HD + col) = float2_t{acc[d][2], acc[d][3]};
    }
    if (tig == 0) {
      red_ml[(warp * 16 + gid) * 2 + 0] = m_lo;
      red_ml[(warp * 16 + gid) * 2 + 1] = l_lo;
      red_ml[(warp * 16 + gid + 8) * 2 + 0] = m_hi;
      red_ml[(warp * 16 + gid + 8) * 2 + 1] = l_hi;
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < 16 * HD; idx += DECODE_WARPS * 32) {
    const int r = idx / HD;
    const int d = idx % HD;
    const int hig = head_tile * 16 + r;
    if (hig >= group) continue;
    const int head = kvh * group + hig;
    float m = LLMSERVE_NEG_BIG;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) m = fmaxf(m, red_ml[(w * 16 + r) * 2]);
    float l = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) {
      const float scale = exp2f(red_ml[(w * 16 + r) * 2] - m);
      l += scale * red_ml[(w * 16 + r) * 2 + 1];
      a += scale * red_acc[(w * 16 + r) * HD + d];
    }
    if constexpr (kFp8) a *= v_scale;  // P @ V_stored * v_scale is P @ V
    if (num_splits == 1) {
      if (sinks != nullptr) add_sink(sinks[head] * LLMSERVE_LOG2E, m, l, a);
      const float value = l > 0.f ? a / l : 0.f;
      reinterpret_cast<unsigned short*>(out + seq * o_stride_s + head * o_stride_h)[d] =
          D::from_float(value);
    } else {
      const long long row = (static_cast<long long>(split) * num_seqs + seq) * num_heads + head;
      part_acc[row * HD + d] = a;
      if (d == 0) *reinterpret_cast<float2_t*>(part_ml + row * 2) = float2_t{m, l};
    }
  }
}

template <typename T, int HD>
__global__ void __launch_bounds__(HD)
    paged_decode_merge_kernel(const float* __restrict__ part_acc,
                              const float* __restrict__ part_ml, const int* __restrict__ seq_lens,
                              T* __restrict__ out, long long o_stride_s, long long o_stride_h,
                              int num_seqs, int num_heads, int num_splits, int window,
                              const float* __restrict__ sinks) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int d = threadIdx.x;
  int t0, t1, num_active;
  decode_split_range(seq_lens[seq], window, num_splits, 0, &t0, &t1, &num_active);

  const long long split_stride = static_cast<long long>(num_seqs) * num_heads;
  const long long row0 = static_cast<long long>(seq) * num_heads + head;
  float m = LLMSERVE_NEG_BIG;
  for (int s = 0; s < num_active; ++s) m = fmaxf(m, part_ml[(row0 + s * split_stride) * 2]);
  float l = 0.f, a = 0.f;
  for (int s = 0; s < num_active; ++s) {
    const long long row = row0 + s * split_stride;
    const float scale = exp2f(part_ml[row * 2] - m);
    l += scale * part_ml[row * 2 + 1];
    a += scale * part_acc[row * HD + d];
  }
  if (sinks != nullptr) add_sink(sinks[head] * LLMSERVE_LOG2E, m, l, a);
  const float value = l > 0.f ? a / l : 0.f;
  reinterpret_cast<unsigned short*>(out + seq * o_stride_s + head * o_stride_h)[d] =
      DType<T>::from_float(value);
}
