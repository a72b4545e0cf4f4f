// metal_sim.h: enough of the Metal Shading Language (and of MLX's Metal
// utils, which MLX prepends to every custom kernel) for a kernel body written
// for mx.fast.metal_kernel to compile as C++20 with g++ and run on the CPU
// under metal/sim's fiber runtime.
//
// Provides: scalar types (half = _Float16 with per-operation rounding,
// bfloat16_t/bfloat with round-to-nearest-even from float), vec<T, N> and the
// floatN/halfN/intN/uintN/... aliases with swizzles, metal:: math (with
// precise:: and fast:: spellings), SIMD-group and quad-group functions,
// threadgroup_barrier/simdgroup_barrier, atomics, simdgroup_matrix 8x8,
// as_type, numeric_limits, address-space qualifiers, and the MLX helpers
// Limits<T>, elem_to_loc, ceildiv.
//
// MSIM_CHECKED=1 (the default) gives device/constant pointers and
// threadgroup arrays as bounds-checked wrappers (msim::dptr, msim::tg_array):
// an access outside the buffer stops the dispatch with an error naming the
// buffer, the index and the thread. MSIM_CHECKED=0 uses raw pointers.
//
// How the emulation differs from an Apple GPU: metal/sim/__init__.py docstring.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <source_location>
#include <type_traits>

#include "msim_abi.h"

#ifndef MSIM_CHECKED
#define MSIM_CHECKED 1
#endif

// MSIM_RACECHECK=1: the kernel library is compiled with g++'s
// -fsanitize=thread instrumentation (every load and store of the kernel
// calls __tsan_readN/__tsan_writeN) and this header defines those hooks to
// feed metal/sim's race checker (msim_runtime.h) instead of ThreadSanitizer.
#ifndef MSIM_RACECHECK
#define MSIM_RACECHECK 0
#endif
#define MSIM_NO_RACECHECK __attribute__((no_sanitize_thread))

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef half float16_t;

namespace msim {
inline const msim_api* g_api = nullptr;

[[noreturn]] inline void fail(const char* msg) {
  g_api->fail(msg);
  __builtin_unreachable();
}

inline float bits_to_float(uint32_t u) { return __builtin_bit_cast(float, u); }
inline uint32_t float_to_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

#if MSIM_RACECHECK
// Only threadgroup memory and writable buffers are worth a call into the
// runtime; everything else (fiber stacks, inputs) is dropped here.
MSIM_NO_RACECHECK inline void race_hook(const void* p, uint32_t n, int w, const void* pc) {
  const msim_api* api = g_api;
  if (api == nullptr) return;
  const volatile msim_race_window* r = api->race;
  if (r == nullptr) return;
  uintptr_t a = (uintptr_t)p;
  if ((a < r->tg_lo || a >= r->tg_hi) && (a < r->dev_lo || a >= r->dev_hi)) return;
  api->access(p, n, w, pc);
}
#endif

// Round-to-nearest-even float -> bfloat16 (NaNs stay quiet NaNs), as MLX's
// bf16.h and Metal's native bfloat do.
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
}  // namespace msim

#if MSIM_RACECHECK
// The hooks g++'s thread-sanitizer instrumentation calls (no libtsan linked).
extern "C" {
#define MSIM_TSAN_HOOKS(n)                                                     \
  MSIM_NO_RACECHECK void __tsan_read##n(void* p) {                           \
    msim::race_hook(p, n, 0, __builtin_return_address(0));                   \
  }                                                                          \
  MSIM_NO_RACECHECK void __tsan_write##n(void* p) {                          \
    msim::race_hook(p, n, 1, __builtin_return_address(0));                   \
  }                                                                          \
  MSIM_NO_RACECHECK void __tsan_unaligned_read##n(void* p) {                 \
    msim::race_hook(p, n, 0, __builtin_return_address(0));                   \
  }                                                                          \
  MSIM_NO_RACECHECK void __tsan_unaligned_write##n(void* p) {                \
    msim::race_hook(p, n, 1, __builtin_return_address(0));                   \
  }                                                                          \
  MSIM_NO_RACECHECK void __tsan_volatile_read##n(void* p) {                  \
    msim::race_hook(p, n, 0, __builtin_return_address(0));                   \
  }                                                                          \
  MSIM_NO_RACECHECK void __tsan_volatile_write##n(void* p) {                 \
    msim::race_hook(p, n, 1, __builtin_return_address(0));                   \
  }
MSIM_TSAN_HOOKS(1)
MSIM_TSAN_HOOKS(2)
MSIM_TSAN_HOOKS(4)
MSIM_TSAN_HOOKS(8)
MSIM_TSAN_HOOKS(16)
#undef MSIM_TSAN_HOOKS
MSIM_NO_RACECHECK void __tsan_read_range(void* p, unsigned long n) {
  msim::race_hook(p, (uint32_t)n, 0, __builtin_return_address(0));
}
MSIM_NO_RACECHECK void __tsan_write_range(void* p, unsigned long n) {
  msim::race_hook(p, (uint32_t)n, 1, __builtin_return_address(0));
}
MSIM_NO_RACECHECK void __tsan_init(void) {}
MSIM_NO_RACECHECK void __tsan_func_entry(void*) {}
MSIM_NO_RACECHECK void __tsan_func_exit(void) {}
MSIM_NO_RACECHECK void __tsan_vptr_update(void**, void*) {}
MSIM_NO_RACECHECK void __tsan_vptr_read(void**) {}
}
#endif

// ------------------------------------------------------------- bfloat16 ----

struct bfloat16_t {
  uint16_t bits_;
  bfloat16_t() = default;
  bfloat16_t(float f) : bits_(msim::float_to_bf16_bits(f)) {}
  bfloat16_t(double f) : bits_(msim::float_to_bf16_bits((float)f)) {}
  bfloat16_t(half h) : bits_(msim::float_to_bf16_bits((float)h)) {}
  template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  bfloat16_t(T v) : bits_(msim::float_to_bf16_bits((float)v)) {}
  operator float() const { return msim::bits_to_float((uint32_t)bits_ << 16); }
  static bfloat16_t from_bits(uint16_t b) {
    bfloat16_t r;
    r.bits_ = b;
    return r;
  }
  template <class U>
  bfloat16_t& operator+=(const U& o) { return *this = bfloat16_t((float)*this + (float)o); }
  template <class U>
  bfloat16_t& operator-=(const U& o) { return *this = bfloat16_t((float)*this - (float)o); }
  template <class U>
  bfloat16_t& operator*=(const U& o) { return *this = bfloat16_t((float)*this * (float)o); }
  template <class U>
  bfloat16_t& operator/=(const U& o) { return *this = bfloat16_t((float)*this / (float)o); }
  bfloat16_t& operator++() { return *this += 1.0f; }
  bfloat16_t& operator--() { return *this -= 1.0f; }
  bfloat16_t operator++(int) { bfloat16_t r = *this; *this += 1.0f; return r; }
  bfloat16_t operator--(int) { bfloat16_t r = *this; *this -= 1.0f; return r; }
};
typedef bfloat16_t bfloat;

inline bfloat16_t operator-(bfloat16_t a) { return bfloat16_t::from_bits(a.bits_ ^ 0x8000u); }
inline bfloat16_t operator+(bfloat16_t a) { return a; }

namespace msim {
template <class T>
inline constexpr bool is_float_like_v =
    std::is_floating_point_v<T> || std::is_same_v<T, half>;
template <class T>
inline constexpr bool is_scalar_v = std::is_arithmetic_v<T> ||
                                    std::is_same_v<T, half> ||
                                    std::is_same_v<T, bfloat16_t>;
}  // namespace msim

// bfloat16 arithmetic follows MLX's bf16.h: bf (op) bf -> bf, bf (op) int ->
// bf, bf (op) float/half -> float; comparisons in float.
#define MSIM_BF_BINOP(op)                                                    \
  inline bfloat16_t operator op(bfloat16_t a, bfloat16_t b) {               \
    return bfloat16_t((float)a op(float) b);                                \
  }                                                                         \
  template <class T, std::enable_if_t<msim::is_float_like_v<T>, int> = 0>   \
  inline float operator op(bfloat16_t a, T b) { return (float)a op(float) b; } \
  template <class T, std::enable_if_t<msim::is_float_like_v<T>, int> = 0>   \
  inline float operator op(T a, bfloat16_t b) { return (float)a op(float) b; } \
  template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>      \
  inline bfloat16_t operator op(bfloat16_t a, T b) {                        \
    return bfloat16_t((float)a op(float) b);                                \
  }                                                                         \
  template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>      \
  inline bfloat16_t operator op(T a, bfloat16_t b) {                        \
    return bfloat16_t((float)a op(float) b);                                \
  }
MSIM_BF_BINOP(+)
MSIM_BF_BINOP(-)
MSIM_BF_BINOP(*)
MSIM_BF_BINOP(/)
#undef MSIM_BF_BINOP

#define MSIM_BF_CMP(op)                                                     \
  inline bool operator op(bfloat16_t a, bfloat16_t b) {                     \
    return (float)a op(float) b;                                            \
  }                                                                         \
  template <class T, std::enable_if_t<std::is_arithmetic_v<T> ||           \
                                          std::is_same_v<T, half>,          \
                                      int> = 0>                             \
  inline bool operator op(bfloat16_t a, T b) { return (float)a op(float) b; } \
  template <class T, std::enable_if_t<std::is_arithmetic_v<T> ||           \
                                          std::is_same_v<T, half>,          \
                                      int> = 0>                             \
  inline bool operator op(T a, bfloat16_t b) { return (float)a op(float) b; }
MSIM_BF_CMP(==)
MSIM_BF_CMP(!=)
MSIM_BF_CMP(<)
MSIM_BF_CMP(<=)
MSIM_BF_CMP(>)
MSIM_BF_CMP(>=)
#undef MSIM_BF_CMP

// ---------------------------------------------------------------- vectors --

namespace metal {

template <class T, int N>
struct vec;

// A swizzle such as v.xy / v.zyx: a view of the parent vector's storage.
template <class T, int N, int... I>
struct swz {
  T d_[N == 3 ? 4 : N];
  using vec_type = vec<T, (int)sizeof...(I)>;
  operator vec_type() const { return vec_type(d_[I]...); }
  vec_type get() const { return vec_type(d_[I]...); }
  T operator[](int i) const { return get()[i]; }
  swz& operator=(const vec_type& o) {
    int k = 0;
    ((d_[I] = o[k++]), ...);
    return *this;
  }
  swz& operator=(const swz& o) { return *this = o.get(); }
  template <class U>
  swz& operator=(const U& o) { return *this = vec_type(o); }
  template <class U>
  swz& operator+=(const U& o) { return *this = vec_type(get() + o); }
  template <class U>
  swz& operator-=(const U& o) { return *this = vec_type(get() - o); }
  template <class U>
  swz& operator*=(const U& o) { return *this = vec_type(get() * o); }
  template <class U>
  swz& operator/=(const U& o) { return *this = vec_type(get() / o); }
};

template <class T>
struct vtraits {
  static constexpr int n = 0;
  using elem = T;
};
template <class T, int N>
struct vtraits<vec<T, N>> {
  static constexpr int n = N;
  using elem = T;
};
template <class T, int N, int... I>
struct vtraits<swz<T, N, I...>> {
  static constexpr int n = (int)sizeof...(I);
  using elem = T;
};
template <class A>
inline constexpr int vsize_v = vtraits<std::remove_cv_t<std::remove_reference_t<A>>>::n;
template <class A>
using velem_t = typename vtraits<std::remove_cv_t<std::remove_reference_t<A>>>::elem;

template <class A>
inline auto vget(const A& a, int i) {
  if constexpr (vsize_v<A> == 0) {
    return a;
  } else {
    return a[i];
  }
}

template <class... A>
inline constexpr int vcount_v = ((vsize_v<A> == 0 ? 1 : vsize_v<A>) + ... + 0);

#define MSIM_VEC_BODY(N)                                                      \
  using value_type = T;                                                       \
  vec() = default;                                                            \
  vec(const vec& o) {                                                         \
    for (int i = 0; i < N; ++i) d[i] = o.d[i];                                \
  }                                                                           \
  vec& operator=(const vec& o) {                                              \
    for (int i = 0; i < N; ++i) d[i] = o.d[i];                                \
    return *this;                                                             \
  }                                                                           \
  template <class S, std::enable_if_t<msim::is_scalar_v<S>, int> = 0>         \
  vec(S s) {                                                                  \
    for (int i = 0; i < N; ++i) d[i] = T(s);                                  \
  }                                                                           \
  template <class A0, class A1, class... A,                                   \
            std::enable_if_t<vcount_v<A0, A1, A...> == N, int> = 0>           \
  vec(const A0& a0, const A1& a1, const A&... a) {                            \
    int k = 0;                                                                \
    put(k, a0);                                                               \
    put(k, a1);                                                               \
    (put(k, a), ...);                                                         \
  }                                                                           \
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>       \
  explicit vec(const vec<U, N>& o) {                                          \
    for (int i = 0; i < N; ++i) d[i] = static_cast<T>(o[i]);                  \
  }                                                                           \
  template <class U, int M, int... I,                                         \
            std::enable_if_t<sizeof...(I) == N, int> = 0>                     \
  vec(const swz<U, M, I...>& s) : vec(s.get()) {}                             \
  T& operator[](int i) { return d[i]; }                                       \
  const T& operator[](int i) const { return d[i]; }                           \
  template <class U>                                                          \
  vec& operator+=(const U& o) {                                               \
    for (int i = 0; i < N; ++i) d[i] = T(d[i] + vget(o, i));                  \
    return *this;                                                             \
  }                                                                           \
  template <class U>                                                          \
  vec& operator-=(const U& o) {                                               \
    for (int i = 0; i < N; ++i) d[i] = T(d[i] - vget(o, i));                  \
    return *this;                                                             \
  }                                                                           \
  template <class U>                                                          \
  vec& operator*=(const U& o) {                                               \
    for (int i = 0; i < N; ++i) d[i] = T(d[i] * vget(o, i));                  \
    return *this;                                                             \
  }                                                                           \
  template <class U>                                                          \
  vec& operator/=(const U& o) {                                               \
    for (int i = 0; i < N; ++i) d[i] = T(d[i] / vget(o, i));                  \
    return *this;                                                             \
  }                                                                           \
  template <class U>                                                          \
  vec& operator%=(const U& o) {                                               \
    for (int i = 0; i < N; ++i) d[i] = T(d[i] % vget(o, i));                  \
    return *this;                                                             \
  }                                                                           \
  template <class U>                                                          \
  vec& operator&=(const U& o) {                                               \
    for (int i = 0; i < N; ++i) d[i] = T(d[i] & vget(o, i));                  \
    return *this;                                                             \
  }                                                                           \
  template <class U>                                                          \
  vec& operator|=(const U& o) {                                               \
    for (int i = 0; i < N; ++i) d[i] = T(d[i] | vget(o, i));                  \
    return *this;                                                             \
  }                                                                           \
  template <class U>                                                          \
  vec& operator^=(const U& o) {                                               \
    for (int i = 0; i < N; ++i) d[i] = T(d[i] ^ vget(o, i));                  \
    return *this;                                                             \
  }                                                                           \
  template <class U>                                                          \
  vec& operator<<=(const U& o) {                                              \
    for (int i = 0; i < N; ++i) d[i] = T(d[i] << vget(o, i));                 \
    return *this;                                                             \
  }                                                                           \
  template <class U>                                                          \
  vec& operator>>=(const U& o) {                                              \
    for (int i = 0; i < N; ++i) d[i] = T(d[i] >> vget(o, i));                 \
    return *this;                                                             \
  }                                                                           \
                                                                              \
 private:                                                                     \
  template <class A>                                                          \
  void put(int& k, const A& a) {                                              \
    if constexpr (vsize_v<A> == 0) {                                          \
      d[k++] = T(a);                                                          \
    } else {                                                                  \
      for (int i = 0; i < vsize_v<A>; ++i) d[k++] = T(a[i]);                  \
    }                                                                         \
  }                                                                           \
                                                                              \
 public:

#define MSIM_SWIZZLES_2(T) \
  swz<T, 2, 0, 0> xx; \
  swz<T, 2, 0, 1> xy; \
  swz<T, 2, 1, 0> yx; \
  swz<T, 2, 1, 1> yy; \
  swz<T, 2, 0, 0, 0> xxx; \
  swz<T, 2, 1, 1, 1> yyy; \
  swz<T, 2, 0, 1> rg; \
  swz<T, 2, 1, 0> gr;

#define MSIM_SWIZZLES_3(T) \
  swz<T, 3, 0, 0> xx; \
  swz<T, 3, 0, 1> xy; \
  swz<T, 3, 0, 2> xz; \
  swz<T, 3, 1, 0> yx; \
  swz<T, 3, 1, 1> yy; \
  swz<T, 3, 1, 2> yz; \
  swz<T, 3, 2, 0> zx; \
  swz<T, 3, 2, 1> zy; \
  swz<T, 3, 2, 2> zz; \
  swz<T, 3, 0, 1, 2> xyz; \
  swz<T, 3, 0, 2, 1> xzy; \
  swz<T, 3, 1, 0, 2> yxz; \
  swz<T, 3, 1, 2, 0> yzx; \
  swz<T, 3, 2, 0, 1> zxy; \
  swz<T, 3, 2, 1, 0> zyx; \
  swz<T, 3, 0, 0, 0> xxx; \
  swz<T, 3, 1, 1, 1> yyy; \
  swz<T, 3, 2, 2, 2> zzz; \
  swz<T, 3, 0, 1> rg; \
  swz<T, 3, 0, 1, 2> rgb; \
  swz<T, 3, 2, 1, 0> bgr;

#define MSIM_SWIZZLES_4(T) \
  swz<T, 4, 0, 0> xx; \
  swz<T, 4, 0, 1> xy; \
  swz<T, 4, 0, 2> xz; \
  swz<T, 4, 0, 3> xw; \
  swz<T, 4, 1, 0> yx; \
  swz<T, 4, 1, 1> yy; \
  swz<T, 4, 1, 2> yz; \
  swz<T, 4, 1, 3> yw; \
  swz<T, 4, 2, 0> zx; \
  swz<T, 4, 2, 1> zy; \
  swz<T, 4, 2, 2> zz; \
  swz<T, 4, 2, 3> zw; \
  swz<T, 4, 3, 0> wx; \
  swz<T, 4, 3, 1> wy; \
  swz<T, 4, 3, 2> wz; \
  swz<T, 4, 3, 3> ww; \
  swz<T, 4, 0, 1, 2> xyz; \
  swz<T, 4, 0, 1, 3> xyw; \
  swz<T, 4, 0, 2, 1> xzy; \
  swz<T, 4, 0, 2, 3> xzw; \
  swz<T, 4, 0, 3, 1> xwy; \
  swz<T, 4, 0, 3, 2> xwz; \
  swz<T, 4, 1, 0, 2> yxz; \
  swz<T, 4, 1, 0, 3> yxw; \
  swz<T, 4, 1, 2, 0> yzx; \
  swz<T, 4, 1, 2, 3> yzw; \
  swz<T, 4, 1, 3, 0> ywx; \
  swz<T, 4, 1, 3, 2> ywz; \
  swz<T, 4, 2, 0, 1> zxy; \
  swz<T, 4, 2, 0, 3> zxw; \
  swz<T, 4, 2, 1, 0> zyx; \
  swz<T, 4, 2, 1, 3> zyw; \
  swz<T, 4, 2, 3, 0> zwx; \
  swz<T, 4, 2, 3, 1> zwy; \
  swz<T, 4, 3, 0, 1> wxy; \
  swz<T, 4, 3, 0, 2> wxz; \
  swz<T, 4, 3, 1, 0> wyx; \
  swz<T, 4, 3, 1, 2> wyz; \
  swz<T, 4, 3, 2, 0> wzx; \
  swz<T, 4, 3, 2, 1> wzy; \
  swz<T, 4, 0, 0, 0> xxx; \
  swz<T, 4, 1, 1, 1> yyy; \
  swz<T, 4, 2, 2, 2> zzz; \
  swz<T, 4, 3, 3, 3> www; \
  swz<T, 4, 0, 1, 2, 3> xyzw; \
  swz<T, 4, 0, 1, 3, 2> xywz; \
  swz<T, 4, 0, 2, 1, 3> xzyw; \
  swz<T, 4, 0, 2, 3, 1> xzwy; \
  swz<T, 4, 0, 3, 1, 2> xwyz; \
  swz<T, 4, 0, 3, 2, 1> xwzy; \
  swz<T, 4, 1, 0, 2, 3> yxzw; \
  swz<T, 4, 1, 0, 3, 2> yxwz; \
  swz<T, 4, 1, 2, 0, 3> yzxw; \
  swz<T, 4, 1, 2, 3, 0> yzwx; \
  swz<T, 4, 1, 3, 0, 2> ywxz; \
  swz<T, 4, 1, 3, 2, 0> ywzx; \
  swz<T, 4, 2, 0, 1, 3> zxyw; \
  swz<T, 4, 2, 0, 3, 1> zxwy; \
  swz<T, 4, 2, 1, 0, 3> zyxw; \
  swz<T, 4, 2, 1, 3, 0> zywx; \
  swz<T, 4, 2, 3, 0, 1> zwxy; \
  swz<T, 4, 2, 3, 1, 0> zwyx; \
  swz<T, 4, 3, 0, 1, 2> wxyz; \
  swz<T, 4, 3, 0, 2, 1> wxzy; \
  swz<T, 4, 3, 1, 0, 2> wyxz; \
  swz<T, 4, 3, 1, 2, 0> wyzx; \
  swz<T, 4, 3, 2, 0, 1> wzxy; \
  swz<T, 4, 3, 2, 1, 0> wzyx; \
  swz<T, 4, 0, 0, 0, 0> xxxx; \
  swz<T, 4, 1, 1, 1, 1> yyyy; \
  swz<T, 4, 2, 2, 2, 2> zzzz; \
  swz<T, 4, 3, 3, 3, 3> wwww; \
  swz<T, 4, 0, 1, 0, 1> xyxy; \
  swz<T, 4, 2, 3, 2, 3> zwzw; \
  swz<T, 4, 0, 0, 1, 1> xxyy; \
  swz<T, 4, 2, 2, 3, 3> zzww; \
  swz<T, 4, 0, 1> rg; \
  swz<T, 4, 0, 1, 2> rgb; \
  swz<T, 4, 0, 1, 2, 3> rgba; \
  swz<T, 4, 2, 1, 0, 3> bgra; \
  swz<T, 4, 2, 1, 0> bgr; \
  swz<T, 4, 1, 2> gb; \
  swz<T, 4, 2, 3> ba; \
  swz<T, 4, 3, 0, 1, 2> argb;


template <class T>
struct alignas(2 * sizeof(T)) vec<T, 2> {
  union {
    T d[2];
    struct {
      T x, y;
    };
    struct {
      T r, g;
    };
    MSIM_SWIZZLES_2(T)
  };
  MSIM_VEC_BODY(2)
};

template <class T>
struct alignas(4 * sizeof(T)) vec<T, 3> {
  union {
    T d[4];
    struct {
      T x, y, z;
    };
    struct {
      T r, g, b;
    };
    MSIM_SWIZZLES_3(T)
  };
  MSIM_VEC_BODY(3)
};

template <class T>
struct alignas(4 * sizeof(T)) vec<T, 4> {
  union {
    T d[4];
    struct {
      T x, y, z, w;
    };
    struct {
      T r, g, b, a;
    };
    MSIM_SWIZZLES_4(T)
  };
  MSIM_VEC_BODY(4)
};

// Element-wise operators on vectors, swizzles and scalars. A scalar operand
// is converted to the vector's element type, as in Metal.
template <class A, class B>
inline constexpr bool vec_binop_ok_v =
    (vsize_v<A> > 0 || vsize_v<B> > 0) &&
    (vsize_v<A> > 0 || msim::is_scalar_v<std::remove_cv_t<std::remove_reference_t<A>>>) &&
    (vsize_v<B> > 0 || msim::is_scalar_v<std::remove_cv_t<std::remove_reference_t<B>>>) &&
    (vsize_v<A> == 0 || vsize_v<B> == 0 || vsize_v<A> == vsize_v<B>);

template <class A, class B>
struct vec_binop {
  static constexpr int n = vsize_v<A> > vsize_v<B> ? vsize_v<A> : vsize_v<B>;
  using elem = std::conditional_t<
      vsize_v<A> == 0, velem_t<B>,
      std::conditional_t<vsize_v<B> == 0, velem_t<A>,
                         decltype(true ? velem_t<A>() : velem_t<B>())>>;
};

#define MSIM_VEC_ARITH(op)                                                   \
  template <class A, class B,                                                \
            std::enable_if_t<vec_binop_ok_v<A, B>, int> = 0>                 \
  inline auto operator op(const A& a, const B& b) {                          \
    using E = typename vec_binop<A, B>::elem;                                \
    constexpr int N = vec_binop<A, B>::n;                                    \
    vec<E, N> r;                                                             \
    for (int i = 0; i < N; ++i) r[i] = E(E(vget(a, i)) op E(vget(b, i)));    \
    return r;                                                                \
  }
MSIM_VEC_ARITH(+)
MSIM_VEC_ARITH(-)
MSIM_VEC_ARITH(*)
MSIM_VEC_ARITH(/)
MSIM_VEC_ARITH(%)
MSIM_VEC_ARITH(&)
MSIM_VEC_ARITH(|)
MSIM_VEC_ARITH(^)
MSIM_VEC_ARITH(<<)
MSIM_VEC_ARITH(>>)
#undef MSIM_VEC_ARITH

#define MSIM_VEC_CMP(op)                                                     \
  template <class A, class B,                                                \
            std::enable_if_t<vec_binop_ok_v<A, B>, int> = 0>                 \
  inline auto operator op(const A& a, const B& b) {                          \
    using E = typename vec_binop<A, B>::elem;                                \
    constexpr int N = vec_binop<A, B>::n;                                    \
    vec<bool, N> r;                                                          \
    for (int i = 0; i < N; ++i) r[i] = E(vget(a, i)) op E(vget(b, i));      \
    return r;                                                                \
  }
MSIM_VEC_CMP(==)
MSIM_VEC_CMP(!=)
MSIM_VEC_CMP(<)
MSIM_VEC_CMP(<=)
MSIM_VEC_CMP(>)
MSIM_VEC_CMP(>=)
MSIM_VEC_CMP(&&)
MSIM_VEC_CMP(||)
#undef MSIM_VEC_CMP

template <class T, int N>
inline vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> operator+(const vec<T, N>& a) { return a; }
template <class T, int N>
inline vec<T, N> operator~(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = T(~a[i]);
  return r;
}
template <class T, int N>
inline vec<bool, N> operator!(const vec<T, N>& a) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = !a[i];
  return r;
}
template <class T, int N, int... I>
inline auto operator-(const swz<T, N, I...>& a) { return -a.get(); }

template <class T, int N>
inline bool all(const vec<T, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <class T, int N>
inline bool any(const vec<T, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }

}  // namespace metal

#define MSIM_VEC_ALIASES(T, name)        \
  typedef metal::vec<T, 2> name##2;      \
  typedef metal::vec<T, 3> name##3;      \
  typedef metal::vec<T, 4> name##4;      \
  typedef metal::vec<T, 2> packed_##name##2; \
  typedef metal::vec<T, 4> packed_##name##4;
MSIM_VEC_ALIASES(float, float)
MSIM_VEC_ALIASES(half, half)
MSIM_VEC_ALIASES(bfloat16_t, bfloat)
MSIM_VEC_ALIASES(int, int)
MSIM_VEC_ALIASES(uint, uint)
MSIM_VEC_ALIASES(short, short)
MSIM_VEC_ALIASES(ushort, ushort)
MSIM_VEC_ALIASES(char, char)
MSIM_VEC_ALIASES(uchar, uchar)
MSIM_VEC_ALIASES(bool, bool)
MSIM_VEC_ALIASES(long, long)
MSIM_VEC_ALIASES(ulong, ulong)
#undef MSIM_VEC_ALIASES

// Metal's packed_float3 has no padding (12 bytes).
struct packed_float3 {
  float x, y, z;
  packed_float3() = default;
  packed_float3(float a, float b, float c) : x(a), y(b), z(c) {}
  packed_float3(const float3& v) : x(v.x), y(v.y), z(v.z) {}
  operator float3() const { return float3(x, y, z); }
  float& operator[](int i) { return (&x)[i]; }
  const float& operator[](int i) const { return (&x)[i]; }
};

// ------------------------------------------------------------------- math --

#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif
#ifndef NAN
#define NAN (__builtin_nanf(""))
#endif
#ifndef HUGE_VALF
#define HUGE_VALF (__builtin_huge_valf())
#endif
#ifndef MAXFLOAT
#define MAXFLOAT __FLT_MAX__
#endif
#ifndef FLT_MAX
#define FLT_MAX __FLT_MAX__
#endif
#ifndef FLT_MIN
#define FLT_MIN __FLT_MIN__
#endif
#ifndef FLT_EPSILON
#define FLT_EPSILON __FLT_EPSILON__
#endif
#ifndef HALF_MAX
#define HALF_MAX ((half)65504.0f)
#endif
#define M_E_F 2.71828182845904523536028747135266250f
#define M_LOG2E_F 1.44269504088896340735992468100189214f
#define M_LOG10E_F 0.434294481903251827651128918916605082f
#define M_LN2_F 0.693147180559945309417232121458176568f
#define M_LN10_F 2.30258509299404568401799145468436421f
#define M_PI_F 3.14159265358979323846264338327950288f
#define M_PI_2_F 1.57079632679489661923132169163975144f
#define M_PI_4_F 0.785398163397448309615660845819875721f
#define M_1_PI_F 0.318309886183790671537767526745028724f
#define M_2_PI_F 0.636619772367581343075535053490057448f
#define M_2_SQRTPI_F 1.12837916709551257389615890312154517f
#define M_SQRT2_F 1.41421356237309504880168872420969808f
#define M_SQRT1_2_F 0.707106781186547524400844362104849039f

namespace metal {

using std::conditional;
using std::conditional_t;
using std::enable_if;
using std::enable_if_t;
using std::is_integral;
using std::is_integral_v;
using std::is_same;
using std::is_same_v;
using std::is_signed;
using std::is_signed_v;
using std::is_unsigned;
using std::is_unsigned_v;
using std::remove_cv_t;
template <class T>
struct is_floating_point
    : std::bool_constant<std::is_floating_point_v<T> || std::is_same_v<T, half> ||
                         std::is_same_v<T, bfloat16_t>> {};
template <class T>
inline constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T>
struct is_arithmetic : std::bool_constant<msim::is_scalar_v<T>> {};
template <class T>
inline constexpr bool is_arithmetic_v = is_arithmetic<T>::value;

template <class T>
struct numeric_limits;
#define MSIM_INT_LIMITS(T, lo, hi)                          \
  template <>                                               \
  struct numeric_limits<T> {                                \
    static constexpr bool is_specialized = true;            \
    static constexpr T min() { return lo; }                 \
    static constexpr T max() { return hi; }                 \
    static constexpr T lowest() { return lo; }              \
  };
MSIM_INT_LIMITS(bool, false, true)
MSIM_INT_LIMITS(char, (char)(-__SCHAR_MAX__ - 1), __SCHAR_MAX__)
MSIM_INT_LIMITS(signed char, (signed char)(-__SCHAR_MAX__ - 1), __SCHAR_MAX__)
MSIM_INT_LIMITS(unsigned char, 0, (unsigned char)(2 * __SCHAR_MAX__ + 1))
MSIM_INT_LIMITS(short, (short)(-__SHRT_MAX__ - 1), __SHRT_MAX__)
MSIM_INT_LIMITS(unsigned short, 0, (unsigned short)(2 * __SHRT_MAX__ + 1))
MSIM_INT_LIMITS(int, -__INT_MAX__ - 1, __INT_MAX__)
MSIM_INT_LIMITS(unsigned int, 0u, 2u * __INT_MAX__ + 1u)
MSIM_INT_LIMITS(long, -__LONG_MAX__ - 1, __LONG_MAX__)
MSIM_INT_LIMITS(unsigned long, 0ul, 2ul * __LONG_MAX__ + 1ul)
MSIM_INT_LIMITS(long long, -__LONG_LONG_MAX__ - 1, __LONG_LONG_MAX__)
MSIM_INT_LIMITS(unsigned long long, 0ull, 2ull * __LONG_LONG_MAX__ + 1ull)
#undef MSIM_INT_LIMITS
template <>
struct numeric_limits<float> {
  static constexpr bool is_specialized = true;
  static constexpr float min() { return __FLT_MIN__; }
  static constexpr float max() { return __FLT_MAX__; }
  static constexpr float lowest() { return -__FLT_MAX__; }
  static constexpr float epsilon() { return __FLT_EPSILON__; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float denorm_min() { return __FLT_DENORM_MIN__; }
};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr half min() { return (half)6.103515625e-05f; }
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half epsilon() { return (half)0.0009765625f; }
  static constexpr half infinity() { return (half)__builtin_inff(); }
  static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
};
template <>
struct numeric_limits<bfloat16_t> {
  static constexpr bool is_specialized = true;
  static bfloat16_t min() { return bfloat16_t::from_bits(0x0080); }
  static bfloat16_t max() { return bfloat16_t::from_bits(0x7F7F); }
  static bfloat16_t lowest() { return bfloat16_t::from_bits(0xFF7F); }
  static bfloat16_t epsilon() { return bfloat16_t::from_bits(0x3C00); }
  static bfloat16_t infinity() { return bfloat16_t::from_bits(0x7F80); }
  static bfloat16_t quiet_NaN() { return bfloat16_t::from_bits(0x7FC0); }
};

template <class To, class From>
inline To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To t;
  __builtin_memcpy((void*)&t, (const void*)&f, sizeof(To));
  return t;
}

// One-argument float functions: float, half (computed in float, rounded
// once), bfloat16, double (computed in float: Metal has no double), integers
// (as float) and vectors (element-wise).
#define MSIM_MATH1(name, expr)                                               \
  inline float name(float x) { return expr; }                                \
  inline float name(double x) { return name((float)x); }                     \
  inline half name(half x) { return (half)name((float)x); }                  \
  inline bfloat16_t name(bfloat16_t x) { return bfloat16_t(name((float)x)); } \
  template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>       \
  inline float name(T x) { return name((float)x); }                          \
  template <class T, int N>                                                  \
  inline vec<T, N> name(const vec<T, N>& v) {                                \
    vec<T, N> r;                                                             \
    for (int i = 0; i < N; ++i) r[i] = T(name(v[i]));                        \
    return r;                                                                \
  }

MSIM_MATH1(exp, __builtin_expf(x))
MSIM_MATH1(exp2, __builtin_exp2f(x))
MSIM_MATH1(exp10, __builtin_powf(10.0f, x))
MSIM_MATH1(expm1, __builtin_expm1f(x))
MSIM_MATH1(log, __builtin_logf(x))
MSIM_MATH1(log2, __builtin_log2f(x))
MSIM_MATH1(log10, __builtin_log10f(x))
MSIM_MATH1(log1p, __builtin_log1pf(x))
MSIM_MATH1(sqrt, __builtin_sqrtf(x))
MSIM_MATH1(rsqrt, 1.0f / __builtin_sqrtf(x))
MSIM_MATH1(cbrt, __builtin_cbrtf(x))
MSIM_MATH1(sin, __builtin_sinf(x))
MSIM_MATH1(cos, __builtin_cosf(x))
MSIM_MATH1(tan, __builtin_tanf(x))
MSIM_MATH1(asin, __builtin_asinf(x))
MSIM_MATH1(acos, __builtin_acosf(x))
MSIM_MATH1(atan, __builtin_atanf(x))
MSIM_MATH1(sinh, __builtin_sinhf(x))
MSIM_MATH1(cosh, __builtin_coshf(x))
MSIM_MATH1(tanh, __builtin_tanhf(x))
MSIM_MATH1(asinh, __builtin_asinhf(x))
MSIM_MATH1(acosh, __builtin_acoshf(x))
MSIM_MATH1(atanh, __builtin_atanhf(x))
MSIM_MATH1(erf, __builtin_erff(x))
MSIM_MATH1(erfc, __builtin_erfcf(x))
MSIM_MATH1(floor, __builtin_floorf(x))
MSIM_MATH1(ceil, __builtin_ceilf(x))
MSIM_MATH1(round, __builtin_roundf(x))
MSIM_MATH1(rint, __builtin_rintf(x))
MSIM_MATH1(trunc, __builtin_truncf(x))
MSIM_MATH1(fract, x - __builtin_floorf(x) < 0x1.fffffep-1f ? x - __builtin_floorf(x) : 0x1.fffffep-1f)
MSIM_MATH1(fabs, __builtin_fabsf(x))
MSIM_MATH1(saturate, x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x))
MSIM_MATH1(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x != x ? 0.0f : x)))
MSIM_MATH1(sinpi, __builtin_sinf(x * M_PI_F))
MSIM_MATH1(cospi, __builtin_cosf(x * M_PI_F))
MSIM_MATH1(tanpi, __builtin_tanf(x * M_PI_F))
#undef MSIM_MATH1

// Two-argument float functions.
#define MSIM_MATH2(name, expr)                                               \
  inline float name(float x, float y) { return expr; }                       \
  inline half name(half x, half y) { return (half)name((float)x, (float)y); } \
  inline bfloat16_t name(bfloat16_t x, bfloat16_t y) {                       \
    return bfloat16_t(name((float)x, (float)y));                             \
  }                                                                          \
  template <class A, class B,                                                \
            std::enable_if_t<msim::is_scalar_v<A> && msim::is_scalar_v<B> && \
                                 !std::is_same_v<A, B>,                      \
                             int> = 0>                                       \
  inline float name(A x, B y) { return name((float)x, (float)y); }           \
  template <class T, int N, class U>                                         \
  inline vec<T, N> name(const vec<T, N>& a, const U& b) {                    \
    vec<T, N> r;                                                             \
    for (int i = 0; i < N; ++i) r[i] = T(name(a[i], T(vget(b, i))));         \
    return r;                                                                \
  }

MSIM_MATH2(pow, __builtin_powf(x, y))
MSIM_MATH2(powr, __builtin_powf(x, y))
MSIM_MATH2(atan2, __builtin_atan2f(x, y))
MSIM_MATH2(fmod, __builtin_fmodf(x, y))
MSIM_MATH2(copysign, __builtin_copysignf(x, y))
MSIM_MATH2(fdim, __builtin_fdimf(x, y))
MSIM_MATH2(fmax, __builtin_fmaxf(x, y))
MSIM_MATH2(fmin, __builtin_fminf(x, y))
MSIM_MATH2(step, y < x ? 0.0f : 1.0f)
MSIM_MATH2(divide, x / y)
MSIM_MATH2(nextafter, __builtin_nextafterf(x, y))
#undef MSIM_MATH2

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return (half)__builtin_fmaf(a, b, c); }
inline bfloat16_t fma(bfloat16_t a, bfloat16_t b, bfloat16_t c) {
  return bfloat16_t(__builtin_fmaf(a, b, c));
}
template <class T, int N>
inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
inline float mad(float a, float b, float c) { return a * b + c; }

// max/min/abs/clamp work on integers too (Metal's integer overloads).
template <class A, class B,
          std::enable_if_t<msim::is_scalar_v<A> && msim::is_scalar_v<B>, int> = 0>
inline auto max(A a, B b) {
  using T = std::conditional_t<std::is_same_v<A, B>, A, decltype(true ? a : b)>;
  T x = a, y = b;
  if constexpr (is_floating_point_v<T>) {
    if (x != x) return y;
    if (y != y) return x;
  }
  return x < y ? y : x;
}
template <class A, class B,
          std::enable_if_t<msim::is_scalar_v<A> && msim::is_scalar_v<B>, int> = 0>
inline auto min(A a, B b) {
  using T = std::conditional_t<std::is_same_v<A, B>, A, decltype(true ? a : b)>;
  T x = a, y = b;
  if constexpr (is_floating_point_v<T>) {
    if (x != x) return y;
    if (y != y) return x;
  }
  return y < x ? y : x;
}
template <class T, int N, class U>
inline vec<T, N> max(const vec<T, N>& a, const U& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(a[i], T(vget(b, i)));
  return r;
}
template <class T, int N, class U>
inline vec<T, N> min(const vec<T, N>& a, const U& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(a[i], T(vget(b, i)));
  return r;
}
template <class T>
inline T max3(T a, T b, T c) { return max(max(a, b), c); }
template <class T>
inline T min3(T a, T b, T c) { return min(min(a, b), c); }
template <class T>
inline T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }

template <class T, std::enable_if_t<msim::is_scalar_v<T>, int> = 0>
inline T abs(T x) {
  if constexpr (std::is_unsigned_v<T> || std::is_same_v<T, bool>) {
    return x;
  } else {
    return x < T(0) ? T(-x) : x;
  }
}
inline float abs(float x) { return __builtin_fabsf(x); }
template <class T, int N>
inline vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(v[i]);
  return r;
}
template <class T, class L, class H,
          std::enable_if_t<msim::is_scalar_v<T>, int> = 0>
inline T clamp(T x, L lo, H hi) { return min(max(x, T(lo)), T(hi)); }
template <class T, int N, class L, class H>
inline vec<T, N> clamp(const vec<T, N>& x, const L& lo, const H& hi) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = clamp(x[i], T(vget(lo, i)), T(vget(hi, i)));
  return r;
}
template <class T, class U>
inline T mix(T x, T y, U a) { return x + (y - x) * a; }
template <class T>
inline T smoothstep(T e0, T e1, T x) {
  T t = clamp((x - e0) / (e1 - e0), T(0), T(1));
  return t * t * (T(3) - T(2) * t);
}

template <class T, std::enable_if_t<msim::is_scalar_v<T>, int> = 0>
inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) { return c ? b : a; }

template <class T, std::enable_if_t<msim::is_scalar_v<T>, int> = 0>
inline bool isnan(T x) { return (float)x != (float)x; }
template <class T, std::enable_if_t<msim::is_scalar_v<T>, int> = 0>
inline bool isinf(T x) { return __builtin_isinf((float)x); }
template <class T, std::enable_if_t<msim::is_scalar_v<T>, int> = 0>
inline bool isfinite(T x) { return __builtin_isfinite((float)x); }
template <class T, std::enable_if_t<msim::is_scalar_v<T>, int> = 0>
inline bool signbit(T x) { return __builtin_signbit((float)x); }
inline bool isnan(double x) { return x != x; }
#define MSIM_VEC_PRED(name)                          \
  template <class T, int N>                          \
  inline vec<bool, N> name(const vec<T, N>& v) {     \
    vec<bool, N> r;                                  \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);   \
    return r;                                        \
  }
MSIM_VEC_PRED(isnan)
MSIM_VEC_PRED(isinf)
MSIM_VEC_PRED(isfinite)
MSIM_VEC_PRED(signbit)
#undef MSIM_VEC_PRED

inline float ldexp(float x, int e) { return __builtin_ldexpf(x, e); }

template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s += a[i] * b[i];
  return s;
}
template <class T, int N>
inline T length(const vec<T, N>& a) { return sqrt(dot(a, a)); }
template <class T, int N>
inline T length_squared(const vec<T, N>& a) { return dot(a, a); }
template <class T, int N>
inline vec<T, N> normalize(const vec<T, N>& a) { return a * rsqrt(dot(a, a)); }
template <class T>
inline vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}

// Integer bit functions.
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline T popcount(T x) {
  return (T)__builtin_popcountll((unsigned long long)(std::make_unsigned_t<T>)x);
}
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline T clz(T x) {
  using U = std::make_unsigned_t<T>;
  U u = (U)x;
  if (u == 0) return (T)(sizeof(T) * 8);
  return (T)(__builtin_clzll((unsigned long long)u) - (64 - sizeof(T) * 8));
}
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline T ctz(T x) {
  using U = std::make_unsigned_t<T>;
  U u = (U)x;
  if (u == 0) return (T)(sizeof(T) * 8);
  return (T)__builtin_ctzll((unsigned long long)u);
}
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline T rotate(T v, T i) {
  using U = std::make_unsigned_t<T>;
  constexpr unsigned bits = sizeof(T) * 8;
  unsigned s = (unsigned)((U)i % bits);
  U u = (U)v;
  return (T)(s ? (U)((u << s) | (u >> (bits - s))) : u);
}
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline T mulhi(T a, T b) {
  if constexpr (sizeof(T) == 8) {
    using W = std::conditional_t<std::is_signed_v<T>, __int128, unsigned __int128>;
    return (T)(((W)a * (W)b) >> 64);
  } else {
    using W = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
    return (T)(((W)a * (W)b) >> (sizeof(T) * 8));
  }
}

namespace precise {
using metal::abs, metal::acos, metal::acosh, metal::asin, metal::asinh,
    metal::atan, metal::atan2, metal::atanh, metal::cbrt, metal::ceil,
    metal::clamp, metal::copysign, metal::cos, metal::cosh, metal::cospi,
    metal::divide, metal::erf, metal::exp, metal::exp10, metal::exp2,
    metal::expm1, metal::fabs, metal::floor, metal::fma, metal::fmax,
    metal::fmin, metal::fmod, metal::fract, metal::log, metal::log10,
    metal::log1p, metal::log2, metal::max, metal::min, metal::pow,
    metal::powr, metal::rint, metal::round, metal::rsqrt, metal::saturate,
    metal::sign, metal::sin, metal::sinh, metal::sinpi, metal::sqrt,
    metal::tan, metal::tanh, metal::tanpi, metal::trunc;
}
namespace fast {
using namespace metal::precise;
}

}  // namespace metal

// ------------------------------------------------------- device pointers ---

namespace msim {

// Bounds-checked `device T*` / `constant T*`: keeps the argument's valid byte
// range and checks every dereference. Pointer arithmetic is free to leave the
// range (as on the GPU); only loads and stores are checked.
template <class T>
struct dptr {
  using element_type = T;
  char* base = nullptr;
  int64_t cur = 0;
  int64_t lo = 0;
  int64_t hi = 0;
  const char* name = "pointer";

  dptr() = default;
  dptr(std::nullptr_t) {}
  explicit dptr(const msim_buffer& b)
      : base((char*)b.ptr), cur(0), lo(b.lo), hi(b.hi), name(b.name) {}
  // From a raw pointer (e.g. &buf[i] cast back): bounds unknown.
  explicit dptr(T* p)
      : base((char*)p), cur(0), lo(INT64_MIN / 4), hi(INT64_MAX / 4),
        name("<raw pointer>") {}
  template <class U, std::enable_if_t<std::is_same_v<const U, T> &&
                                          !std::is_same_v<U, T>,
                                      int> = 0>
  dptr(const dptr<U>& o) : base(o.base), cur(o.cur), lo(o.lo), hi(o.hi), name(o.name) {}
  // Reinterpreting cast between element types: same bytes, same bounds.
  template <class U, std::enable_if_t<!std::is_same_v<std::remove_cv_t<U>,
                                                      std::remove_cv_t<T>>,
                                      int> = 0>
  explicit dptr(const dptr<U>& o)
      : base(o.base), cur(o.cur), lo(o.lo), hi(o.hi), name(o.name) {}

  T* raw() const { return (T*)(base + cur); }
  T& at(int64_t i) const {
    constexpr int64_t sz = sizeof_elem();
    int64_t b = cur + i * sz;
    if (b < lo || b + sz > hi) {
      int64_t idx = b >= 0 ? b / sz : -((-b + sz - 1) / sz);
      int64_t elo = lo >= 0 ? (lo + sz - 1) / sz : -((-lo) / sz);
      g_api->oob(name, idx, elo, hi / sz);
      __builtin_unreachable();
    }
    return *(T*)(base + b);
  }
  static constexpr int64_t sizeof_elem() {
    if constexpr (std::is_void_v<T>) {
      return 1;
    } else {
      return (int64_t)sizeof(T);
    }
  }
  template <class I, std::enable_if_t<std::is_integral_v<I> || std::is_enum_v<I>, int> = 0>
  T& operator[](I i) const { return at((int64_t)i); }
  T& operator*() const { return at(0); }
  T* operator->() const { return &at(0); }
  operator T*() const { return raw(); }

  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr operator+(I i) const {
    dptr r = *this;
    r.cur += (int64_t)i * sizeof_elem();
    return r;
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  friend dptr operator+(I i, const dptr& p) { return p + i; }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr operator-(I i) const {
    dptr r = *this;
    r.cur -= (int64_t)i * sizeof_elem();
    return r;
  }
  ptrdiff_t operator-(const dptr& o) const {
    return (ptrdiff_t)(((base + cur) - (o.base + o.cur)) / sizeof_elem());
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr& operator+=(I i) {
    cur += (int64_t)i * sizeof_elem();
    return *this;
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr& operator-=(I i) {
    cur -= (int64_t)i * sizeof_elem();
    return *this;
  }
  dptr& operator++() { cur += sizeof_elem(); return *this; }
  dptr& operator--() { cur -= sizeof_elem(); return *this; }
  dptr operator++(int) { dptr r = *this; cur += sizeof_elem(); return r; }
  dptr operator--(int) { dptr r = *this; cur -= sizeof_elem(); return r; }
};

// reinterpret_cast/static_cast spelled on address-space pointer types in
// checked mode (rewritten by the translator to msim::ptr_cast).
template <class To, class From>
inline To ptr_cast(const From& f) {
  if constexpr (std::is_pointer_v<From> && std::is_pointer_v<To>) {
    return reinterpret_cast<To>(f);
  } else if constexpr (std::is_pointer_v<From>) {
    return To((typename To::element_type*)(f));
  } else {
    return To(f);
  }
}

#if MSIM_CHECKED
template <class T>
using arg_ptr_t = dptr<T>;
template <class T>
inline dptr<T> arg_ptr(const msim_buffer& b) { return dptr<T>(b); }
#else
template <class T>
using arg_ptr_t = T*;
template <class T>
inline T* arg_ptr(const msim_buffer& b) { return (T*)b.ptr; }
#endif
template <class T>
inline const T& arg_ref(const msim_buffer& b) { return *(const T*)b.ptr; }

// Bounds-checked view of a threadgroup array (T = E[N] or E[N][M]...).
template <class A>
struct tg_array {
  using E = std::remove_extent_t<A>;
  static constexpr int64_t N = std::extent_v<A>;
  E* p;
  const char* name;
  template <class I, std::enable_if_t<std::is_integral_v<I> || std::is_enum_v<I>, int> = 0>
  auto operator[](I i) const -> std::conditional_t<std::is_array_v<E>, tg_array<E>, E&> {
    int64_t k = (int64_t)i;
    if (k < 0 || k >= N) {
      g_api->oob(name, k, 0, N);
      __builtin_unreachable();
    }
    if constexpr (std::is_array_v<E>) {
      return tg_array<E>{p[k], name};
    } else {
      return p[k];
    }
  }
  operator E*() const { return p; }
  E& operator*() const { return p[0]; }
};

template <class T>
inline T& tg_var(uint32_t slot, const char* name) {
  return *(T*)g_api->tg_alloc(slot, sizeof(T), alignof(T), name,
                              (uint32_t)sizeof(std::remove_all_extents_t<T>));
}
template <class A>
inline tg_array<A> tg_array_decl(uint32_t slot, const char* name) {
  return tg_array<A>{(std::remove_extent_t<A>*)&tg_var<A>(slot, name), name};
}

// ------------------------------------------------------ rendezvous ----------

struct lanes_t {
  const unsigned char* data;
  uint32_t mask;
  uint32_t lane;
  template <class T>
  T get(uint32_t i) const {
    T t;
    __builtin_memcpy((void*)&t, data + (size_t)i * MSIM_LANE_BYTES, sizeof(T));
    return t;
  }
  bool active(uint32_t i) const { return i < 32 && ((mask >> i) & 1u); }
  uint32_t first() const { return (uint32_t)__builtin_ctz(mask); }
};

template <class T>
inline lanes_t exchange(int kind, const T& v, const std::source_location& l) {
  static_assert(sizeof(T) <= MSIM_LANE_BYTES, "SIMD value too large for the simulator");
  lanes_t r;
  r.mask = g_api->simd_sync(kind, &v, (uint32_t)sizeof(T), l.file_name(), l.line(),
                            l.column(), &r.data, &r.lane);
  return r;
}
inline lanes_t exchange0(int kind, const std::source_location& l) {
  lanes_t r;
  r.mask = g_api->simd_sync(kind, nullptr, 0, l.file_name(), l.line(), l.column(),
                            &r.data, &r.lane);
  return r;
}

// Pairwise tree over lanes in lane order (what an xor-1,2,4,8,16 butterfly
// computes): ((l0 op l1) op (l2 op l3)) op ... ; inactive lanes are skipped.
template <class T, class F>
inline T tree_reduce(const lanes_t& L, uint32_t lo, uint32_t width, F f) {
  T v[32];
  bool has[32];
  for (uint32_t i = 0; i < width; ++i) {
    has[i] = L.active(lo + i);
    if (has[i]) v[i] = L.template get<T>(lo + i);
  }
  for (uint32_t d = 1; d < width; d <<= 1) {
    for (uint32_t i = 0; i + d < width; i += 2 * d) {
      if (has[i] && has[i + d]) {
        v[i] = f(v[i], v[i + d]);
      } else if (has[i + d]) {
        v[i] = v[i + d];
        has[i] = true;
      }
    }
  }
  return v[0];
}

struct op_sum {
  template <class T>
  T operator()(const T& a, const T& b) const { return T(a + b); }
};
struct op_prod {
  template <class T>
  T operator()(const T& a, const T& b) const { return T(a * b); }
};
struct op_max {
  template <class T>
  T operator()(const T& a, const T& b) const { return metal::max(a, b); }
};
struct op_min {
  template <class T>
  T operator()(const T& a, const T& b) const { return metal::min(a, b); }
};
struct op_and {
  template <class T>
  T operator()(const T& a, const T& b) const { return T(a & b); }
};
struct op_or {
  template <class T>
  T operator()(const T& a, const T& b) const { return T(a | b); }
};
struct op_xor {
  template <class T>
  T operator()(const T& a, const T& b) const { return T(a ^ b); }
};

}  // namespace msim

// ------------------------------------------------ barriers and SIMD ops ----

namespace metal {

enum class mem_flags : int {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags((int)a | (int)b); }
inline mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags((int)a & (int)b); }

enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst,
};
enum thread_scope {
  thread_scope_thread,
  thread_scope_simdgroup,
  thread_scope_threadgroup,
  thread_scope_device,
};

// The flags matter to the race checker: a barrier orders only the memory its
// flags name (mem_none: execution only), a simdgroup_barrier only within its
// SIMD-group.
inline void threadgroup_barrier(mem_flags f = mem_flags::mem_none,
                                std::source_location l = std::source_location::current()) {
  msim::g_api->barrier(l.file_name(), l.line(), l.column(), (int)f);
}
inline void simdgroup_barrier(mem_flags f = mem_flags::mem_none,
                              std::source_location l = std::source_location::current()) {
  msim::exchange(MSIM_SYNC_SIMD_BARRIER, (int)f, l);
}
template <class... A>
inline void atomic_thread_fence(A...) {}

struct simd_vote {
  using vote_t = uint64_t;
  vote_t v;
  explicit simd_vote(vote_t x = 0) : v(x) {}
  explicit operator vote_t() const { return v; }
  bool all() const { return v == 0xFFFFFFFFull; }
  bool any() const { return v != 0; }
};

#define MSIM_LOC std::source_location l = std::source_location::current()
#define MSIM_SIMD_REDUCE(name, op)                                           \
  template <class T>                                                         \
  inline T name(T x, MSIM_LOC) {                                             \
    auto L = msim::exchange(MSIM_SYNC_SIMD, x, l);                           \
    return msim::tree_reduce<T>(L, 0, 32, msim::op{});                       \
  }                                                                          \
  template <class T>                                                         \
  inline T quad_##name(T x, MSIM_LOC) {                                      \
    auto L = msim::exchange(MSIM_SYNC_QUAD, x, l);                           \
    return msim::tree_reduce<T>(L, L.lane & ~3u, 4, msim::op{});             \
  }
MSIM_SIMD_REDUCE(simd_sum, op_sum)
MSIM_SIMD_REDUCE(simd_product, op_prod)
MSIM_SIMD_REDUCE(simd_max, op_max)
MSIM_SIMD_REDUCE(simd_min, op_min)
MSIM_SIMD_REDUCE(simd_and, op_and)
MSIM_SIMD_REDUCE(simd_or, op_or)
MSIM_SIMD_REDUCE(simd_xor, op_xor)
#undef MSIM_SIMD_REDUCE
template <class T> inline T quad_sum(T x, MSIM_LOC) { return quad_simd_sum(x, l); }
template <class T> inline T quad_product(T x, MSIM_LOC) { return quad_simd_product(x, l); }
template <class T> inline T quad_max(T x, MSIM_LOC) { return quad_simd_max(x, l); }
template <class T> inline T quad_min(T x, MSIM_LOC) { return quad_simd_min(x, l); }
template <class T> inline T quad_and(T x, MSIM_LOC) { return quad_simd_and(x, l); }
template <class T> inline T quad_or(T x, MSIM_LOC) { return quad_simd_or(x, l); }
template <class T> inline T quad_xor(T x, MSIM_LOC) { return quad_simd_xor(x, l); }

#define MSIM_SIMD_PREFIX(name, op, inclusive, kind, width)                   \
  template <class T>                                                         \
  inline T name(T x, MSIM_LOC) {                                             \
    auto L = msim::exchange(kind, x, l);                                     \
    uint32_t lo = L.lane & ~(uint32_t)(width - 1);                           \
    bool has = false;                                                        \
    T acc{};                                                                 \
    uint32_t end = inclusive ? L.lane + 1 : L.lane;                          \
    for (uint32_t i = lo; i < end; ++i) {                                    \
      if (!L.active(i)) continue;                                            \
      T v = L.template get<T>(i);                                                     \
      acc = has ? msim::op{}(acc, v) : v;                                    \
      has = true;                                                            \
    }                                                                        \
    if (!has) return T(std::is_same_v<msim::op, msim::op_prod> ? 1 : 0);     \
    return acc;                                                              \
  }
MSIM_SIMD_PREFIX(simd_prefix_exclusive_sum, op_sum, false, MSIM_SYNC_SIMD, 32)
MSIM_SIMD_PREFIX(simd_prefix_inclusive_sum, op_sum, true, MSIM_SYNC_SIMD, 32)
MSIM_SIMD_PREFIX(simd_prefix_exclusive_product, op_prod, false, MSIM_SYNC_SIMD, 32)
MSIM_SIMD_PREFIX(simd_prefix_inclusive_product, op_prod, true, MSIM_SYNC_SIMD, 32)
MSIM_SIMD_PREFIX(quad_prefix_exclusive_sum, op_sum, false, MSIM_SYNC_QUAD, 4)
MSIM_SIMD_PREFIX(quad_prefix_inclusive_sum, op_sum, true, MSIM_SYNC_QUAD, 4)
MSIM_SIMD_PREFIX(quad_prefix_exclusive_product, op_prod, false, MSIM_SYNC_QUAD, 4)
MSIM_SIMD_PREFIX(quad_prefix_inclusive_product, op_prod, true, MSIM_SYNC_QUAD, 4)
#undef MSIM_SIMD_PREFIX

// Shuffles: reading an inactive or nonexistent lane yields the caller's own
// value (undefined on the GPU).
#define MSIM_SIMD_SHUFFLE(name, kind, width, src_expr)                       \
  template <class T, class I>                                                \
  inline T name(T x, I arg, MSIM_LOC) {                                      \
    auto L = msim::exchange(kind, x, l);                                     \
    uint32_t lane = L.lane, base = lane & ~(uint32_t)(width - 1);            \
    uint32_t q = lane - base;                                                \
    int64_t a = (int64_t)arg;                                                \
    int64_t src = (src_expr);                                                \
    (void)q;                                                                 \
    if (src < 0 || src >= (int64_t)width) return x;                          \
    uint32_t s = base + (uint32_t)src;                                       \
    return L.active(s) ? L.template get<T>(s) : x;                                    \
  }
MSIM_SIMD_SHUFFLE(simd_shuffle, MSIM_SYNC_SIMD, 32, a)
MSIM_SIMD_SHUFFLE(simd_broadcast, MSIM_SYNC_SIMD, 32, a)
MSIM_SIMD_SHUFFLE(simd_shuffle_xor, MSIM_SYNC_SIMD, 32, (int64_t)(q ^ (uint32_t)a))
MSIM_SIMD_SHUFFLE(simd_shuffle_down, MSIM_SYNC_SIMD, 32, q + a)
MSIM_SIMD_SHUFFLE(simd_shuffle_up, MSIM_SYNC_SIMD, 32, (int64_t)q - a)
MSIM_SIMD_SHUFFLE(simd_shuffle_rotate_down, MSIM_SYNC_SIMD, 32, (q + a) % 32)
MSIM_SIMD_SHUFFLE(simd_shuffle_rotate_up, MSIM_SYNC_SIMD, 32, (((int64_t)q - a) % 32 + 32) % 32)
MSIM_SIMD_SHUFFLE(quad_shuffle, MSIM_SYNC_QUAD, 4, a)
MSIM_SIMD_SHUFFLE(quad_broadcast, MSIM_SYNC_QUAD, 4, a)
MSIM_SIMD_SHUFFLE(quad_shuffle_xor, MSIM_SYNC_QUAD, 4, (int64_t)(q ^ (uint32_t)a))
MSIM_SIMD_SHUFFLE(quad_shuffle_down, MSIM_SYNC_QUAD, 4, q + a)
MSIM_SIMD_SHUFFLE(quad_shuffle_up, MSIM_SYNC_QUAD, 4, (int64_t)q - a)
MSIM_SIMD_SHUFFLE(quad_shuffle_rotate_down, MSIM_SYNC_QUAD, 4, (q + a) % 4)
MSIM_SIMD_SHUFFLE(quad_shuffle_rotate_up, MSIM_SYNC_QUAD, 4, (((int64_t)q - a) % 4 + 4) % 4)
#undef MSIM_SIMD_SHUFFLE

template <class T>
inline T simd_broadcast_first(T x, MSIM_LOC) {
  auto L = msim::exchange(MSIM_SYNC_SIMD, x, l);
  return L.template get<T>(L.first());
}
inline simd_vote simd_ballot(bool b, MSIM_LOC) {
  auto L = msim::exchange(MSIM_SYNC_SIMD, b, l);
  uint64_t v = 0;
  for (uint32_t i = 0; i < 32; ++i)
    if (L.active(i) && L.template get<bool>(i)) v |= 1ull << i;
  return simd_vote(v);
}
inline simd_vote simd_active_threads_mask(MSIM_LOC) {
  auto L = msim::exchange0(MSIM_SYNC_SIMD, l);
  return simd_vote(L.mask);
}
inline bool simd_all(bool b, MSIM_LOC) {
  auto L = msim::exchange(MSIM_SYNC_SIMD, b, l);
  for (uint32_t i = 0; i < 32; ++i)
    if (L.active(i) && !L.template get<bool>(i)) return false;
  return true;
}
inline bool simd_any(bool b, MSIM_LOC) {
  auto L = msim::exchange(MSIM_SYNC_SIMD, b, l);
  for (uint32_t i = 0; i < 32; ++i)
    if (L.active(i) && L.template get<bool>(i)) return true;
  return false;
}
inline bool simd_is_first(MSIM_LOC) {
  auto L = msim::exchange0(MSIM_SYNC_SIMD, l);
  return L.lane == L.first();
}
inline bool simd_is_helper_thread() { return false; }
inline bool quad_all(bool b, MSIM_LOC) {
  auto L = msim::exchange(MSIM_SYNC_QUAD, b, l);
  for (uint32_t i = L.lane & ~3u; i < (L.lane & ~3u) + 4; ++i)
    if (L.active(i) && !L.template get<bool>(i)) return false;
  return true;
}
inline bool quad_any(bool b, MSIM_LOC) {
  auto L = msim::exchange(MSIM_SYNC_QUAD, b, l);
  for (uint32_t i = L.lane & ~3u; i < (L.lane & ~3u) + 4; ++i)
    if (L.active(i) && L.template get<bool>(i)) return true;
  return false;
}

// ------------------------------------------------------------ atomics ------

// Simulated threads never run at the same time, so plain loads and stores
// are atomic; the layout of atomic<T> is that of T. The functions are not
// instrumented for the race checker (MSIM_NO_RACECHECK): atomic accesses
// never race with each other.
template <class T>
struct atomic {
  T __v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

template <class T>
using msim_ti = typename std::type_identity<T>::type;

template <class T>
MSIM_NO_RACECHECK inline T atomic_load_explicit(const volatile atomic<T>* o, memory_order = memory_order_relaxed) {
  return o->__v;
}
template <class T>
MSIM_NO_RACECHECK inline void atomic_store_explicit(volatile atomic<T>* o, msim_ti<T> v,
                                  memory_order = memory_order_relaxed) {
  o->__v = v;
}
template <class T>
MSIM_NO_RACECHECK inline T atomic_exchange_explicit(volatile atomic<T>* o, msim_ti<T> v,
                                  memory_order = memory_order_relaxed) {
  T old = o->__v;
  o->__v = v;
  return old;
}
template <class T>
MSIM_NO_RACECHECK inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, msim_ti<T>* expected,
                                                  msim_ti<T> desired, memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed) {
  T cur = o->__v;
  if (cur == *expected) {
    o->__v = desired;
    return true;
  }
  *expected = cur;
  return false;
}
template <class T>
MSIM_NO_RACECHECK inline bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* o, msim_ti<T>* expected,
                                                    msim_ti<T> desired,
                                                    memory_order m1 = memory_order_relaxed,
                                                    memory_order m2 = memory_order_relaxed) {
  return atomic_compare_exchange_weak_explicit(o, expected, desired, m1, m2);
}
#define MSIM_ATOMIC_RMW(name, expr)                                          \
  template <class T>                                                         \
  MSIM_NO_RACECHECK inline T name(volatile atomic<T>* o, msim_ti<T> v,                         \
                memory_order = memory_order_relaxed) {                       \
    T old = o->__v;                                                          \
    T a = old;                                                               \
    o->__v = (expr);                                                         \
    return old;                                                              \
  }
MSIM_ATOMIC_RMW(atomic_fetch_add_explicit, T(a + v))
MSIM_ATOMIC_RMW(atomic_fetch_sub_explicit, T(a - v))
MSIM_ATOMIC_RMW(atomic_fetch_and_explicit, T(a & v))
MSIM_ATOMIC_RMW(atomic_fetch_or_explicit, T(a | v))
MSIM_ATOMIC_RMW(atomic_fetch_xor_explicit, T(a ^ v))
MSIM_ATOMIC_RMW(atomic_fetch_max_explicit, (a < v ? v : a))
MSIM_ATOMIC_RMW(atomic_fetch_min_explicit, (v < a ? v : a))
#undef MSIM_ATOMIC_RMW

// Checked-pointer forms (out + i instead of &out[i]).
#define MSIM_ATOMIC_DPTR(name)                                               \
  template <class T, class... R>                                             \
  inline auto name(const msim::dptr<atomic<T>>& p, R... r) {                 \
    return name(&*p, r...);                                                  \
  }
MSIM_ATOMIC_DPTR(atomic_load_explicit)
MSIM_ATOMIC_DPTR(atomic_store_explicit)
MSIM_ATOMIC_DPTR(atomic_exchange_explicit)
MSIM_ATOMIC_DPTR(atomic_compare_exchange_weak_explicit)
MSIM_ATOMIC_DPTR(atomic_compare_exchange_strong_explicit)
MSIM_ATOMIC_DPTR(atomic_fetch_add_explicit)
MSIM_ATOMIC_DPTR(atomic_fetch_sub_explicit)
MSIM_ATOMIC_DPTR(atomic_fetch_and_explicit)
MSIM_ATOMIC_DPTR(atomic_fetch_or_explicit)
MSIM_ATOMIC_DPTR(atomic_fetch_xor_explicit)
MSIM_ATOMIC_DPTR(atomic_fetch_max_explicit)
MSIM_ATOMIC_DPTR(atomic_fetch_min_explicit)
#undef MSIM_ATOMIC_DPTR

// --------------------------------------------------- simdgroup_matrix -------

// 8x8 simdgroup matrices distributed over the 32 lanes as on Apple GPUs:
// lane l holds row (l/4 & 4) + (l/2 % 4), columns (l/4 & 2)*2 + (l%2)*2 + {0,1}
// (the layout MLX's steel kernels rely on). Loads and stores touch only the
// lane's own two elements; multiply gathers the three operands from all lanes.
template <class T, int R, int C>
struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "metal/sim supports 8x8 simdgroup matrices only");
  vec<T, 2> e;
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T v) : e(v) {}
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};
inline void msim_sgm_coord(uint32_t lane, int& row, int& col) {
  uint32_t qid = lane / 4;
  row = (int)((qid & 4) + ((lane / 2) % 4));
  col = (int)((qid & 2) * 2 + (lane % 2) * 2);
}
template <class T>
inline simdgroup_matrix<T, 8, 8> make_filled_simdgroup_matrix(T v) {
  return simdgroup_matrix<T, 8, 8>(v);
}
template <class T, int R, int C>
inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  return simdgroup_matrix<T, R, C>(v);
}
inline uint32_t msim_lane_id(const std::source_location& l) {
  return msim::exchange0(MSIM_SYNC_SIMD, l).lane;
}
template <class T, class P>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& m, P src, ulong elements_per_row = 8,
                           vec<ulong, 2> origin = vec<ulong, 2>(0, 0), bool transpose = false,
                           MSIM_LOC) {
  int r, c;
  msim_sgm_coord(msim_lane_id(l), r, c);
  for (int k = 0; k < 2; ++k) {
    long row = r + (long)origin.y, col = c + k + (long)origin.x;
    long idx = transpose ? col * (long)elements_per_row + row : row * (long)elements_per_row + col;
    m.e[k] = T(src[idx]);
  }
}
template <class T, class P>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, P dst, ulong elements_per_row = 8,
                            vec<ulong, 2> origin = vec<ulong, 2>(0, 0), bool transpose = false,
                            MSIM_LOC) {
  int r, c;
  msim_sgm_coord(msim_lane_id(l), r, c);
  for (int k = 0; k < 2; ++k) {
    long row = r + (long)origin.y, col = c + k + (long)origin.x;
    long idx = transpose ? col * (long)elements_per_row + row : row * (long)elements_per_row + col;
    dst[idx] = m.e[k];
  }
}
template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                          const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b,
                                          const simdgroup_matrix<TC, 8, 8>& c, MSIM_LOC) {
  struct pack {
    float a[2], b[2], c[2];
  } mine{{(float)a.e[0], (float)a.e[1]}, {(float)b.e[0], (float)b.e[1]}, {(float)c.e[0], (float)c.e[1]}};
  auto L = msim::exchange(MSIM_SYNC_SIMD, mine, l);
  float A[8][8], B[8][8], Cm[8][8];
  for (uint32_t i = 0; i < 32; ++i) {
    pack p = L.template get<pack>(i);
    int r, cc;
    msim_sgm_coord(i, r, cc);
    for (int k = 0; k < 2; ++k) {
      A[r][cc + k] = p.a[k];
      B[r][cc + k] = p.b[k];
      Cm[r][cc + k] = p.c[k];
    }
  }
  int r, cc;
  msim_sgm_coord(L.lane, r, cc);
  for (int k = 0; k < 2; ++k) {
    float s = Cm[r][cc + k];
    for (int j = 0; j < 8; ++j) s += A[r][j] * B[j][cc + k];
    d.e[k] = TD(s);
  }
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b, MSIM_LOC) {
  simdgroup_matrix<TD, 8, 8> z(TD(0));
  simdgroup_multiply_accumulate(d, a, b, z, l);
}
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat16_t, 8, 8> simdgroup_bfloat8x8;
#undef MSIM_LOC

}  // namespace metal

using namespace metal;

// ------------------------------------------------------------ MLX utils ----

template <typename U>
struct Limits;
#define MSIM_INT_LIMIT(T)                                               \
  template <>                                                           \
  struct Limits<T> {                                                    \
    static constexpr T max = metal::numeric_limits<T>::max();           \
    static constexpr T min = metal::numeric_limits<T>::min();           \
    static constexpr T finite_max = metal::numeric_limits<T>::max();    \
    static constexpr T finite_min = metal::numeric_limits<T>::min();    \
  };
MSIM_INT_LIMIT(uint8_t)
MSIM_INT_LIMIT(uint16_t)
MSIM_INT_LIMIT(uint32_t)
MSIM_INT_LIMIT(uint64_t)
MSIM_INT_LIMIT(int8_t)
MSIM_INT_LIMIT(int16_t)
MSIM_INT_LIMIT(int32_t)
MSIM_INT_LIMIT(int64_t)
#undef MSIM_INT_LIMIT
template <>
struct Limits<bool> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};
template <>
struct Limits<float> {
  static constexpr float max = __builtin_inff();
  static constexpr float min = -__builtin_inff();
  static constexpr float finite_max = __FLT_MAX__;
  static constexpr float finite_min = -__FLT_MAX__;
};
template <>
struct Limits<half> {
  static constexpr half max = (half)__builtin_inff();
  static constexpr half min = (half)-__builtin_inff();
  static constexpr half finite_max = (half)65504.0f;
  static constexpr half finite_min = (half)-65504.0f;
};
template <>
struct Limits<bfloat16_t> {
  static inline const bfloat16_t max = bfloat16_t::from_bits(0x7F80);
  static inline const bfloat16_t min = bfloat16_t::from_bits(0xFF80);
  static inline const bfloat16_t finite_max = bfloat16_t::from_bits(0x7F7F);
  static inline const bfloat16_t finite_min = bfloat16_t::from_bits(0xFF7F);
};

template <typename IdxT = int64_t, class S, class St,
          std::enable_if_t<std::is_integral_v<IdxT>, int> = 0>
inline IdxT elem_to_loc(IdxT elem, const S& shape, const St& strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
template <typename IdxT = int64_t, class S, class St>
inline IdxT elem_to_loc(uint3 elem, const S& shape, const St& strides, int ndim) {
  IdxT loc = elem.x * IdxT(strides[ndim - 1]) + elem.y * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t, class St>
inline IdxT elem_to_loc_1(uint elem, const St& stride) { return elem * IdxT(stride); }
template <typename IdxT = int64_t, class St>
inline IdxT elem_to_loc_2(uint2 elem, const St& strides) {
  return elem.x * IdxT(strides[1]) + elem.y * IdxT(strides[0]);
}
template <typename IdxT = int64_t, class St>
inline IdxT elem_to_loc_3(uint3 elem, const St& strides) {
  return elem.x * IdxT(strides[2]) + elem.y * IdxT(strides[1]) + elem.z * IdxT(strides[0]);
}
inline size_t ceildiv(size_t n, size_t m) { return (n + m - 1) / m; }

#define METAL_FUNC inline
#define MLX_MTL_PRAGMA_UNROLL
#define MLX_MTL_LOOP_UNROLL

// -------------------------------------------- address-space qualifiers -----
// Last, so nothing above is affected. In checked mode the translator has
// already turned `device T*`/`constant T*` into msim::dptr<T>.
#define device
#define constant
#define thread
#define threadgroup
#define threadgroup_imageblock
#define ray_data
#define object_data
#define kernel
