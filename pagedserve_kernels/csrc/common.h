// What several kernel families share: value conversions, exp, the AVX-512 16-lane helpers, AMX
// tile configuration and permission, the work queue, paged-cache addressing and argument checks.
// Float math is float32 throughout; loads and stores convert from/to the tensor dtype.
// Everything here is inline (small helpers always_inline), so a kernel in any file compiles to
// the code it would get with the helper written in place.
#pragma once

// The parts of ATen the kernels use, not <ATen/ATen.h>: the header parse is most of each
// file's compile time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#define PAGEDSERVE_INLINE inline __attribute__((always_inline))

namespace pagedserve_cpu {

template <typename T>
PAGEDSERVE_INLINE float to_f(T x) {
  return static_cast<float>(x);
}

template <typename T>
PAGEDSERVE_INLINE T from_f(float x) {
  return static_cast<T>(x);
}

// bf16 -> float is a 16-bit shift; spelled out so the compiler vectorizes it.
template <>
PAGEDSERVE_INLINE float to_f<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// e^x for x <= 88: Cody-Waite reduction to |r| <= ln2/2, then Taylor to r^6 (~1 ulp);
// branch-free so loops over it vectorize.
PAGEDSERVE_INLINE float exp_approx(float x) {
  x = std::fmax(x, -87.0f);
  x = std::fmin(x, 88.0f);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

// Flat cache slot of token t of a sequence whose blocks are `blocks`.
PAGEDSERVE_INLINE int64_t cache_slot(const int32_t* blocks, int64_t t, int64_t block_size) {
  return static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
}

// The first key position a query at q_pos sees under a window of `window` keys (0: no window):
// keys q_pos - window < j <= q_pos. Blocks wholly before it may be freed, so are never read.
PAGEDSERVE_INLINE int64_t window_start(int64_t q_pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, q_pos - window + 1) : 0;
}

}  // namespace pagedserve_cpu

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_AVX512 1
// AVX-512 BF16 (vdpbf16ps, vcvtne2ps2bf16): the prefill kernel's vector body, and the AMX
// kernels' conversions (every AMX CPU has it).
#if defined(__AVX512BF16__)
#define PAGEDSERVE_AVX512BF16 1
#endif

namespace pagedserve_cpu {

// 16 values of T <-> one vector of float32.
PAGEDSERVE_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
PAGEDSERVE_INLINE __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
PAGEDSERVE_INLINE void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
PAGEDSERVE_INLINE void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16 does (NaN inputs do not occur here).
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(
      reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
template <typename T>
constexpr bool kVec = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// v rounded to bf16 precision (nearest even), kept as float32.
PAGEDSERVE_INLINE __m512 round_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(
      _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// exp_approx on 16 lanes.
PAGEDSERVE_INLINE __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// a * tanh(b * x) on 16 lanes as a - 2a / (e^(2bx) + 1); exp16 clamps its argument, so large
// |x| gives +-a exactly. Soft-capping: a = cap, b = 1 / cap on scaled scores.
PAGEDSERVE_INLINE __m512 tanh_scaled16(__m512 x, __m512 a, __m512 b2) {
  const __m512 e = exp16(_mm512_mul_ps(x, b2));
  const __m512 den = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
  return _mm512_sub_ps(a, _mm512_div_ps(_mm512_add_ps(a, a), den));
}

}  // namespace pagedserve_cpu
#else
namespace pagedserve_cpu {
template <typename T>
constexpr bool kVec = false;
}  // namespace pagedserve_cpu
#endif

namespace pagedserve_cpu {

// Logit soft-capping in place, x = a * tanh(b * x) for n scores (a = cap, b = 1 / cap on scaled
// scores; a = cap / scale, b = scale / cap on raw q.k where the kernel scales later).
inline void cap_scores(float* x, int64_t n, float a, float b) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 va = _mm512_set1_ps(a), vb2 = _mm512_set1_ps(2.0f * b);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(x + i, tanh_scaled16(_mm512_loadu_ps(x + i), va, vb2));
#endif
  for (; i < n; ++i) x[i] = a * std::tanh(b * x[i]);
}

}  // namespace pagedserve_cpu

// ---- AMX basics (tile config, per-process permission) ------------------------------------
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDSERVE_AMX 1

namespace pagedserve_cpu {

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One answer per process (an inline function's static is shared by every file).
inline bool amx_permitted() {
  // Linux hands out AMX state per process on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// GCC models ldtilecfg's operand narrower than the 64-byte config and may drop the stores to
// rows / colsb as dead; handing the address to an empty asm with a memory clobber keeps them.
PAGEDSERVE_INLINE void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// All eight tiles 16 rows x 64 bytes (linear, prefill and the cascade's prefix pass).
inline void amx_configure_square() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  load_tile_config(cfg);
}

}  // namespace pagedserve_cpu
#endif

namespace pagedserve_cpu {

// Rows per task for elementwise kernels: ~64K elements, so a decode-sized batch runs inline
// instead of waking the thread pool (a parallel region costs more than the work).
PAGEDSERVE_INLINE int64_t row_grain(int64_t elements_per_row) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, elements_per_row));
}

// Hands out [0, n) to the threads of one parallel region first come, first served, in pieces
// that shrink as the work runs out (guided scheduling). A static split makes every thread wait
// at the join for one the OS has lent to another process (the server's event loop, a client);
// here the other thread takes over the rest of its work.
class WorkQueue {
 public:
  explicit WorkQueue(int64_t n) : n_(n), threads_(std::max(1, at::get_num_threads())) {}
  // The next piece [begin, end); false when none is left.
  bool take(int64_t& begin, int64_t& end) {
    int64_t cur = next_.load(std::memory_order_relaxed);
    do {
      if (cur >= n_) return false;
      const int64_t piece = std::max<int64_t>(1, (n_ - cur) / (2 * threads_));
      end = std::min(n_, cur + piece);
    } while (!next_.compare_exchange_weak(cur, end, std::memory_order_relaxed));
    begin = cur;
    return true;
  }
  // fn(queue) on every thread of one parallel region.
  template <typename F>
  void run(const F& fn) {
    at::parallel_for(0, threads_, 1, [&](int64_t, int64_t) { fn(*this); });
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t n_;
  const int threads_;
};

// Bounds checks on the raw index arrays: a plain loop, no tensor reductions on the hot path.
template <typename I>
bool all_in_range(const I* v, int64_t n, int64_t lo, int64_t hi) {
  for (int64_t i = 0; i < n; ++i)
    if (v[i] < lo || v[i] > hi) return false;
  return true;
}

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace pagedserve_cpu
