// CPU kernels for pagedserve's hot path, one pass over memory each where torch needs several:
//   rms_norm, fused_add_rms_norm   Llama RMSNorm (Hugging Face's rounding), residual add fused
//   rotary_embedding                rotate-half RoPE in place on q and k, from a cos|sin cache
//   silu_and_mul                    SwiGLU: silu(x[:, :I]) * x[:, I:]
//   write_kv                        new tokens' K and V into their cache slots
//   paged_attention_decode          one query token per sequence over its paged K/V, GQA-aware
// Built on first use by kernels/cpu_ops.py (torch.utils.cpp_extension); the torch ops in
// engine/models/llama.py and kernels/reference.py are the oracle the tests compare against.
// Float math is float32 throughout; loads and stores convert from/to the tensor dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <algorithm>
#include <atomic>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline T from_f(float x) {
  return static_cast<T>(x);
}

// bf16 -> float is a 16-bit shift; spelled out so the compiler vectorizes it.
template <>
inline float to_f<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// e^x for x <= 88: Cody-Waite reduction to |r| <= ln2/2, then Taylor to r^6 (~1 ulp);
// branch-free so loops over it vectorize.
inline float exp_approx(float x) {
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

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_AVX512 1

// 16 values of T <-> one vector of float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16 does (NaN inputs do not occur here).
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
template <typename T>
constexpr bool kVec = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// v rounded to bf16 precision (nearest even), kept as float32.
inline __m512 round_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// exp_approx on 16 lanes.
inline __m512 exp16(__m512 x) {
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
#else
template <typename T>
constexpr bool kVec = false;
#endif

// ---- AMX basics (tile config, per-process permission) ------------------------------------
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDSERVE_AMX 1

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
  // Linux hands out AMX state per process on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// permutex2var_epi16 indices that interleave the first 16 words of a with those of b
// (a0 b0 a1 b1 ... a15 b15); adding 16 to each interleaves the next 16.
inline __m512i interleave_lo16() {
  return _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
      35, 3, 34, 2, 33, 1, 32, 0);
}

// GCC models ldtilecfg's operand narrower than the 64-byte config and may drop the stores to
// rows / colsb as dead; handing the address to an empty asm with a memory clobber keeps them.
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

constexpr int64_t kPrefetchTiles = 8;

void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}
#endif

template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  float ss = 0.0f;
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  // 16 lanes at a time (the scalar loops below round through c10's one-value conversions)
  if constexpr (kVec<T>) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 v = load16(x + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; i < n; ++i) {
    float v = to_f(x[i]);
    ss += v * v;
  }
  float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  // Hugging Face: (x * rsqrt(mean(x^2) + eps)).to(dtype), then weight * that in dtype.
  i = 0;
#ifdef PAGEDSERVE_AVX512
  if constexpr (kVec<T>) {
    const __m512 vr = _mm512_set1_ps(r);
    for (; i + 16 <= n; i += 16) {
      __m512 normed = _mm512_mul_ps(load16(x + i), vr);
      if constexpr (!std::is_same_v<T, float>) normed = round_bf16(normed);
      store16(out + i, _mm512_mul_ps(load16(w + i), normed));
    }
  }
#endif
  for (; i < n; ++i) {
    float normed = to_f(from_f<T>(to_f(x[i]) * r));
    out[i] = from_f<T>(to_f(w[i]) * normed);
  }
}

// Rows per task for elementwise kernels: ~64K elements, so a decode-sized batch runs inline
// instead of waking the thread pool (a parallel region costs more than the work).
inline int64_t row_grain(int64_t elements_per_row) {
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

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out like x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight: [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype must match x");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(op + r * os, xp + r * xs, wp, n, static_cast<float>(eps));
    });
  });
}

template <typename T>
void add_rms_norm_row(T* x, T* residual, const T* w, int64_t n, float eps) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  if constexpr (kVec<T>)
    for (; i + 16 <= n; i += 16) store16(residual + i, _mm512_add_ps(load16(x + i), load16(residual + i)));
#endif
  for (; i < n; ++i) residual[i] = from_f<T>(to_f(x[i]) + to_f(residual[i]));
  rms_norm_row(x, residual, w, n, eps);
}

// residual += x (rounded to dtype, as `x + residual` would be), then x = rms_norm(residual).
void fused_add_rms_norm(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must be shaped like x");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "residual dtype must match x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight: [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype must match x");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
        scalar_t* xp = x.data_ptr<scalar_t>();
        scalar_t* rp = residual.data_ptr<scalar_t>();
        const scalar_t* wp = weight.data_ptr<scalar_t>();
        const int64_t xs = x.stride(0), rs = residual.stride(0);
        at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r)
            add_rms_norm_row(xp + r * xs, rp + r * rs, wp, n, static_cast<float>(eps));
        });
      });
}

// x: [T, heads, D] with contiguous heads; cache: [max_pos, D] = cos (D/2) | sin (D/2).
template <typename T>
void rope_heads(T* x, int64_t heads, int64_t d, const T* cs) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * d;
    int64_t i0 = 0;
#ifdef PAGEDSERVE_AVX512
    if constexpr (kVec<T>)
      for (; i0 + 16 <= half; i0 += 16) {
        const __m512 c = load16(cs + i0), s = load16(cs + half + i0);
        const __m512 x1 = load16(v + i0), x2 = load16(v + half + i0);
        store16(v + i0, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)));
        store16(v + half + i0, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)));
      }
#endif
#pragma omp simd
    for (int64_t i = i0; i < half; ++i) {
      float c = to_f(cs[i]), s = to_f(cs[half + i]);
      float x1 = to_f(v[i]), x2 = to_f(v[half + i]);
      v[i] = from_f<T>(x1 * c - x2 * s);
      v[half + i] = from_f<T>(x2 * c + x1 * s);
    }
  }
}

void rotary_embedding(
    const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [T, H, D]");
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && k.stride(1) == k.size(2), "k: [T, Hkv, D]");
  TORCH_CHECK(cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) == q.size(2), "cache");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions");
  TORCH_CHECK(cos_sin_cache.scalar_type() == q.scalar_type(), "cache dtype must match q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.size(2) == q.size(2), "k like q");
  TORCH_CHECK(k.size(0) == q.size(0) && positions.numel() == q.size(0), "one position per token");
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
  const int64_t tokens = q.size(0), d = q.size(2);
  TORCH_CHECK(
      all_in_range(positions.data_ptr<int64_t>(), tokens, 0, cos_sin_cache.size(0) - 1),
      "position outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
        scalar_t* qp = q.data_ptr<scalar_t>();
        scalar_t* kp = k.data_ptr<scalar_t>();
        const scalar_t* cp = cos_sin_cache.data_ptr<scalar_t>();
        const int64_t* pos = positions.data_ptr<int64_t>();
        const int64_t qs = q.stride(0), ks = k.stride(0), hq = q.size(1), hk = k.size(1);
        at::parallel_for(0, tokens, row_grain((hq + hk) * d), [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            const scalar_t* cs = cp + pos[t] * d;
            rope_heads(qp + t * qs, hq, d, cs);
            rope_heads(kp + t * ks, hk, d, cs);
          }
        });
      });
}

// k_cache / v_cache [blocks, block_size, kv_heads, D] at flat slot s <- key / value [T, kv_heads, D]
// row t: what index_copy_ on the caches' [slots, kv_heads, D] view does, without its per-call
// setup (which cost more than the copy at decode sizes).
void write_kv(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key, value: [T, kv_heads, D]");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2), "key: heads contiguous per token");
  TORCH_CHECK(value.stride(2) == 1 && value.stride(1) == value.size(2), "value: heads contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache must match");
  TORCH_CHECK(k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2), "head shapes");
  TORCH_CHECK(
      key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
          v_cache.scalar_type() == k_cache.scalar_type(),
      "dtypes must agree");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slots");
  const int64_t tokens = key.size(0);
  TORCH_CHECK(slot_mapping.numel() == tokens, "one slot per token");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  TORCH_CHECK(all_in_range(sp, tokens, 0, slots - 1), "slot outside the cache");
  const int64_t row = key.size(1) * key.size(2), bytes = row * key.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  at::parallel_for(0, tokens, row_grain(2 * row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
}

template <typename T>
void silu_mul_row(T* out, const T* gate, const T* up, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  if constexpr (kVec<T>) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
      __m512 g = load16(gate + i);
      __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      if constexpr (!std::is_same_v<T, float>) s = round_bf16(s);  // as torch stores silu
      store16(out + i, _mm512_mul_ps(s, load16(up + i)));
    }
  }
#endif
  for (; i < n; ++i) {
    float g = to_f(gate[i]);
    float s = to_f(from_f<T>(g / (1.0f + exp_approx(-g))));
    out[i] = from_f<T>(s * to_f(up[i]));
  }
}

// out[t, i] = silu(x[t, i]) * x[t, I + i]; silu rounded to dtype first, as torch computes it.
void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), inter = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * inter && out.size(0) == rows, "x must be [T, 2 * I], out [T, I]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out dtype must match x");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, row_grain(2 * inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_mul_row(op + r * os, xp + r * xs, xp + r * xs + inter, inter);
    });
  });
}

// One (sequence, KV head) pair: the G query heads of that group against the sequence's
// blocks. Two passes: scores for every key, then a softmax-weighted sum of the values.
template <typename T>
void decode_one(
    T* out, int64_t out_head_stride, const T* q, int64_t q_head_stride, const T* k_cache,
    const T* v_cache, const int32_t* blocks, int64_t len, int64_t block_size, int64_t kv_heads,
    int64_t kv_head, int64_t group, int64_t d, float scale, std::vector<float>& buf) {
  buf.resize(group * (len + 2 * d));
  float* scores = buf.data();             // [G, len]
  float* qf = scores + group * len;       // [G, D]
  float* acc = qf + group * d;            // [G, D]
  for (int64_t g = 0; g < group; ++g) {
    const T* qg = q + g * q_head_stride;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_f(qg[i]) * scale;
  }
  const int64_t token_stride = kv_heads * d;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
    const T* kr = k_cache + slot * token_stride + kv_head * d;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * d;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += qg[i] * to_f(kr[i]);
      scores[g * len + t] = s;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    float m = -INFINITY;
    for (int64_t t = 0; t < len; ++t) m = std::fmax(m, sg[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      float e = exp_approx(sg[t] - m);
      sg[t] = e;
      sum += e;
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
  std::fill(acc, acc + group * d, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
    const T* vr = v_cache + slot * token_stride + kv_head * d;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t];
      float* ag = acc + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ag[i] += p * to_f(vr[i]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    T* og = out + g * out_head_stride;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) og[i] = from_f<T>(acc[g * d + i]);
  }
}

#ifdef PAGEDSERVE_AVX512
// Softmax of n scores in place (max-subtracted, float32).
inline void softmax_inplace(float* s, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
  float m = _mm512_reduce_max_ps(vmax);
  for (; t < n; ++t) m = std::fmax(m, s[t]);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (; t < n; ++t) {
    s[t] = exp_approx(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.0f / sum;
  for (t = 0; t < n; ++t) s[t] *= inv;
}

// decode_one with head_dim = 16 * NC held in registers: per key one multiply-add chain and
// one horizontal sum per query head; per value one multiply-add per head and chunk.
template <typename T, int NC>
void decode_one_vec(
    T* out, int64_t out_head_stride, const T* q, int64_t q_head_stride, const T* k_cache,
    const T* v_cache, const int32_t* blocks, int64_t len, int64_t block_size, int64_t kv_heads,
    int64_t kv_head, int64_t group, float scale, std::vector<float>& buf) {
  constexpr int64_t d = 16 * NC;
  buf.resize(group * len + 16);
  float* scores = buf.data();  // [G, len]
  const int64_t token_stride = kv_heads * d;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g0 = 0; g0 < group; g0 += 4) {  // four query heads at a time stay in registers
    const int64_t ng = std::min<int64_t>(4, group - g0);
    __m512 qv[4][NC];
    for (int64_t g = 0; g < ng; ++g)
      for (int c = 0; c < NC; ++c)
        qv[g][c] = _mm512_mul_ps(load16(q + (g0 + g) * q_head_stride + 16 * c), vscale);
    for (int64_t t = 0; t < len; ++t) {
      const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
      const T* kr = k_cache + slot * token_stride + kv_head * d;
      __m512 kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = load16(kr + 16 * c);
      for (int64_t g = 0; g < ng; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
        scores[(g0 + g) * len + t] = _mm512_reduce_add_ps(acc);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax_inplace(scores + g * len, len);
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, group - g0);
    __m512 acc[4][NC];
    for (int64_t g = 0; g < 4; ++g)
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
      const T* vr = v_cache + slot * token_stride + kv_head * d;
      __m512 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = load16(vr + 16 * c);
      for (int64_t g = 0; g < ng; ++g) {
        const __m512 p = _mm512_set1_ps(scores[(g0 + g) * len + t]);
        for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
    for (int64_t g = 0; g < ng; ++g)
      for (int c = 0; c < NC; ++c) store16(out + (g0 + g) * out_head_stride + 16 * c, acc[g][c]);
  }
}
#endif

#ifdef PAGEDSERVE_AVX512
// All heads of one sequence at once: each key/value row ([Hkv, D], contiguous) is read whole,
// so every cache line fetched is used; rows a few tokens ahead are prefetched, across blocks.
template <typename T, int NC>
void decode_seq_vec(
    T* out, int64_t out_head_stride, const T* q, int64_t q_head_stride, const T* k_cache,
    const T* v_cache, const int32_t* blocks, int64_t len, int64_t block_size, int64_t kv_heads,
    int64_t group, float scale, std::vector<float>& buf) {
  constexpr int64_t d = 16 * NC;
  constexpr int64_t kAhead = 4;
  const int64_t heads = kv_heads * group, token_stride = kv_heads * d;
  buf.resize(heads * (len + 2 * d) + 32);
  float* scores = buf.data();         // [H, len]
  float* qf = scores + heads * len;   // [H, D]
  float* acc = qf + heads * d;        // [H, D]
  for (int64_t h = 0; h < heads; ++h)
    for (int c = 0; c < NC; ++c)
      _mm512_storeu_ps(
          qf + h * d + 16 * c,
          _mm512_mul_ps(load16(q + h * q_head_stride + 16 * c), _mm512_set1_ps(scale)));
  auto row_of = [&](const T* cache, int64_t t) {
    const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
    return cache + slot * token_stride;
  };
  auto prefetch_row = [&](const T* row) {
    const char* p = reinterpret_cast<const char*>(row);
    for (int64_t b = 0; b < token_stride * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(p + b, _MM_HINT_T0);
  };
  for (int64_t t = 0; t < len; ++t) {
    if (t + kAhead < len) prefetch_row(row_of(k_cache, t + kAhead));
    const T* kr = row_of(k_cache, t);
    for (int64_t h = 0; h < kv_heads; ++h) {
      __m512 kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = load16(kr + h * d + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        const float* qh = qf + (h * group + g) * d;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
        for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kv[c], a);
        scores[(h * group + g) * len + t] = _mm512_reduce_add_ps(a);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) softmax_inplace(scores + h * len, len);
  std::fill(acc, acc + heads * d, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kAhead < len) prefetch_row(row_of(v_cache, t + kAhead));
    const T* vr = row_of(v_cache, t);
    for (int64_t h = 0; h < kv_heads; ++h) {
      __m512 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = load16(vr + h * d + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = h * group + g;
        const __m512 p = _mm512_set1_ps(scores[head * len + t]);
        float* ah = acc + head * d;
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(ah + 16 * c, _mm512_fmadd_ps(p, vv[c], _mm512_loadu_ps(ah + 16 * c)));
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int c = 0; c < NC; ++c)
      store16(out + h * out_head_stride + 16 * c, _mm512_loadu_ps(acc + h * d + 16 * c));
}
#endif

#ifdef PAGEDSERVE_AMX
// ---- decode attention on AMX (bf16, head_dim % 32 == 0, block_size % 16 == 0) ------------
// Per (sequence, KV head), with G = query heads per KV head:
//   scores^T [16 tokens, G] = K rows (an A tile read straight from the cache, row stride =
//     the token stride) x q^T (a B tile: row r holds q[g][2r], q[g][2r+1] for each g);
//   softmax over tokens in float32, probabilities rounded to bf16 (as flash attention does);
//   out [G, 16 dims] += P [G, 32 tokens] x V (a B tile: two tokens' values interleaved per
//     dim, built from the cache rows with one permute per 16 dims; tokens past the end are 0).
// Tile registers: 0 K tile, 1 q^T, 2 scores. P x V runs in AVX-512 float32 FMAs (pv_f32):
// VDPBF16PS retired at a quarter of the FMA rate here, so bf16 pairs lost to plain FMAs.
struct DecodeAmxScratch {
  std::vector<float> scores;          // one head's scores, [len_pad]
  std::vector<float> inv_sum;         // [heads, G]
  std::vector<float> probs;           // [heads, G, len_pad], rounded to bf16 precision
  std::vector<c10::BFloat16> qt;      // [heads, D / 32, 16, G * 2]
  std::vector<float> st;              // scores as the tiles hold them: [heads, len_pad, G]
};

inline void amx_configure_decode(int64_t group) {
  TileConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = 64;
  cfg.rows[1] = 16, cfg.colsb[1] = static_cast<uint16_t>(4 * group);
  cfg.rows[2] = 16, cfg.colsb[2] = static_cast<uint16_t>(4 * group);
  load_tile_config(cfg);
}

// out[g, d0:d0+64] for NG query heads of one KV head: P [NG, len] x V in float32 FMAs, the
// 4 x NG accumulators in registers. Each value row's 32-bit words hold dims (2j, 2j+1): a
// shift and a mask widen them to float32 (even and odd dims in separate registers, put back in
// order at the end). `rows_at(t0)` gives the 16 rows from token t0 (they lie in one block).
// V streams from memory here, prefetched a tile ahead; pulled into L2 during the K pass
// instead, it queued behind K (bench/README.md, "Decode attention: V streams during P x V").
// Out of line, so the accumulators get registers of their own.
template <int NG, typename O, typename RowsAt>
__attribute__((noinline)) void pv_f32(
    O* out, int64_t out_head_stride, const float* probs, int64_t len_pad, const float* inv_sum,
    RowsAt rows_at, int64_t len, int64_t token_stride) {
  __m512 acc[NG][4];  // [g]: even dims 0-30, odd dims 1-31, even 32-62, odd 33-63
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const c10::BFloat16* rows = rows_at(t0);
    if (t0 + 16 < len) {  // the next 16 rows' 64 dims (two lines each) on their way from memory
      const char* next = reinterpret_cast<const char*>(rows_at(t0 + 16));
      for (int64_t r = 0; r < 16; ++r, next += token_stride * 2) {
        _mm_prefetch(next, _MM_HINT_T0);
        _mm_prefetch(next + 64, _MM_HINT_T0);
      }
    }
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t i = 0; i < n; ++i) {
      const c10::BFloat16* row = rows + i * token_stride;
      const __m512i w0 = _mm512_loadu_si512(row), w1 = _mm512_loadu_si512(row + 32);
      const __m512 v[4] = {
          _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(w0, odd_mask)),
          _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(w1, odd_mask))};
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g * len_pad + t0 + i]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
      }
    }
  }
  // (even, odd) -> dims in order: lanes 0-15 of (e, o) interleaved, then lanes 16-31
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int g = 0; g < NG; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    O* o = out + g * out_head_stride;
    for (int c = 0; c < 4; c += 2) {
      store16(o + 16 * c, _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][c], lo, acc[g][c + 1]), inv));
      store16(o + 16 * c + 16,
              _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][c], hi, acc[g][c + 1]), inv));
    }
  }
}

// lse, when given, receives log(sum exp(scaled scores)) per query head (indexed like the heads).
template <typename O>
void decode_heads_amx(
    O* out, int64_t out_head_stride, const c10::BFloat16* q, int64_t q_head_stride,
    const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* blocks,
    int64_t len, int64_t block_size, int64_t kv_heads, int64_t h0, int64_t h1, int64_t group,
    int64_t d, float scale, DecodeAmxScratch& s, float* lse = nullptr) {
  const int64_t token_stride = kv_heads * d, len_pad = (len + 31) / 32 * 32;
  const int64_t kchunks = d / 32, nh = h1 - h0, qt_size = 16 * group * 2;
  // The 16 rows starting at token t0 (a multiple of 16) lie in one block: heads h0..h1-1.
  auto rows_at = [&](const c10::BFloat16* cache, int64_t t0) {
    const int64_t slot = static_cast<int64_t>(blocks[t0 / block_size]) * block_size + t0 % block_size;
    return cache + slot * token_stride + h0 * d;
  };
  auto prefetch_rows = [&](const c10::BFloat16* rows, auto hint) {  // 16 rows x these heads
    const char* p = reinterpret_cast<const char*>(rows);
    for (int64_t r = 0; r < 16; ++r, p += token_stride * 2)
      for (int64_t b = 0; b < nh * d * 2; b += 64) _mm_prefetch(p + b, hint);
  };
  // q^T in B-tile layout: [head][32-dim chunk] tiles whose row r is (q[g][2r], q[g][2r+1])_g.
  s.qt.resize(nh * kchunks * qt_size);
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t c = 0; c < kchunks; ++c)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const c10::BFloat16* qg = q + ((h0 + h) * group + g) * q_head_stride + 32 * c + 2 * r;
          c10::BFloat16* dst = s.qt.data() + (h * kchunks + c) * qt_size + r * group * 2 + 2 * g;
          dst[0] = qg[0];
          dst[1] = qg[1];
        }
  // scores^T, 16 tokens per tile, kept as the tiles hold them: [head][len_pad][G].
  s.st.resize(nh * len_pad * group);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const c10::BFloat16* k0 = rows_at(k_cache, t0);
    if (t0 + 16 < len) prefetch_rows(rows_at(k_cache, t0 + 16), _MM_HINT_T0);
    for (int64_t h = 0; h < nh; ++h) {
      _tile_zero(2);
      for (int64_t c = 0; c < kchunks; ++c) {
        _tile_loadd(0, k0 + h * d + 32 * c, token_stride * 2);
        _tile_loadd(1, s.qt.data() + (h * kchunks + c) * qt_size, group * 4);
        _tile_dpbf16ps(2, 0, 1);
      }
      _tile_stored(2, s.st.data() + (h * len_pad + t0) * group, group * 4);
    }
  }
  // Softmax numerators rounded to bf16 (kept as float32), [head][G][len_pad], zero past the end;
  // 1 / sum goes on the output.
  s.scores.resize(len_pad);
  s.probs.resize(nh * group * len_pad);
  std::vector<float>& inv_sum = s.inv_sum;
  inv_sum.resize(nh * group);
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t g = 0; g < group; ++g) {
      // gather this head's column of the tiles' [token][G] layout, scaled, tracking the max
      float* sg = s.scores.data();
      const float* src = s.st.data() + h * len_pad * group + g;
      const __m512i idx = _mm512_mullo_epi32(
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi32(static_cast<int32_t>(group)));
      const __m512 vscale = _mm512_set1_ps(scale);
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 live = t + 16 <= len ? 0xffff : (1u << (len - t)) - 1;
        const __m512 v = _mm512_mul_ps(
            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, src + t * group, 4), vscale);
        _mm512_storeu_ps(sg + t, v);
        vmax = _mm512_mask_max_ps(vmax, live, vmax, v);
      }
      const float max_score = _mm512_reduce_max_ps(vmax);
      const __m512 vm = _mm512_set1_ps(max_score);
      float* pg = s.probs.data() + (h * group + g) * len_pad;
      int64_t t = 0;
      __m512 vsum = _mm512_setzero_ps();
      for (t = 0; t < len_pad; t += 16) {
        const __mmask16 live = t + 16 <= len ? 0xffff : t < len ? (1u << (len - t)) - 1 : 0;
        __m512 e = _mm512_maskz_mov_ps(
            live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + t), vm)));
        e = round_bf16(e);
        vsum = _mm512_add_ps(vsum, e);
        _mm512_storeu_ps(pg + t, e);
      }
      const float sum = _mm512_reduce_add_ps(vsum);
      inv_sum[h * group + g] = 1.0f / sum;
      if (lse) lse[(h0 + h) * group + g] = max_score + std::log(sum);
    }
  // P x V, 64 output dims and up to 4 query heads at a time.
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t d0 = 0; d0 < d; d0 += 64)
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t ng = std::min<int64_t>(4, group - g0);
        auto rows = [&](int64_t t0) { return rows_at(v_cache, t0) + h * d + d0; };
        O* o = out + ((h0 + h) * group + g0) * out_head_stride + d0;
        const float* p = s.probs.data() + (h * group + g0) * len_pad;
        const float* inv = inv_sum.data() + h * group + g0;
        switch (ng) {
          case 1: pv_f32<1>(o, out_head_stride, p, len_pad, inv, rows, len, token_stride); break;
          case 2: pv_f32<2>(o, out_head_stride, p, len_pad, inv, rows, len, token_stride); break;
          case 3: pv_f32<3>(o, out_head_stride, p, len_pad, inv, rows, len, token_stride); break;
          default: pv_f32<4>(o, out_head_stride, p, len_pad, inv, rows, len, token_stride);
        }
      }
}

// On by default; set_amx_decode(false) routes bf16 to the AVX-512 paths (tests, benchmarks).
std::atomic<bool> amx_decode_enabled{true};

// The AMX kernel applies: bf16, head_dim a multiple of 32, whole 16-token tiles per block,
// at most 16 query heads per KV head, and the process may use AMX.
bool decode_amx_applies(int64_t d, int64_t block_size, int64_t group) {
  return amx_decode_enabled.load(std::memory_order_relaxed) && d % 64 == 0 &&
         block_size % 16 == 0 && group <= 16 && amx_permitted();
}
#endif

// Picks the register-resident kernel for head_dim 64/128 on AVX-512, else the portable one.
template <typename T>
void decode_dispatch(
    T* out, int64_t out_head_stride, const T* q, int64_t q_head_stride, const T* k_cache,
    const T* v_cache, const int32_t* blocks, int64_t len, int64_t block_size, int64_t kv_heads,
    int64_t kv_head, int64_t group, int64_t d, float scale, std::vector<float>& buf) {
#ifdef PAGEDSERVE_AVX512
  if constexpr (kVec<T>) {
    if (d == 64)
      return decode_one_vec<T, 4>(
          out, out_head_stride, q, q_head_stride, k_cache, v_cache, blocks, len, block_size,
          kv_heads, kv_head, group, scale, buf);
    if (d == 128)
      return decode_one_vec<T, 8>(
          out, out_head_stride, q, q_head_stride, k_cache, v_cache, blocks, len, block_size,
          kv_heads, kv_head, group, scale, buf);
  }
#endif
  decode_one(
      out, out_head_stride, q, q_head_stride, k_cache, v_cache, blocks, len, block_size,
      kv_heads, kv_head, group, d, scale, buf);
}

// One task per sequence (all heads) when there are enough sequences to keep every thread
// busy, else one per (sequence, KV head).
template <typename T>
void decode_batch(
    T* out, int64_t out_stride, int64_t out_head_stride, const T* q, int64_t q_stride,
    int64_t q_head_stride, const T* k_cache, const T* v_cache, const int32_t* block_table,
    int64_t bt_stride, const int32_t* lens, int64_t batch, int64_t block_size, int64_t kv_heads,
    int64_t group, int64_t d, float scale) {
#ifdef PAGEDSERVE_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (decode_amx_applies(d, block_size, group)) {
      // Per sequence (all its KV heads) when the batch fills every thread, else per KV head.
      const bool per_seq = batch >= 2 * at::get_num_threads();
      const int64_t tasks = per_seq ? batch : batch * kv_heads;
      WorkQueue(tasks).run([&](WorkQueue& queue) {
        amx_configure_decode(group);
        DecodeAmxScratch scratch;
        int64_t begin, end;
        while (queue.take(begin, end)) {
          for (int64_t task = begin; task < end; ++task) {
            const int64_t b = per_seq ? task : task / kv_heads;
            const int64_t h0 = per_seq ? 0 : task % kv_heads, h1 = per_seq ? kv_heads : h0 + 1;
            decode_heads_amx(
                out + b * out_stride, out_head_stride, q + b * q_stride, q_head_stride, k_cache,
                v_cache, block_table + b * bt_stride, lens[b], block_size, kv_heads, h0, h1,
                group, d, scale, scratch);
          }
        }
        _tile_release();
      });
      return;
    }
  }
#endif
#ifdef PAGEDSERVE_AVX512
  if constexpr (kVec<T>) {
    if ((d == 64 || d == 128) && batch >= 2 * at::get_num_threads()) {
      at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> buf;
        for (int64_t b = begin; b < end; ++b) {
          auto run = d == 64 ? decode_seq_vec<T, 4> : decode_seq_vec<T, 8>;
          run(out + b * out_stride, out_head_stride, q + b * q_stride, q_head_stride, k_cache,
              v_cache, block_table + b * bt_stride, lens[b], block_size, kv_heads, group, scale,
              buf);
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t head0 = h * group;
      decode_dispatch(
          out + b * out_stride + head0 * out_head_stride, out_head_stride,
          q + b * q_stride + head0 * q_head_stride, q_head_stride, k_cache, v_cache,
          block_table + b * bt_stride, lens[b], block_size, kv_heads, h, group, d, scale, buf);
    }
  });
}

void paged_attention_decode(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
    double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [B, H, D], D contiguous");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1, "out: [B, H, D], D contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens");
  const int64_t batch = query.size(0), heads = query.size(1), d = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == d, "head shapes");
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(out.size(0) == batch && out.size(1) == heads && out.size(2) == d, "out like query");
  TORCH_CHECK(block_table.size(0) == batch && seq_lens.numel() == batch, "one row per sequence");
  TORCH_CHECK(
      out.scalar_type() == query.scalar_type() && k_cache.scalar_type() == query.scalar_type() &&
          v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
      "dtypes and cache shapes must agree");
  TORCH_CHECK(
      all_in_range(seq_lens.data_ptr<int32_t>(), batch, 1, block_table.size(1) * block_size),
      "seq_lens must be in [1, max_blocks * block_size]");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_decode", [&] {
        const scalar_t* qp = query.data_ptr<scalar_t>();
        scalar_t* op = out.data_ptr<scalar_t>();
        const scalar_t* kp = k_cache.data_ptr<scalar_t>();
        const scalar_t* vp = v_cache.data_ptr<scalar_t>();
        const int32_t* bt = block_table.data_ptr<int32_t>();
        const int32_t* lens = seq_lens.data_ptr<int32_t>();
        decode_batch(
            op, out.stride(0), out.stride(1), qp, query.stride(0), query.stride(1), kp, vp, bt,
            block_table.stride(0), lens, batch, block_size, kv_heads, group, d,
            static_cast<float>(scale));
      });
}


#ifdef PAGEDSERVE_AMX
// ---- prefill attention on AMX (bf16, head_dim 64 or 128, block_size % 16 == 0) -----------
// One task per (sequence, query head, 16 queries); query j of a sequence sits at position
// kv_len - q_len + j and sees keys 0..that position (bottom-right causal). Two passes over
// the visible keys, so no running rescale:
//   scores^T [16 keys, 16 queries] = K rows (A tile straight from the cache) x q^T (B tile:
//     row r holds (q[n][2r], q[n][2r+1]) for the 16 queries n), kept for all visible keys;
//   per query (a lane): max over keys, numerators exp(s - max) rounded to bf16, their sum;
//   out^T [16 dims, 16 queries] += V^T (A tile: 16 dims x 32 keys, from a per-(sequence,
//     KV head) transposed copy of V built once per call) x P (B tile: keys paired per query).
// Tile registers: 0-1 K, 2-3 q^T, 4-5 scores; then 0 P, 1-3 V^T, 4-7 out^T.
struct PrefillScratch {
  std::vector<float> st;              // [visible keys (padded to 32), 16]
  std::vector<c10::BFloat16> pt;      // P in B-tile layout: [keys / 2, 16 queries, 2]
  std::vector<c10::BFloat16> qt;      // [D / 32, 16, 16, 2]
  alignas(64) float ot[8][16 * 16];   // out^T tiles
};

inline void amx_configure_square() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  load_tile_config(cfg);
}

// 16 x 16 transpose of 32-bit words held in 16 vectors.
inline void transpose16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// V^T of one sequence's KV head: dst[i * pad + t] = v[t][i] for t < len, 0 for len <= t < pad
// (pad = len rounded up to 32). Per 32 keys and 16 dims: interleave each pair of rows into
// 16 words (dim i: keys 2p, 2p+1), then transpose the 16 x 16 words.
void build_vt(c10::BFloat16* dst, const c10::BFloat16* v_cache, const int32_t* blocks,
              int64_t len, int64_t block_size, int64_t token_stride, int64_t kv_head, int64_t d) {
  const int64_t pad = (len + 31) / 32 * 32;
  const __m512i lo_idx = interleave_lo16();
  auto rows_at = [&](int64_t t0) {
    const int64_t slot = static_cast<int64_t>(blocks[t0 / block_size]) * block_size + t0 % block_size;
    return v_cache + slot * token_stride + kv_head * d;
  };
  for (int64_t t0 = 0; t0 < pad; t0 += 32) {
    const c10::BFloat16* first = rows_at(t0);
    const c10::BFloat16* half[2] = {first, t0 + 16 < len ? rows_at(t0 + 16) : first};
    for (int64_t i0 = 0; i0 < d; i0 += 16) {
      __m512i r[16];
      for (int p = 0; p < 16; ++p) {
        const int64_t ta = t0 + 2 * p;
        const c10::BFloat16* ra = half[p / 8] + (2 * p % 16) * token_stride + i0;
        const __m256i a = ta < len ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra))
                                   : _mm256_setzero_si256();
        const __m256i b = ta + 1 < len
            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + token_stride))
            : _mm256_setzero_si256();
        r[p] = _mm512_permutex2var_epi16(
            _mm512_castsi256_si512(a), lo_idx, _mm512_castsi256_si512(b));
      }
      transpose16_epi32(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (i0 + i) * pad + t0, r[i]);
    }
  }
}

// `visible` keys are read (pos0 + nq for a causal block); lse, when given, receives
// log(sum exp(scaled scores)) per query.
template <int D, typename O>
void prefill_block_amx(
    O* out, int64_t out_stride, const c10::BFloat16* q, int64_t q_stride, int64_t nq,
    int64_t pos0, int64_t visible, const c10::BFloat16* k_cache, const c10::BFloat16* vt,
    int64_t vt_stride, const int32_t* blocks, int64_t block_size, int64_t token_stride,
    int64_t kv_head, float scale, PrefillScratch& s, float* lse = nullptr) {
  constexpr int64_t KC = D / 32;
  const int64_t vis_pad = (visible + 31) / 32 * 32;
  // q^T tiles (queries past nq are zero)
  s.qt.assign(KC * 512, c10::BFloat16(0.0f));
  for (int64_t n = 0; n < nq; ++n) {
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(q + n * q_stride);
    uint32_t* dst = reinterpret_cast<uint32_t*>(s.qt.data());
    for (int64_t w = 0; w < D / 2; ++w) dst[(w / 16) * 256 + (w % 16) * 16 + n] = qw[w];
  }
  // scores^T for the visible keys, 16 at a time
  s.st.resize(vis_pad * 16);
  auto k_rows = [&](int64_t t0) {
    const int64_t slot = static_cast<int64_t>(blocks[t0 / block_size]) * block_size + t0 % block_size;
    return k_cache + slot * token_stride + kv_head * D;
  };
  const int64_t kstride = token_stride * 2;
  if constexpr (D == 64) {
    _tile_loadd(2, s.qt.data(), 64);
    _tile_loadd(3, s.qt.data() + 512, 64);
  }
  int64_t t0 = 0;
  if constexpr (D == 64) {  // two 16-key chunks per round on separate tiles, so they overlap
    for (; t0 + 16 < visible; t0 += 32) {
      const c10::BFloat16* ka = k_rows(t0);
      const c10::BFloat16* kb = k_rows(t0 + 16);
      for (int64_t ahead = 32; ahead < 64; ahead += 16)
        if (t0 + ahead < visible) {
          const char* nx = reinterpret_cast<const char*>(k_rows(t0 + ahead));
          for (int r = 0; r < 16; ++r) {
            _mm_prefetch(nx + r * kstride, _MM_HINT_T0);
            _mm_prefetch(nx + r * kstride + 64, _MM_HINT_T0);
          }
        }
      _tile_zero(4);
      _tile_zero(5);
      _tile_loadd(0, ka, kstride);
      _tile_loadd(1, ka + 32, kstride);
      _tile_loadd(6, kb, kstride);
      _tile_loadd(7, kb + 32, kstride);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 6, 2);
      _tile_dpbf16ps(4, 1, 3);
      _tile_dpbf16ps(5, 7, 3);
      _tile_stored(4, s.st.data() + t0 * 16, 64);
      _tile_stored(5, s.st.data() + (t0 + 16) * 16, 64);
    }
  }
  for (; t0 < visible; t0 += 16) {
    const c10::BFloat16* k0 = k_rows(t0);
    if (t0 + 16 < visible) {
      const char* nx = reinterpret_cast<const char*>(k_rows(t0 + 16));
      for (int r = 0; r < 16; ++r) {
        _mm_prefetch(nx + r * kstride, _MM_HINT_T0);
        _mm_prefetch(nx + r * kstride + 64, _MM_HINT_T0);
      }
    }
    _tile_zero(4);
    for (int64_t c = 0; c < KC; c += 2) {
      if constexpr (D != 64) {
        _tile_loadd(2, s.qt.data() + c * 512, 64);
        _tile_loadd(3, s.qt.data() + (c + 1) * 512, 64);
      }
      _tile_loadd(0, k0 + 32 * c, kstride);
      _tile_loadd(1, k0 + 32 * (c + 1), kstride);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(4, 1, 3);
    }
    _tile_stored(4, s.st.data() + t0 * 16, 64);
  }
  // per query: causal mask, max, bf16 numerators (zero for masked and padded keys), sum
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __mmask16 valid_q = nq >= 16 ? 0xffff : static_cast<__mmask16>((1u << nq) - 1);
  auto live_lanes = [&](int64_t t) -> __mmask16 {  // queries that see key t
    if (t <= pos0) return valid_q;
    return valid_q & _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int32_t>(t - pos0)));
  };
  // max of the raw scores (scale > 0 commutes with it); e = 2^(s * scale * log2 e - max'),
  // with a cubic for 2^fraction: plenty for numerators that are rounded to bf16 anyway.
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < visible; ++t)
    vmax = _mm512_mask_max_ps(vmax, live_lanes(t), vmax, _mm512_loadu_ps(s.st.data() + t * 16));
  vmax = _mm512_mask_mov_ps(_mm512_setzero_ps(), valid_q, vmax);  // unused lanes: finite
  const __m512 k2 = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __m512 m2 = _mm512_mul_ps(vmax, k2);
  // minimax cubic for 2^f on [0, 1): relative error 7.5e-5, well under bf16's half ulp
  const __m512 c3 = _mm512_set1_ps(0.07802403f), c2 = _mm512_set1_ps(0.22606707f);
  const __m512 c1 = _mm512_set1_ps(0.69583399f), one = _mm512_set1_ps(0.99992513f);
  __m512 vsum = _mm512_setzero_ps();
  s.pt.resize(vis_pad * 16);
  const __m512i pair_idx = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
      19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t t = 0; t < vis_pad; t += 2) {
    __m512 e[2];
    for (int i = 0; i < 2; ++i) {
      const int64_t tt = t + i;
      const __mmask16 live = tt < visible ? live_lanes(tt) : 0;
      const __m512 y = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, s.st.data() + tt * 16), k2, m2);
      const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      const __m512 f = _mm512_sub_ps(y, n);
      __m512 p = _mm512_fmadd_ps(c3, f, c2);
      p = _mm512_fmadd_ps(p, f, c1);
      p = _mm512_fmadd_ps(p, f, one);
      e[i] = _mm512_maskz_scalef_ps(live, p, n);
      vsum = _mm512_add_ps(vsum, e[i]);
    }
    // (e0[n], e1[n]) pairs: B-tile row t / 2
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]);  // e0 low, e1 high
    _mm512_storeu_si512(s.pt.data() + t * 16, _mm512_permutexvar_epi16(pair_idx, both));
  }
  // out^T += V^T x P, 32 keys at a time, 64 dims per pass
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const c10::BFloat16* v0 = vt + d0 * vt_stride;
    for (int64_t t = 0; t < vis_pad; t += 32) {
      _tile_loadd(0, s.pt.data() + t * 16, 64);
      _tile_loadd(1, v0 + t, vt_stride * 2);
      _tile_dpbf16ps(4, 1, 0);
      _tile_loadd(2, v0 + 16 * vt_stride + t, vt_stride * 2);
      _tile_dpbf16ps(5, 2, 0);
      _tile_loadd(3, v0 + 32 * vt_stride + t, vt_stride * 2);
      _tile_dpbf16ps(6, 3, 0);
      _tile_loadd(1, v0 + 48 * vt_stride + t, vt_stride * 2);
      _tile_dpbf16ps(7, 1, 0);
    }
    _tile_stored(4, s.ot[d0 / 16 + 0], 64);
    _tile_stored(5, s.ot[d0 / 16 + 1], 64);
    _tile_stored(6, s.ot[d0 / 16 + 2], 64);
    _tile_stored(7, s.ot[d0 / 16 + 3], 64);
  }
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), valid_q, vsum)));
  if (lse) {
    alignas(64) float mx[16], sm[16];
    _mm512_store_ps(mx, vmax);
    _mm512_store_ps(sm, vsum);
    for (int64_t n = 0; n < nq; ++n) lse[n] = mx[n] * scale + std::log(sm[n]);
  }
  // out^T tiles [16 dims][16 queries] -> rows of out: one 16 x 16 transpose per 16 dims.
  for (int64_t j = 0; j < D / 16; ++j) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(s.ot[j] + i * 16);
    transpose16_epi32(r);
    for (int64_t n = 0; n < nq; ++n)
      store16(out + n * out_stride + 16 * j, _mm512_mul_ps(_mm512_castsi512_ps(r[n]), _mm512_set1_ps(inv[n])));
  }
}

bool prefill_amx_applies(int64_t d, int64_t block_size) {
  return (d == 64 || d == 128) && block_size % 16 == 0 && amx_permitted();
}
#endif

// Whether paged_attention_prefill can run these shapes (bf16 caches, on AMX).
bool amx_prefill_supported(int64_t head_dim, int64_t block_size) {
#ifdef PAGEDSERVE_AMX
  return prefill_amx_applies(head_dim, block_size);
#else
  return false;
#endif
}

// Attention for sequences with any number of new tokens over their paged K/V, bottom-right
// causal (see prefill_block_amx): sequence i's queries are rows q_start[i] .. q_start[i] +
// q_len[i] of query, and its output goes to the same rows of out; other rows are untouched.
void paged_attention_prefill(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& q_start,
    const at::Tensor& q_len, const at::Tensor& seq_lens, double scale) {
#ifdef PAGEDSERVE_AMX
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: [T, H, D], heads and D contiguous");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == out.size(2), "out: [T, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "bf16 only");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table");
  for (const at::Tensor* t : {&seq_lens, &q_start, &q_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "seq_lens, q_start, q_len: int32");
  const int64_t batch = seq_lens.numel(), heads = query.size(1), d = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(prefill_amx_applies(d, block_size), "shapes the AMX prefill does not cover");
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == d && v_cache.sizes() == k_cache.sizes(),
              "head shapes");
  TORCH_CHECK(q_start.numel() == batch && q_len.numel() == batch && block_table.size(0) == batch,
              "one entry per sequence");
  TORCH_CHECK(out.size(0) == query.size(0) && out.size(1) == heads && out.size(2) == d, "out like query");
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* ql = q_len.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(qs[b] >= 0 && ql[b] >= 1 && qs[b] + ql[b] <= query.size(0) && ql[b] <= lens[b] &&
                    lens[b] <= block_table.size(1) * block_size,
                "need query rows in range and 1 <= q_len <= seq_len <= max_blocks * block_size");
  const int64_t group = heads / kv_heads, token_stride = kv_heads * d;
  const auto* qp = query.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const auto* kp = k_cache.data_ptr<c10::BFloat16>();
  const auto* vp = v_cache.data_ptr<c10::BFloat16>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0);
  // V^T per (sequence, KV head): [D, len padded to 32], zero past the end.
  std::vector<int64_t> vt_off(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) vt_off[b + 1] = vt_off[b] + kv_heads * d * ((lens[b] + 31) / 32 * 32);
  // Reused across calls: a fresh multi-MB allocation per layer costs its page faults each time.
  static thread_local std::vector<c10::BFloat16> vt_buf;
  if (static_cast<int64_t>(vt_buf.size()) < vt_off[batch]) vt_buf.resize(vt_off[batch]);
  c10::BFloat16* vt = vt_buf.data();  // build_vt fills every element used
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      build_vt(vt + vt_off[b] + h * d * ((lens[b] + 31) / 32 * 32), vp, bt + b * bt_stride,
               lens[b], block_size, token_stride, h, d);
    }
  });
  // tasks: (sequence, query head, 16-query block)
  std::vector<int64_t> task_off(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) task_off[b + 1] = task_off[b] + heads * ((ql[b] + 15) / 16);
  auto run_tasks = [&](int64_t begin, int64_t end, PrefillScratch& scratch) {
    int64_t b = std::upper_bound(task_off.begin(), task_off.end(), begin) - task_off.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_off[b + 1]) ++b;
      const int64_t q_len = ql[b], len = lens[b], qblocks = (q_len + 15) / 16;
      const int64_t local = task - task_off[b], head = local / qblocks, j0 = (local % qblocks) * 16;
      const int64_t nq = std::min<int64_t>(16, q_len - j0), h = head / group;
      const int64_t pad = (len + 31) / 32 * 32, row0 = qs[b] + j0;
      auto run = d == 64 ? prefill_block_amx<64, c10::BFloat16> : prefill_block_amx<128, c10::BFloat16>;
      const int64_t pos0 = len - q_len + j0;
      run(op + row0 * out.stride(0) + head * d, out.stride(0), qp + row0 * query.stride(0) + head * d,
          query.stride(0), nq, pos0, pos0 + nq, kp, vt + vt_off[b] + h * d * pad, pad,
          bt + b * bt_stride, block_size, token_stride, h, static_cast<float>(scale), scratch, nullptr);
    }
  };
  WorkQueue(task_off[batch]).run([&](WorkQueue& queue) {
    amx_configure_square();
    PrefillScratch scratch;
    int64_t begin, end;
    while (queue.take(begin, end)) run_tasks(begin, end, scratch);
    _tile_release();
  });
#else
  TORCH_CHECK(false, "built without AMX support");
#endif
}

// ---- cascade decode: a prefix every sequence shares, then each sequence's own blocks -------
// Decoding sequences that share their first `prefix_len` tokens (the same physical blocks,
// a prefix-cache hit) read that prefix once for all of them instead of once each: per KV head
// its B x G queries go through the prefill kernel 16 at a time against the prefix (all keys
// visible), every sequence's remaining tokens through the decode kernel, and the two partial
// results are merged by their log-sum-exp in float32, rounded to bf16 once.
//   prefix_blocks [>= prefix_len / block_size] int32: the shared blocks;
//   block_table [B, *] int32 and seq_lens [B]: each sequence's blocks and tokens after them.
bool cascade_supported(int64_t head_dim, int64_t block_size, int64_t group) {
#ifdef PAGEDSERVE_AMX
  return prefill_amx_applies(head_dim, block_size) && decode_amx_applies(head_dim, block_size, group);
#else
  return false;
#endif
}

void paged_attention_cascade(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& prefix_blocks, int64_t prefix_len,
    const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
#ifdef PAGEDSERVE_AMX
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [B, H, D], D contiguous");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1, "out: [B, H, D], D contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "bf16 only");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens");
  TORCH_CHECK(prefix_blocks.scalar_type() == at::kInt && prefix_blocks.is_contiguous(),
              "prefix_blocks: int32");
  const int64_t batch = query.size(0), heads = query.size(1), d = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == d && v_cache.sizes() == k_cache.sizes(),
              "head shapes");
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(cascade_supported(d, block_size, group), "shapes the AMX cascade does not cover");
  TORCH_CHECK(out.size(0) == batch && out.size(1) == heads && out.size(2) == d, "out like query");
  TORCH_CHECK(block_table.size(0) == batch && seq_lens.numel() == batch, "one row per sequence");
  TORCH_CHECK(prefix_len >= 1 && prefix_len <= prefix_blocks.numel() * block_size,
              "prefix_len must be in [1, len(prefix_blocks) * block_size]");
  TORCH_CHECK(
      all_in_range(seq_lens.data_ptr<int32_t>(), batch, 1, block_table.size(1) * block_size),
      "seq_lens must be in [1, max_blocks * block_size]");
  const int64_t num_blocks = k_cache.size(0);
  TORCH_CHECK(all_in_range(prefix_blocks.data_ptr<int32_t>(), prefix_blocks.numel(), 0, num_blocks - 1),
              "prefix_blocks out of range");
  const auto* qp = query.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const auto* kp = k_cache.data_ptr<c10::BFloat16>();
  const auto* vp = v_cache.data_ptr<c10::BFloat16>();
  const int32_t* pb = prefix_blocks.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t token_stride = kv_heads * d, pad = (prefix_len + 31) / 32 * 32;
  const int64_t q_stride = query.stride(0), qh = query.stride(1);
  const float fscale = static_cast<float>(scale);
  // Reused across calls (see paged_attention_prefill): the prefix's V^T per KV head, and the
  // suffix results in float32 with their log-sum-exp.
  static thread_local std::vector<c10::BFloat16> vt_buf;
  static thread_local std::vector<float> os_buf, ls_buf;
  vt_buf.resize(kv_heads * d * pad);
  os_buf.resize(batch * heads * d);
  ls_buf.resize(batch * heads);
  c10::BFloat16* vt = vt_buf.data();
  float* os = os_buf.data();
  float* ls = ls_buf.data();
  // 1: V^T of the prefix per KV head, and every sequence's suffix (all heads per task).
  WorkQueue(kv_heads + batch).run([&](WorkQueue& queue) {
    bool tiles = false;
    DecodeAmxScratch scratch;
    int64_t begin, end;
    while (queue.take(begin, end)) {
      for (int64_t task = begin; task < end; ++task) {
        if (task < kv_heads) {
          build_vt(vt + task * d * pad, vp, pb, prefix_len, block_size, token_stride, task, d);
          continue;
        }
        if (!tiles) amx_configure_decode(group), tiles = true;
        const int64_t b = task - kv_heads;
        decode_heads_amx(os + b * heads * d, d, qp + b * q_stride, qh, kp, vp,
                         bt + b * block_table.stride(0), lens[b], block_size, kv_heads, 0, kv_heads,
                         group, d, fscale, scratch, ls + b * heads);
      }
    }
    if (tiles) _tile_release();
  });
  // 2: per (KV head, 16 of its B x G queries): the prefix, then the merge into out.
  const int64_t nqk = batch * group, chunks = (nqk + 15) / 16;
  WorkQueue(kv_heads * chunks).run([&](WorkQueue& queue) {
    amx_configure_square();
    PrefillScratch scratch;
    alignas(64) c10::BFloat16 qbuf[16 * 128];
    alignas(64) float obuf[16 * 128];
    float lse[16];
    int64_t seq[16], head[16];  // query n of the task: (sequence, query head)
    int64_t begin, end;
    while (queue.take(begin, end)) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / chunks, i0 = (task % chunks) * 16;
        const int64_t nq = std::min<int64_t>(16, nqk - i0);
        for (int64_t n = 0; n < nq; ++n) {
          seq[n] = (i0 + n) / group, head[n] = h * group + (i0 + n) % group;
          std::memcpy(qbuf + n * d, qp + seq[n] * q_stride + head[n] * qh, d * sizeof(c10::BFloat16));
        }
        auto run = d == 64 ? prefill_block_amx<64, float> : prefill_block_amx<128, float>;
        run(obuf, d, qbuf, d, nq, prefix_len - 1, prefix_len, kp, vt + h * d * pad, pad, pb,
            block_size, token_stride, h, fscale, scratch, lse);
        for (int64_t n = 0; n < nq; ++n) {
          const int64_t b = seq[n];
          const float lp = lse[n], lsfx = ls[b * heads + head[n]], m = std::max(lp, lsfx);
          const float wp = std::exp(lp - m), ws = std::exp(lsfx - m), inv = 1.0f / (wp + ws);
          const __m512 vp_ = _mm512_set1_ps(wp * inv), vs_ = _mm512_set1_ps(ws * inv);
          const float* sfx = os + (b * heads + head[n]) * d;
          c10::BFloat16* dst = op + b * out.stride(0) + head[n] * out.stride(1);
          for (int64_t i = 0; i < d; i += 16)
            store16(dst + i, _mm512_fmadd_ps(_mm512_loadu_ps(obuf + n * d + i), vp_,
                                             _mm512_mul_ps(_mm512_loadu_ps(sfx + i), vs_)));
        }
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "built without AMX support");
#endif
}

// ---- greedy sampling: argmax per row --------------------------------------------------------
// out[i] = the first index of the largest value in row i of x (float32), NaN counting as the
// largest, as torch.argmax does; one pass with per-lane maxima instead of torch's scalar loop.
int64_t argmax_row(const float* x, int64_t n) {
#ifdef PAGEDSERVE_AVX512
  if (n >= 16) {
    __m512 best = _mm512_loadu_ps(x);
    __m512i best_i = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i idx = best_i;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      idx = _mm512_add_epi32(idx, step);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strict: first index stays
      best = _mm512_mask_mov_ps(best, gt, v);
      best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (!nan) {
      alignas(64) float bv[16];
      alignas(64) int32_t bi[16];
      _mm512_store_ps(bv, best);
      _mm512_store_si512(bi, best_i);
      float m = bv[0];
      int64_t arg = bi[0];
      for (int l = 1; l < 16; ++l)
        if (bv[l] > m || (bv[l] == m && bi[l] < arg)) m = bv[l], arg = bi[l];
      for (; i < n; ++i)
        if (std::isnan(x[i])) return i;
        else if (x[i] > m) m = x[i], arg = i;
      return arg;
    }
  }
#endif
  int64_t arg = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[arg]) arg = i;
  }
  return arg;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "x: [N, V] float32, rows contiguous, V > 0");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "rows longer than int32 indices");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, (int64_t{1} << 16) / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

// ---- small-batch bf16 linear on AMX ------------------------------------------------------
// out[M, N] = x[M, K] @ W[N, K]^T for decode-sized M, where oneDNN's per-call overhead
// dominates. W is packed once into AMX's B-tile layout: for each 16 output columns and 32 k,
// a 16 x 64-byte tile whose row r holds (W[n][k0+2r], W[n][k0+2r+1]) for n in 0..15.

// Whether bf16 decode attention may use AMX; returns the previous setting.
bool set_amx_decode(bool enabled) {
#ifdef PAGEDSERVE_AMX
  return amx_decode_enabled.exchange(enabled);
#else
  return false;
#endif
}

bool amx_available() {
#ifdef PAGEDSERVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor amx_pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w: [N, K] bfloat16");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % 16 == 0 && k % 32 == 0, "AMX packing needs N % 16 == 0 and K % 32 == 0");
  // [N/16, K/32, 16 (k pairs), 16 (n), 2] as a view of w
  return w.contiguous().view({n / 16, 16, k / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

void amx_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed) {
#ifdef PAGEDSERVE_AMX
  TORCH_CHECK(amx_permitted(), "AMX is not available to this process");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "bf16");
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(
      packed.dim() == 5 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
      "packed must come from amx_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), nt = packed.size(0), kt = packed.size(1);
  TORCH_CHECK(kt * 32 == k && out.size(1) == nt * 16 && out.size(0) == m, "shapes");
  const int64_t m_pad = (m + 15) / 16 * 16;
  // A tiles read 16 full rows straight from x; a last partial tile reads a zero-padded copy.
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), full_rows = m / 16 * 16;
  std::vector<c10::BFloat16> tail(16 * k, c10::BFloat16(0.0f));
  for (int64_t r = full_rows; r < m; ++r)
    std::memcpy(tail.data() + (r - full_rows) * k, xp + r * ldx, k * sizeof(c10::BFloat16));
  auto a_tile = [&](int64_t m0) -> std::pair<const c10::BFloat16*, int64_t> {
    if (m0 < full_rows) return {xp + m0 * ldx, ldx * 2};
    return {tail.data(), k * 2};
  };
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t os = out.stride(0);
  const int64_t n_chunks = (nt + 1) / 2;  // 32 output columns (two B tiles) per chunk
  // Rows go in passes small enough for their slice of x to stay in L2 while every weight
  // chunk streams past it; within a pass the threads take ranges of output columns in turn.
  const int64_t rows_per_pass = std::max<int64_t>(32, (256 * 1024 / (2 * k)) / 32 * 32);
  for (int64_t pass = 0; pass < m_pad; pass += rows_per_pass) {
    const int64_t pass_end = std::min(m_pad, pass + rows_per_pass);
    const auto* w_bytes = reinterpret_cast<const char*>(wp);
    auto chunk_bytes = [&](int64_t chunk) {
      return w_bytes + std::min(2 * chunk, nt) * kt * 1024;
    };
    // Decode-sized rows: the weights stream into L2 one chunk ahead of use, 16 lines (one tile)
    // per dot step in both passes, so memory stays busy while rows 16-31 run from cache; at the
    // end of a thread's range of chunks it runs on into the next range that thread has taken.
    struct Stream {
      const char *at = nullptr, *end = nullptr, *next = nullptr, *next_end = nullptr;
      inline void advance() {
        for (int line = 0; line < 16; ++line, at += 64) {
          if (at >= end) {
            if (next == nullptr) return;
            at = next, end = next_end, next = nullptr;
          }
          _mm_prefetch(at, _MM_HINT_T1);
        }
      }
    };
    // Output columns [begin, end) in 32-column chunks, in this thread's tile configuration.
    auto run_chunks = [&](int64_t begin, int64_t end, Stream& stream, float (*cbuf)[16 * 16]) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        const int64_t n0 = chunk * 2;
        const bool two = n0 + 1 < nt;
        const c10::BFloat16* b0 = wp + n0 * kt * 512;
        const c10::BFloat16* b1 = b0 + kt * 512;
        // B streams from memory: fetch ahead, into this thread's next chunk near the end
        // (chunks lie back to back: its tiles start 2 * kt tiles after this one's)
        auto prefetch_b = [&](int64_t kb) {
          const int64_t ahead = kb + kPrefetchTiles;
          if (ahead < kt || (chunk + 1 < end && ahead < 2 * kt)) {
            const c10::BFloat16* f = ahead < kt ? b0 + ahead * 512 : b0 + (kt + ahead) * 512;
            const char* f0 = reinterpret_cast<const char*>(f);
            const char* f1 = reinterpret_cast<const char*>(f + kt * 512);
            const bool next_two = ahead < kt ? two : n0 + 3 < nt;
            for (int line = 0; line < 1024; line += 64) {
              _mm_prefetch(f0 + line, _MM_HINT_T0);
              if (next_two) _mm_prefetch(f1 + line, _MM_HINT_T0);
            }
          }
        };
        // C tiles 0 (and 1) += 16 rows of x (A tile 4) x the chunk's K-step kb (B tiles 6, 7)
        auto dot_rows = [&](const c10::BFloat16* a, int64_t lda, int64_t kb) {
          _tile_loadd(4, a + kb * 32, lda);
          _tile_loadd(6, b0 + kb * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two) {
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
        };
        for (int64_t m0 = pass; m0 < pass_end; m0 += 32) {
          const bool two_m = m0 + 16 < pass_end;
          if (two_m && pass_end - pass <= 32) {
            // Decode-sized (17-32 rows): the first 16 rows read the chunk's weights, the next 16
            // read them back from cache. Both row tiles in one loop ran 1.10-1.14x slower: their
            // extra dot products held up the stream. The stream above keeps pace across both
            // passes (two tiles per step in the first, none in the second left memory idle).
            for (int64_t mi = 0; mi < 2; ++mi) {
              const auto [a, lda] = a_tile(m0 + 16 * mi);
              _tile_zero(0);
              _tile_zero(1);
              for (int64_t kb = 0; kb < kt; ++kb) {
                stream.advance();
                dot_rows(a, lda, kb);
              }
              _tile_stored(0, cbuf[2 * mi], 64);
              if (two) _tile_stored(1, cbuf[2 * mi + 1], 64);
            }
          } else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const auto [a0, lda0] = a_tile(m0);
            const auto [a1, lda1] = two_m ? a_tile(m0 + 16) : a_tile(m0);
            for (int64_t kb = 0; kb < kt; ++kb) {
              if (m0 == pass) prefetch_b(kb);
              dot_rows(a0, lda0, kb);  // keeps the chunk's B tiles in 6 and 7 for rows 16-31
              if (two_m) {
                _tile_loadd(5, a1 + kb * 32, lda1);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
              }
            }
            _tile_stored(0, cbuf[0], 64);
            if (two) _tile_stored(1, cbuf[1], 64);
            if (two_m) {
              _tile_stored(2, cbuf[2], 64);
              if (two) _tile_stored(3, cbuf[3], 64);
            }
          }
          for (int64_t mi = 0; mi < 2; ++mi) {
            for (int64_t r = 0; r < 16; ++r) {
              const int64_t row = m0 + mi * 16 + r;
              if (row >= m || (mi == 1 && !two_m)) break;
              c10::BFloat16* orow = op + row * os + n0 * 16;
              store16(orow, _mm512_loadu_ps(cbuf[mi * 2] + r * 16));
              if (two) store16(orow + 16, _mm512_loadu_ps(cbuf[mi * 2 + 1] + r * 16));
            }
          }
        }
      }
    };
    WorkQueue(n_chunks).run([&](WorkQueue& queue) {
      amx_configure();
      alignas(64) float cbuf[4][16 * 16];
      Stream stream;
      int64_t begin, end;
      bool have = queue.take(begin, end);
      if (have) stream.at = chunk_bytes(std::min(begin + 1, end)), stream.end = chunk_bytes(end);
      while (have) {  // the next range is taken first, so the weight stream can run on into it
        int64_t next_begin, next_end;
        const bool more = queue.take(next_begin, next_end);
        if (more) stream.next = chunk_bytes(next_begin), stream.next_end = chunk_bytes(next_end);
        run_chunks(begin, end, stream, cbuf);
        begin = next_begin, end = next_end, have = more;
      }
      _tile_release();
    });
  }
#else
  TORCH_CHECK(false, "built without AMX support");
#endif
}

// ---- one decode step through every decoder layer ----------------------------------------
// A Llama-family decode step (one new token per sequence, at most 32 rows) through all layers,
// calling the kernels above in the order engine/models/llama.py calls them, with no Python in
// between (~2 ms per SmolLM2 step of glue). weights: six per layer, [input norm, qkv, o,
// post-attention norm, gate_up, down], the linears packed by amx_pack_weight; caches: [k, v]
// per layer. Attention takes the cascade kernel when cascade_prefix_len > 0 (prefix_blocks,
// suffix_table, suffix_lens as TorchAttentionBackend prepares them), else the decode kernel.
// embeds is the residual stream and is overwritten; returns the final norm's output.
at::Tensor decode_layers(
    const at::Tensor& embeds, const at::Tensor& positions, const at::Tensor& cos_sin,
    const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& caches,
    const at::Tensor& final_norm, const at::Tensor& slot_mapping, const at::Tensor& block_table,
    const at::Tensor& seq_lens, int64_t cascade_prefix_len, const at::Tensor& prefix_blocks,
    const at::Tensor& suffix_table, const at::Tensor& suffix_lens, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(caches.size() == static_cast<size_t>(2 * layers) &&
                  weights.size() == static_cast<size_t>(6 * layers),
              "six weights and two caches per layer");
  TORCH_CHECK(embeds.dim() == 2 && embeds.is_contiguous() && embeds.size(0) <= 32,
              "embeds: [tokens <= 32, hidden], contiguous");
  const int64_t tokens = embeds.size(0), hidden = embeds.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const auto opts = embeds.options();
  const at::Tensor& residual = embeds;
  at::Tensor x = at::empty_like(embeds);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + 6 * l;
    const at::Tensor& k_cache = caches[2 * l];
    const at::Tensor& v_cache = caches[2 * l + 1];
    if (l == 0) {
      rms_norm(x, residual, w[0], eps);
    } else {
      fused_add_rms_norm(x, residual, w[0], eps);
    }
    const int64_t qkv_cols = q_size + 2 * kv_size;
    at::Tensor qkv = at::empty({tokens, qkv_cols}, opts);
    amx_linear(qkv, x, w[1]);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    rotary_embedding(positions, q, k, cos_sin);
    write_kv(k, v, k_cache, v_cache, slot_mapping);
    at::Tensor attn = at::empty({tokens, num_heads, head_dim}, opts);
    if (cascade_prefix_len > 0) {
      paged_attention_cascade(attn, q, k_cache, v_cache, prefix_blocks, cascade_prefix_len,
                              suffix_table, suffix_lens, scale);
    } else {
      paged_attention_decode(attn, q, k_cache, v_cache, block_table, seq_lens, scale);
    }
    x = at::empty({tokens, hidden}, opts);
    amx_linear(x, attn.view({tokens, q_size}), w[2]);
    fused_add_rms_norm(x, residual, w[3], eps);
    at::Tensor gate_up = at::empty({tokens, w[4].size(0) * 16}, opts);
    amx_linear(gate_up, x, w[4]);
    at::Tensor h = at::empty({tokens, gate_up.size(1) / 2}, opts);
    silu_and_mul(h, gate_up);
    x = at::empty({tokens, hidden}, opts);
    amx_linear(x, h, w[5]);
  }
  fused_add_rms_norm(x, residual, final_norm, eps);
  return x;
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("rms_norm", &rms_norm);
  m.def("fused_add_rms_norm", &fused_add_rms_norm);
  m.def("rotary_embedding", &rotary_embedding);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("write_kv", &write_kv);
  m.def("paged_attention_decode", &paged_attention_decode);
  m.def("amx_available", &amx_available);
  m.def("set_amx_decode", &set_amx_decode);
  m.def("amx_prefill_supported", &amx_prefill_supported);
  m.def("paged_attention_prefill", &paged_attention_prefill);
  m.def("cascade_supported", &cascade_supported);
  m.def("paged_attention_cascade", &paged_attention_cascade);
  m.def("argmax_rows", &argmax_rows);
  m.def("amx_pack_weight", &amx_pack_weight);
  m.def("amx_linear", &amx_linear);
  m.def("decode_layers", &decode_layers);
}
