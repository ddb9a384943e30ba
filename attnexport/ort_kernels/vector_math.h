// float32 vector helpers (GCC/Clang vector extensions) and the 16-bit storage types.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace attnexport {

// 16 float32 lanes (one AVX-512 register, two AVX2 ones). g++ 12 splits some of their
// operations badly for AVX2: see low_half, store16, where_less and Accumulator16.
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x16_unaligned __attribute__((vector_size(64), aligned(4)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x8_unaligned __attribute__((vector_size(32), aligned(4)));
typedef float f32x4 __attribute__((vector_size(16)));

// The halves of a 16-lane vector, and a 16-lane vector from its halves. Through a union
// (type punning g++ defines): g++ 12 compiles a shuffle of the upper half lane by lane and a
// memcpy of a computed vector through the stack and `rep movsl`.
union f32x16_halves {
  f32x16 whole;
  f32x8 half[2];
};
inline f32x8 low_half(f32x16 v) {
  f32x16_halves u;
  u.whole = v;
  return u.half[0];
}
inline f32x8 high_half(f32x16 v) {
  f32x16_halves u;
  u.whole = v;
  return u.half[1];
}
inline f32x16 join_halves(f32x8 low, f32x8 high) {
  // (A shuffle, vinsertf64x4: through a union, g++ 12 stored the halves and loaded the whole
  // from the stack in the AVX-512 build, which store forwarding cannot serve: ~20 cycles a
  // float16 load16_float.)
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

inline f32x16 load16(const float* p) { return *reinterpret_cast<const f32x16_unaligned*>(p); }
inline void store16(float* p, f32x16 v) {
#if defined(__AVX512F__)
  *reinterpret_cast<f32x16_unaligned*>(p) = v;
#else
  // Two 8-lane stores: g++ 12 copies a computed 16-lane vector to 4-byte-aligned memory through
  // the stack and `rep movsl` where the target's registers hold 8 lanes (perf: most of an
  // RMSNorm row's time).
  *reinterpret_cast<f32x8_unaligned*>(p) = low_half(v);
  *reinterpret_cast<f32x8_unaligned*>(p + 8) = high_half(v);
#endif
}
// (Not f32x16{} + x: without -ffast-math that is an addition of 0, for x = -0.)
inline f32x16 splat16(float x) { return f32x16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// The sum of v's lanes, pairwise in one fixed order: the halves added, then (0 + 2) + (1 + 3)
// (kernels whose numbers must not depend on the path rely on it).
inline float horizontal_sum(f32x8 v) {
  f32x4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return b[0] + b[1];
}
inline float horizontal_sum(f32x16 v) {
  return horizontal_sum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                        __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

#if defined(__AVX2__)
// The largest of v's lanes (exact in any order; a NaN lane makes the result unspecified).
inline float horizontal_max(f32x8 v) {
  const __m256 x = reinterpret_cast<__m256>(v);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float horizontal_max(f32x16 v) {
  const f32x8 low = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f32x8 high = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return horizontal_max(reinterpret_cast<f32x8>(
      _mm256_max_ps(reinterpret_cast<__m256>(low), reinterpret_cast<__m256>(high))));
}
#endif

// The 16 horizontal sums of v[0..15], in order: lane i of the result is the sum of v[i]'s lanes.
// A transposing reduction: 30 two-register shuffles and 15 adds for 16 sums, where 16 calls of
// horizontal_sum take ~7 operations each plus a scalar move.
inline f32x16 horizontal_sums16(const f32x16 (&v)[16]) {
  f32x16 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i)  // lanes [0, 8): v[2i]'s 8 partial sums, [8, 16): v[2i+1]'s
    halves[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                        19, 20, 21, 22, 23) +
                __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                        25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 4 partial sums each of v[4i .. 4i+3]
    quarters[i] = __builtin_shufflevector(halves[2 * i], halves[2 * i + 1], 0, 1, 2, 3, 8, 9, 10,
                                          11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  __builtin_shufflevector(halves[2 * i], halves[2 * i + 1], 4, 5, 6, 7, 12, 13, 14,
                                          15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 2 partial sums each of v[8i .. 8i+7]
    eighths[i] = __builtin_shufflevector(quarters[2 * i], quarters[2 * i + 1], 0, 1, 4, 5, 8, 9, 12,
                                         13, 16, 17, 20, 21, 24, 25, 28, 29) +
                 __builtin_shufflevector(quarters[2 * i], quarters[2 * i + 1], 2, 3, 6, 7, 10, 11,
                                         14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(eighths[0], eighths[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                 24, 26, 28, 30) +
         __builtin_shufflevector(eighths[0], eighths[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,
                                 25, 27, 29, 31);
}

inline f32x8 splat8(float x) { return f32x8{x, x, x, x, x, x, x, x}; }
// a < b ? x : y, lane-wise. g++ 12 lowers a comparison or ?: on a 64-byte vector lane by lane
// (scalar compares and branches: 4-8x slower) where the target has no 64-byte registers (AVX2);
// on 32-byte halves it emits vcmpps / vblendvps, hence the split there.
template <typename V>
inline V where_less(V a, V b, V x, V y) {
#if !defined(__AVX512F__)
  if constexpr (std::is_same_v<V, f32x16>) {
    return join_halves(low_half(a) < low_half(b) ? low_half(x) : low_half(y),
                       high_half(a) < high_half(b) ? high_half(x) : high_half(y));
  } else
#endif
  {
    return a < b ? x : y;
  }
}

// 16 float32 lanes carried from one loop iteration to the next (a running sum or maximum).
// g++ 12 keeps a loop-carried f32x16 on the stack where the target's registers hold 8 lanes
// (AVX2) and moves it through general registers every iteration (perf: most of an RMSNorm row
// and of the attention's softmax); there it is two 8-lane halves, which stay in registers. The
// lane-wise arithmetic is the same either way.
#if defined(__AVX512F__)
struct Accumulator16 {
  f32x16 lanes;
  explicit Accumulator16(f32x16 start = f32x16{}) : lanes(start) {}
  void add(f32x16 x) { lanes += x; }
  void add_product(f32x16 a, f32x16 b) { lanes += a * b; }
  void take_larger(f32x16 x) { lanes = where_less(lanes, x, x, lanes); }
  f32x16 value() const { return lanes; }
};
#else
struct Accumulator16 {
  f32x8 low, high;
  explicit Accumulator16(f32x16 start = f32x16{}) : low(low_half(start)), high(high_half(start)) {}
  void add(f32x16 x) { low += low_half(x), high += high_half(x); }
  void add_product(f32x16 a, f32x16 b) {
    low += low_half(a) * low_half(b), high += high_half(a) * high_half(b);
  }
  void take_larger(f32x16 x) {
    const f32x8 x_low = low_half(x), x_high = high_half(x);
    low = where_less(low, x_low, x_low, low), high = where_less(high, x_high, x_high, high);
  }
  f32x16 value() const { return join_halves(low, high); }
};
#endif

// exp(x) for x <= 0 to ~1 ulp, lane-wise: 2^n * e^r with n = round(x / ln2), |r| <= ln2 / 2,
// e^r by its degree-7 Taylor polynomial. Arguments below -87 give exp(-87) ~ 1.6e-38 (as a
// softmax weight, nothing). Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
template <typename V, typename I>
inline V exp_nonpositive(V x) {
  x = where_less(x, V{} - 87.0f, V{} - 87.0f, x);
  const V n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  const V r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  V p = V{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  I bits;
  if constexpr (sizeof(V) == sizeof(float)) {
    bits = (static_cast<I>(n) + 127) << 23;
  } else {
    bits = (__builtin_convertvector(n, I) + 127) << 23;
  }
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// silu(g) = g * sigmoid(g), lane-wise: sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) for
// g < 0, with e = exp(-|g|) <= 1, so the exponential never overflows (SiluAndMul, and
// PackedMatMulSiluAndMul's epilogue).
inline f32x16 silu16(f32x16 g) {
  const f32x16 zero{};
  const f32x16 magnitude = where_less(g, zero, -g, g);
  const f32x16 e = exp_nonpositive<f32x16, i32x16>(-magnitude);
  const f32x16 numerator = where_less(g, zero, e, splat16(1.0f));
  return g * (numerator / (1.0f + e));
}

// Storage types the kernels read and write; all math is float32.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(Half x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, sizeof h);
  return static_cast<float>(h);
}
inline float to_float(BFloat16 x) {
  const uint32_t bits = uint32_t{x.bits} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline Half from_float<Half>(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  Half out;
  std::memcpy(&out.bits, &h, sizeof h);
  return out;
}
template <>
inline BFloat16 from_float<BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((bits >> 16) | 0x40)};
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return BFloat16{static_cast<uint16_t>(bits >> 16)};
}

// 16 elements of a storage type as float32 lanes, and back (rounded to nearest even).
// The 16-bit loads widen whole vectors (vcvtph2ps for float16 where F16C or AVX-512 is there;
// a 16-bit shift for bfloat16), where converting lane by lane cost the bfloat16 and float16
// caches more time than their halved bytes saved (docs/benchmarks.md).
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef _Float16 f16x16 __attribute__((vector_size(32), aligned(2)));

typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1)));

inline float to_float(int8_t x) { return static_cast<float>(x); }

template <typename T>
inline f32x16 load16_float(const T* p) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return load16(reinterpret_cast<const float*>(p));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    // g++ 12 converts an int8 vector lane by lane (movsbl, vpinsrd), hence vpmovsxbd by
    // intrinsics (the maskz form: the plain one trips -Werror=maybe-uninitialized, as above).
#if defined(__AVX512F__)
    const i32x16 wide = reinterpret_cast<i32x16>(
        _mm512_maskz_cvtepi8_epi32(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    return __builtin_convertvector(wide, f32x16);
#elif defined(__AVX2__)
    const i32x8 low = reinterpret_cast<i32x8>(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    const i32x8 high = reinterpret_cast<i32x8>(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
    return join_halves(__builtin_convertvector(low, f32x8), __builtin_convertvector(high, f32x8));
#else
    const i32x16 wide = __builtin_convertvector(*reinterpret_cast<const i8x16*>(p), i32x16);
    return __builtin_convertvector(wide, f32x16);
#endif
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    // (g++ 12 widens a u16x16 as two 8-lane halves and an insert: vpmovzxwd zmm here)
#if defined(__AVX512F__)
    const u32x16 wide = reinterpret_cast<u32x16>(_mm512_maskz_cvtepu16_epi32(
                            0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))))
                        << 16;
#else
    const u32x16 wide = __builtin_convertvector(*reinterpret_cast<const u16x16*>(p), u32x16) << 16;
#endif
    f32x16 v;
    std::memcpy(&v, &wide, sizeof v);
    return v;
  } else {
    static_assert(std::is_same_v<T, Half>, "load16_float: float, Half, BFloat16 or int8");
#if defined(__AVX512F__)
    // One vcvtph2ps from memory (g++ 12's _mm512_cvtph_ps trips -Werror=maybe-uninitialized).
    __m512 v;
    asm("vcvtph2ps %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const __m256i*>(p)));
    return reinterpret_cast<f32x16>(v);
#elif defined(__F16C__)
    const __m128i* halves = reinterpret_cast<const __m128i*>(p);
    const f32x8 low = reinterpret_cast<f32x8>(_mm256_cvtph_ps(_mm_loadu_si128(halves)));
    const f32x8 high = reinterpret_cast<f32x8>(_mm256_cvtph_ps(_mm_loadu_si128(halves + 1)));
    return join_halves(low, high);
#else
    // g++ 12 widens a _Float16 vector lane by lane even where vcvtph2ps exists, hence the
    // intrinsics above; this is the portable path.
    return __builtin_convertvector(*reinterpret_cast<const f16x16*>(p), f32x16);
#endif
  }
}

// 8 elements of a storage type as float32 lanes (AVX2 and F16C, which both variants have):
// the AVX2 kernels work on 8-lane vectors where a 16-lane one would take two of their 16
// registers (see paged_attention.cc).
#if defined(__AVX2__)
template <typename T>
inline f32x8 load8_float(const T* p) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return *reinterpret_cast<const f32x8_unaligned*>(p);
  } else if constexpr (std::is_same_v<T, int8_t>) {
    const i32x8 wide = reinterpret_cast<i32x8>(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return __builtin_convertvector(wide, f32x8);
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    const i32x8 wide = reinterpret_cast<i32x8>(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return __builtin_convertvector(wide, f32x8);
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return reinterpret_cast<f32x8>(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  } else {
    static_assert(std::is_same_v<T, Half>, "load8_float: float, Half, BFloat16, int8 or uint8");
    return reinterpret_cast<f32x8>(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
}
#endif

template <typename T>
inline void store16_float(T* p, f32x16 v) {
  if constexpr (sizeof(T) == sizeof(float)) {
    store16(reinterpret_cast<float*>(p), v);
  } else {
    for (int i = 0; i < 16; ++i) p[i] = from_float<T>(v[i]);
  }
}

}  // namespace attnexport
