// lora: the batched LoRA contribution of one linear, added in place (engine/layers/lora.py).
//   lora_add  y[t] += scale[s] * B_s (A_s x[t]) for every token t of slot s >= 0 (-1: base)
// Slot s of a linear with P stacked outputs (q/k/v: 3, gate/up: 2, else 1) and rank r holds
// its A rows in a_all[s*P*r, (s+1)*P*r) ([S*P*r, in]) and B transposed in the same rows of
// bt_all ([S*P*r, out]): row s*P*r + p*r + j is column j of part p's B, non-zero only over part
// p's outputs, so the expand reads just that range. Tokens are taken by slot in groups of up to
// four (BGMV, each group reading its slot's A and B once): the shrink is P*r dot products over
// the group's rows in float32, the expand sums each 16-output chunk over the part's r rows in
// registers and adds it to y once (one rounding). Base tokens and zero scalings cost nothing.
// Vector bodies for float and bf16 on AVX-512 (no AMX), a scalar body elsewhere.
#include "common.h"
#include "ops.h"

namespace pagedserve_cpu {
namespace {

constexpr int kGroup = 4;  // tokens of one slot that share each load of A and B

// One group of G tokens of one slot: xf [G][in] float32 rows, scale the slot's scaling.
// shrink: s[g][j] = scale * A[j] . x[g]; expand: y[g][part p] += sum_j s[g][j] Bt[j][part p],
// each 16-output chunk summed in registers over the part's r rows, B loaded once for G tokens.
template <typename T, int G>
void group_add(T* const* y_rows, const float* xf, const T* a, const T* bt, float scale,
               int64_t in, int64_t out, const std::vector<int64_t>& sizes, int64_t rank,
               float* s) {
  const int64_t width = static_cast<int64_t>(sizes.size()) * rank;
  for (int64_t j = 0; j < width; ++j) {
    const T* row = a + j * in;
    float sum[G] = {};
    int64_t k = 0;
#if defined(PAGEDSERVE_AVX512)
    if constexpr (kVec<T>) {
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (; k + 16 <= in; k += 16) {
        const __m512 av = load16(row + k);
        for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(av, _mm512_loadu_ps(xf + g * in + k), acc[g]);
      }
      for (int g = 0; g < G; ++g) sum[g] = _mm512_reduce_add_ps(acc[g]);
    }
#endif
    for (; k < in; ++k) {
      const float av = to_f(row[k]);
      for (int g = 0; g < G; ++g) sum[g] += av * xf[g * in + k];
    }
    for (int g = 0; g < G; ++g) s[g * width + j] = scale * sum[g];
  }
  int64_t start = 0;
  for (size_t p = 0; p < sizes.size(); ++p) {
    const int64_t n = sizes[p], j0 = static_cast<int64_t>(p) * rank;
    const T* b = bt + j0 * out + start;
    int64_t o = 0;
#if defined(PAGEDSERVE_AVX512)
    if constexpr (kVec<T>) {
      for (; o + 16 <= n; o += 16) {
        __m512 acc[G];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        for (int64_t j = 0; j < rank; ++j) {
          const __m512 bv = load16(b + j * out + o);
          for (int g = 0; g < G; ++g) {
            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * width + j0 + j]), bv, acc[g]);
          }
        }
        for (int g = 0; g < G; ++g) {
          T* yo = y_rows[g] + start + o;
          store16(yo, _mm512_add_ps(load16(yo), acc[g]));
        }
      }
    }
#endif
    for (; o < n; ++o) {
      float acc[G] = {};
      for (int64_t j = 0; j < rank; ++j) {
        const float bv = to_f(b[j * out + o]);
        for (int g = 0; g < G; ++g) acc[g] += s[g * width + j0 + j] * bv;
      }
      for (int g = 0; g < G; ++g) {
        T* yo = y_rows[g] + start + o;
        *yo = from_f<T>(to_f(*yo) + acc[g]);
      }
    }
    start += n;
  }
}

template <typename T>
void lora_add_impl(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a_all,
                   const at::Tensor& bt_all, const int64_t* slots, const float* scaling,
                   const std::vector<int64_t>& sizes, int64_t rank) {
  const int64_t tokens = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t width = static_cast<int64_t>(sizes.size()) * rank;
  // the adapted tokens by slot, then in groups of up to kGroup of one slot
  std::vector<int64_t> order;
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] >= 0 && scaling[slots[t]] != 0.0f) order.push_back(t);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t u, int64_t v) { return slots[u] < slots[v]; });
  std::vector<std::pair<int64_t, int64_t>> groups;  // [begin, end) in order
  for (size_t i = 0; i < order.size();) {
    size_t e = i;
    while (e < order.size() && e - i < kGroup && slots[order[e]] == slots[order[i]]) ++e;
    groups.emplace_back(i, e);
    i = e;
  }
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T* ap = a_all.data_ptr<T>();
  const T* bp = bt_all.data_ptr<T>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  const int64_t work = kGroup * width * (in + out);  // multiply-adds per group
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(work, 1));
  at::parallel_for(0, static_cast<int64_t>(groups.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(kGroup * in), s(kGroup * width);
    for (int64_t gi = begin; gi < end; ++gi) {
      const auto [i0, i1] = groups[gi];
      const int n = static_cast<int>(i1 - i0);
      const int64_t slot = slots[order[i0]];
      T* rows[kGroup];
      for (int g = 0; g < n; ++g) {
        const int64_t t = order[i0 + g];
        rows[g] = yp + t * y_stride;
        const T* xt = xp + t * x_stride;
        for (int64_t k = 0; k < in; ++k) xf[g * in + k] = to_f(xt[k]);
      }
      const T* a = ap + slot * width * in;
      const T* b = bp + slot * width * out;
      const float sc = scaling[slot];
      switch (n) {
        case 4: group_add<T, 4>(rows, xf.data(), a, b, sc, in, out, sizes, rank, s.data()); break;
        case 3: group_add<T, 3>(rows, xf.data(), a, b, sc, in, out, sizes, rank, s.data()); break;
        case 2: group_add<T, 2>(rows, xf.data(), a, b, sc, in, out, sizes, rank, s.data()); break;
        default: group_add<T, 1>(rows, xf.data(), a, b, sc, in, out, sizes, rank, s.data());
      }
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
