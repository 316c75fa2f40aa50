// lora: the batched LoRA contribution of one linear, added in place (engine/layers/lora.py).
//   lora_add  y[t] += scale[s] * B_s (A_s x[t]) for every token t of slot s >= 0 (-1: base)
// Slot s of a linear with P stacked outputs (q/k/v: 3, gate/up: 2, else 1) and rank r holds
// its A rows in a_all[s*P*r, (s+1)*P*r) ([S*P*r, in]) and B transposed in the same rows of
// bt_all ([S*P*r, out]): row s*P*r + p*r + j is column j of part p's B, non-zero only over part
// p's outputs, so the expand reads just that range. One token at a time (BGMV): the shrink is
// P*r dot products over x[t], the expand P*r axpys into a float32 row, added to y[t] once (one
// rounding). Base tokens and zero scalings cost nothing. Vector bodies for float and bf16 on
// AVX-512 (no AMX), a scalar body elsewhere.
#include "common.h"
#include "ops.h"

namespace pagedserve_cpu {
namespace {

template <typename T>
PAGEDSERVE_INLINE float dot_row(const T* a, const float* x, int64_t n) {
  int64_t k = 0;
  float sum = 0.0f;
#if defined(PAGEDSERVE_AVX512)
  if constexpr (kVec<T>) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; k + 32 <= n; k += 32) {
      acc0 = _mm512_fmadd_ps(load16(a + k), _mm512_loadu_ps(x + k), acc0);
      acc1 = _mm512_fmadd_ps(load16(a + k + 16), _mm512_loadu_ps(x + k + 16), acc1);
    }
    for (; k + 16 <= n; k += 16) {
      acc0 = _mm512_fmadd_ps(load16(a + k), _mm512_loadu_ps(x + k), acc0);
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
  for (; k < n; ++k) sum += to_f(a[k]) * x[k];
  return sum;
}

// acc[0..n) += c * b[0..n)
template <typename T>
PAGEDSERVE_INLINE void axpy_row(float* acc, float c, const T* b, int64_t n) {
  int64_t o = 0;
#if defined(PAGEDSERVE_AVX512)
  if constexpr (kVec<T>) {
    const __m512 cv = _mm512_set1_ps(c);
    for (; o + 16 <= n; o += 16) {
      _mm512_storeu_ps(acc + o, _mm512_fmadd_ps(cv, load16(b + o), _mm512_loadu_ps(acc + o)));
    }
  }
#endif
  for (; o < n; ++o) acc[o] += c * to_f(b[o]);
}

// y[0..n) += acc[0..n), rounded once to T
template <typename T>
PAGEDSERVE_INLINE void add_row(T* y, const float* acc, int64_t n) {
  int64_t o = 0;
#if defined(PAGEDSERVE_AVX512)
  if constexpr (kVec<T>) {
    for (; o + 16 <= n; o += 16) store16(y + o, _mm512_add_ps(load16(y + o), load16(acc + o)));
  }
#endif
  for (; o < n; ++o) y[o] = from_f<T>(to_f(y[o]) + acc[o]);
}

template <typename T>
void lora_add_impl(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a_all,
                   const at::Tensor& bt_all, const int64_t* slots, const float* scaling,
                   const std::vector<int64_t>& sizes, int64_t rank) {
  const int64_t tokens = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t parts = static_cast<int64_t>(sizes.size()), width = parts * rank;
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T* ap = a_all.data_ptr<T>();
  const T* bp = bt_all.data_ptr<T>();
  const int64_t work = width * (in + out);  // multiply-adds per adapted token
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(work, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in), shrunk(width), acc(out);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slots[t];
      if (s < 0 || scaling[s] == 0.0f) continue;
      const T* xt = xp + t * x_stride;
      for (int64_t k = 0; k < in; ++k) xf[k] = to_f(xt[k]);
      const T* a = ap + s * width * in;
      for (int64_t j = 0; j < width; ++j) shrunk[j] = scaling[s] * dot_row(a + j * in, xf.data(), in);
      std::fill(acc.begin(), acc.end(), 0.0f);
      const T* b = bp + s * width * out;
      int64_t start = 0;
      for (int64_t p = 0; p < parts; ++p) {
        for (int64_t j = p * rank; j < (p + 1) * rank; ++j) {
          if (shrunk[j] != 0.0f) axpy_row(acc.data() + start, shrunk[j], b + j * out + start, sizes[p]);
        }
        start += sizes[p];
      }
      add_row(yp + t * y_stride, acc.data(), out);
    }
  });
}

}  // namespace

void lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a_all,
              const at::Tensor& bt_all, const at::Tensor& token_slots,
              const at::Tensor& slot_scaling, at::IntArrayRef part_sizes, int64_t max_rank) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "lora_add: x [tokens, in] and y [tokens, out]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_add: x and y need contiguous rows");
  TORCH_CHECK(a_all.is_contiguous() && bt_all.is_contiguous(), "lora_add: contiguous stacks");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a_all.scalar_type() == x.scalar_type() &&
                  bt_all.scalar_type() == x.scalar_type(),
              "lora_add: x, y, a_all and bt_all share one dtype");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.is_contiguous() &&
                  token_slots.numel() == x.size(0),
              "lora_add: token_slots int64 [tokens]");
  TORCH_CHECK(slot_scaling.scalar_type() == at::kFloat && slot_scaling.is_contiguous(),
              "lora_add: slot_scaling float32 [slots]");
  std::vector<int64_t> sizes(part_sizes.begin(), part_sizes.end());
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  const int64_t width = static_cast<int64_t>(sizes.size()) * max_rank;
  const int64_t num_slots = slot_scaling.numel();
  TORCH_CHECK(total == y.size(1), "lora_add: part sizes must add up to y's width");
  TORCH_CHECK(a_all.dim() == 2 && a_all.size(1) == x.size(1) && a_all.size(0) >= num_slots * width,
              "lora_add: a_all [slots * parts * rank, in]");
  TORCH_CHECK(bt_all.dim() == 2 && bt_all.size(1) == y.size(1) && bt_all.size(0) == a_all.size(0),
              "lora_add: bt_all [slots * parts * rank, out]");
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < token_slots.numel(); ++t) {
    TORCH_CHECK(slots[t] < num_slots, "lora_add: token ", t, " has slot ", slots[t], " of ",
                num_slots);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_add", [&] {
    lora_add_impl<scalar_t>(y, x, a_all, bt_all, slots, slot_scaling.data_ptr<float>(), sizes,
                            max_rank);
  });
}

}  // namespace pagedserve_cpu
