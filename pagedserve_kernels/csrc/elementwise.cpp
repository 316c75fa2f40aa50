// Elementwise kernels, one pass over memory each where torch needs several:
//   rms_norm, fused_add_rms_norm   Llama RMSNorm (Hugging Face's rounding), residual add fused
//   rotary_embedding                rotate-half RoPE in place on q and k, from a cos|sin cache
//   silu_and_mul                    SwiGLU: silu(x[:, :I]) * x[:, I:]
//   write_kv                        new tokens' K and V into their cache slots
#include "common.h"
#include "ops.h"

namespace pagedserve_cpu {
namespace {

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

template <typename T>
void add_rms_norm_row(T* x, T* residual, const T* w, int64_t n, float eps) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  if constexpr (kVec<T>)
    for (; i + 16 <= n; i += 16)
      store16(residual + i, _mm512_add_ps(load16(x + i), load16(residual + i)));
#endif
  for (; i < n; ++i) residual[i] = from_f<T>(to_f(x[i]) + to_f(residual[i]));
  rms_norm_row(x, residual, w, n, eps);
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

}  // namespace

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

// k_cache / v_cache [blocks, block_size, kv_heads, D] at flat slot s <- key / value
// [T, kv_heads, D] row t: what index_copy_ on the caches' [slots, kv_heads, D] view does,
// without its per-call setup, which outweighs the copy at decode sizes (bench/README.md,
// "Small ops at decode size").
void write_kv(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key, value: [T, kv_heads, D]");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2),
              "key: heads contiguous per token");
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
  const int64_t ks = key.stride(0) * key.element_size();
  const int64_t vs = value.stride(0) * value.element_size();
  at::parallel_for(0, tokens, row_grain(2 * row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
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

}  // namespace pagedserve_cpu
