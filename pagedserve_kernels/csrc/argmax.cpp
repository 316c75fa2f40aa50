// argmax_rows: greedy sampling, the argmax of every row of the logits.
#include <ATen/ops/empty.h>

#include "common.h"
#include "ops.h"

namespace pagedserve_cpu {
namespace {

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

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "x: [N, V] float32, rows contiguous, V > 0");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "rows longer than int32 indices");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / n);
  at::parallel_for(0, x.size(0), grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

}  // namespace pagedserve_cpu
