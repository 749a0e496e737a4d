// Shared device helpers for the kernels in this folder; included textually by the other .cu files
// (kernels/cuda.py inlines it before handing a source to NVRTC, so CuPy's cache key covers it).
//
// What it provides:
//   - f16_t / bf16_t: 16-bit storage types with conversions, packing and the m16n8k16 MMA, written
//     in inline PTX so that no CUDA header is needed (NVRTC then compiles with no include path).
//   - cp.async (16 bytes, zero-filling when the source is out of range), ldmatrix and small
//     vector types for 16-byte loads and stores.
// Memory layout and launch shape: none of its own (device functions only; compiles to nothing).
// Needs sm_80 or newer (cp.async, ldmatrix, bf16 mma and cvt).

#ifndef LLMSERVE_COMMON_CU
#define LLMSERVE_COMMON_CU

#define LLMSERVE_DEVICE __device__ __forceinline__

struct alignas(2) f16_t {
  unsigned short bits;
};
struct alignas(2) bf16_t {
  unsigned short bits;
};

// 16 bytes, the unit of every global load and store in these kernels.
struct alignas(16) vec16_t {
  unsigned int w[4];
};
struct alignas(8) float2_t {
  float x, y;
};

// Finite "minus infinity" for running maxima: exp2(x - NEG_BIG) never sees inf - inf.
#define LLMSERVE_NEG_BIG (-1.0e30f)

LLMSERVE_DEVICE float neg_inf() { return __int_as_float(0xff800000); }

template <typename T>
struct DType;

template <>
struct DType<f16_t> {
  static LLMSERVE_DEVICE float to_float(unsigned short bits) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
  }
  static LLMSERVE_DEVICE unsigned short from_float(float f) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(f));
    return bits;
  }
  // Two floats into one register; `lo` lands in the low half (the lower matrix index).
  static LLMSERVE_DEVICE unsigned int pack2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  // d += a * b for one m16n8k16 tile, fp32 accumulators.
  static LLMSERVE_DEVICE void mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                  unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct DType<bf16_t> {
  static LLMSERVE_DEVICE float to_float(unsigned short bits) {
    return __uint_as_float(static_cast<unsigned int>(bits) << 16);
  }
  static LLMSERVE_DEVICE unsigned short from_float(float f) {
    unsigned short bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(f));
    return bits;
  }
  static LLMSERVE_DEVICE unsigned int pack2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static LLMSERVE_DEVICE void mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                  unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Element i (0..7) of a 16-byte vector of 16-bit values, as float.
template <typename T>
LLMSERVE_DEVICE float vec_get(const vec16_t& v, int i) {
  const unsigned int word = v.w[i >> 1];
  return DType<T>::to_float(static_cast<unsigned short>((i & 1) ? (word >> 16) : (word & 0xffffu)));
}

template <typename T>
LLMSERVE_DEVICE void vec_set(vec16_t& v, int i, float f) {
  const unsigned int bits = DType<T>::from_float(f);
  unsigned int& word = v.w[i >> 1];
  word = (i & 1) ? ((word & 0x0000ffffu) | (bits << 16)) : ((word & 0xffff0000u) | bits);
}

// Round a float to T and back: what storing to T and reloading would give.
template <typename T>
LLMSERVE_DEVICE float round_to(float f) {
  return DType<T>::to_float(DType<T>::from_float(f));
}

LLMSERVE_DEVICE unsigned int smem_addr(const void* p) {
  unsigned int r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte global -> shared copy that bypasses L1. With valid == false nothing is read and the 16
// destination bytes are zero-filled (src must still be some mapped address; pass the base).
LLMSERVE_DEVICE void cp_async_16(unsigned int dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

LLMSERVE_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
LLMSERVE_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8j..8j+7 give the row addresses of matrix j, and lane l receives
// row l/4, columns 2(l%4) and 2(l%4)+1 of matrix j in r[j].
LLMSERVE_DEVICE void ldmatrix_x4(unsigned int (&r)[4], unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// The same, transposed: lane l receives rows 2(l%4) and 2(l%4)+1 of column l/4 of matrix j.
LLMSERVE_DEVICE void ldmatrix_x4_trans(unsigned int (&r)[4], unsigned int addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

LLMSERVE_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Max / sum over the 4 lanes (l%4 = 0..3) that share one row of an MMA accumulator fragment.
LLMSERVE_DEVICE float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
LLMSERVE_DEVICE float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

#endif  // LLMSERVE_COMMON_CU
