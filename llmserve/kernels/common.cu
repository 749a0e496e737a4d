// Shared device helpers for the kernels in this folder; included textually by the other .cu files
// (kernels/cuda.py inlines it before handing a source to NVRTC, so CuPy's cache key covers it).
//
// What it provides:
//   - f16_t / bf16_t: 16-bit storage types with conversions, packing and the m16n8k16 MMA, written
//     in inline PTX so that no CUDA header is needed (NVRTC then compiles with no include path).
//   - cp.async (16 bytes, zero-filling when the source is out of range), ldmatrix and small
//     vector types for 16-byte loads and stores.
//   - fp8e4m3_t, the element of an FP8 KV pool, and its conversions: E4M3 -> fp16 / bf16 (exact)
//     and float -> E4M3 (round to nearest even, saturating to +-448). sm_89+ uses the cvt
//     instructions; older GPUs the integer version between the fp8-software markers.
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
// 8 bytes: 8 FP8 values, the unit a thread converts to one vec16_t of fp16 / bf16.
struct alignas(8) vec8_t {
  unsigned int w[2];
};

// FP8 E4M3 "fn" (torch.float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
// infinities, NaN = 0x7f / 0xff, largest finite 448, smallest subnormal 2^-9.
struct alignas(1) fp8e4m3_t {
  unsigned char bits;
};

// Whether a KV cache element type is FP8 (dequantized on load, scaled) or q's own type.
template <typename KV>
struct IsFp8 {
  static constexpr bool value = false;
};
template <>
struct IsFp8<fp8e4m3_t> {
  static constexpr bool value = true;
};

// fp8-software-begin
// FP8 E4M3 conversions in integer arithmetic: the path below sm_89 and, in the same words, the
// CPU emulator's (tests/test_kernels_emulated.py checks that the two copies stay identical).

// E4M3 byte -> fp16 bits, exact: every E4M3 value is a normal fp16. NaN -> NaN.
LLMSERVE_DEVICE unsigned int e4m3_to_f16_bits(unsigned int b) {
  const unsigned int sign = (b & 0x80u) << 8;
  const unsigned int exponent = (b >> 3) & 0xfu, mantissa = b & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return sign | 0x7e00u;
  if (exponent != 0u) return sign | ((exponent + 8u) << 10) | (mantissa << 7);
  if (mantissa == 0u) return sign;
  // subnormal: mantissa * 2^-9 = 2^(p - 9) * (1 + rest / 2^p), p the leading bit's position
  const unsigned int p = mantissa >= 4u ? 2u : (mantissa >= 2u ? 1u : 0u);
  return sign | ((p + 6u) << 10) | ((mantissa - (1u << p)) << (10u - p));
}

// float -> E4M3 byte, rounded to nearest even; beyond +-448 (infinities too) saturates to +-448;
// NaN -> NaN.
LLMSERVE_DEVICE unsigned int float_to_e4m3_bits(float f) {
  const unsigned int u = __float_as_uint(f);
  const unsigned int sign = (u >> 24) & 0x80u;
  const unsigned int magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7fu;   // NaN
  if (magnitude >= 0x43e00000u) return sign | 0x7eu;  // >= 448: saturate
  if (magnitude < 0x3c800000u) {                      // below 2^-6: units of 2^-9
    const unsigned int shift = 141u - (magnitude >> 23);  // units = significand >> shift
    if (shift > 24u) return sign;                         // below half a unit
    const unsigned int m = 0x800000u | (magnitude & 0x7fffffu);
    unsigned int units = m >> shift;
    const unsigned int rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (units & 1u))) units++;
    return sign | units;  // 8 units is 2^-6, the smallest normal: the same bits
  }
  unsigned int bits = (magnitude >> 20) - (120u << 3);  // rebias the exponent 127 -> 7
  const unsigned int rest = magnitude & 0xfffffu;       // the 20 bits dropped
  if (rest > 0x80000u || (rest == 0x80000u && (bits & 1u))) bits++;
  return sign | bits;  // below 448, so a carry never reaches the NaN pattern
}
// fp8-software-end

// Two E4M3 values (bits 0-7: the lower element, bits 8-15) -> fp16x2 (lower element low).
LLMSERVE_DEVICE unsigned int e4m3x2_to_f16x2(unsigned int two) {
#if __CUDA_ARCH__ >= 890
  unsigned int r;
  asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(r) : "r"(two));
  return r;
#else
  return e4m3_to_f16_bits(two & 0xffu) | (e4m3_to_f16_bits((two >> 8) & 0xffu) << 16);
#endif
}

// Two floats -> two E4M3 values in bits 0-15 (`lo` in bits 0-7), rounded to nearest even and
// saturated to +-448.
LLMSERVE_DEVICE unsigned int float2_to_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return float_to_e4m3_bits(lo) | (float_to_e4m3_bits(hi) << 8);
#endif
}

// Finite "minus infinity" for running maxima: exp2(x - NEG_BIG) never sees inf - inf.
#define LLMSERVE_NEG_BIG (-1.0e30f)

LLMSERVE_DEVICE float neg_inf() { return __int_as_float(0xff800000); }

#define LLMSERVE_LOG2E 1.4426950408889634f

// An attention sink (gpt-oss; sink_log2 in log2 units) joins a softmax row's denominator: given
// the row's running max m, sum of exponentials l = sum 2^(s - m) and accumulator a = sum 2^(s -
// m) v, both are rebased on max(m, sink) and 2^(sink - max) is added to l, so a / l is
// sum e^(s) v / (sum e^(s) + e^sink). An empty row (m = NEG_BIG) keeps a = 0.
LLMSERVE_DEVICE void add_sink(float sink_log2, float m, float& l, float& a) {
  const float top = fmaxf(m, sink_log2);
  const float c = exp2f(m - top);
  l = l * c + exp2f(sink_log2 - top);
  a *= c;
}

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
  // Two E4M3 values (bits 0-15, lower element in bits 0-7) -> two f16 in one register, exact.
  static LLMSERVE_DEVICE unsigned int from_e4m3x2(unsigned int two) { return e4m3x2_to_f16x2(two); }
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
  // Through fp16 and fp32, exact (an E4M3 value has 4 significant bits).
  static LLMSERVE_DEVICE unsigned int from_e4m3x2(unsigned int two) {
    const unsigned int h = e4m3x2_to_f16x2(two);
    return pack2(DType<f16_t>::to_float(static_cast<unsigned short>(h & 0xffffu)),
                 DType<f16_t>::to_float(static_cast<unsigned short>(h >> 16)));
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

// Eight E4M3 values -> eight T (exact), element i of the input to element i of the output.
template <typename T>
LLMSERVE_DEVICE vec16_t e4m3x8_to(const vec8_t& v) {
  vec16_t r;
  r.w[0] = DType<T>::from_e4m3x2(v.w[0] & 0xffffu);
  r.w[1] = DType<T>::from_e4m3x2(v.w[0] >> 16);
  r.w[2] = DType<T>::from_e4m3x2(v.w[1] & 0xffffu);
  r.w[3] = DType<T>::from_e4m3x2(v.w[1] >> 16);
  return r;
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
