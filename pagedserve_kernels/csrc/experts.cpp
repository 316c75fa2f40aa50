// Mixture-of-experts SwiGLU on the AMX linears: moe_experts.
// One call runs every expert that has routed rows: the rows grouped by expert (a counting sort
// that keeps token order), per expert gate_up (amx_linear), silu_and_mul, down (amx_linear) on
// its rows only, then each token's terms weight * y added in ascending expert order with a
// bf16 rounding after each product and each add: the sums engine/layers/experts.py's oracle
// and transformers' per-expert index_add_ make. An expert no row chose costs nothing.
#include <ATen/ops/empty.h>

#include "common.h"
#include "ops.h"

namespace pagedserve_cpu {
namespace {

// out[h] = bf16(y[h] * w) on the first term, bf16(out[h] + bf16(y[h] * w)) after it.
void add_term(c10::BFloat16* out, const c10::BFloat16* y, float w, int64_t n, bool first) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 wv = _mm512_set1_ps(w);
  for (; i + 16 <= n; i += 16) {
    __m512 term = round_bf16(_mm512_mul_ps(load16(y + i), wv));
    store16(out + i, first ? term : _mm512_add_ps(load16(out + i), term));
  }
#endif
  for (; i < n; ++i) {
    const float term = to_f(from_f<c10::BFloat16>(to_f(y[i]) * w));
    out[i] = from_f<c10::BFloat16>(first ? term : to_f(out[i]) + term);
  }
}

void check_moe_args(
    const at::Tensor& out, const at::Tensor& x, const at::Tensor& expert_ids,
    const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "bf16");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must be shaped like x [T, H]");
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && expert_ids.is_contiguous() &&
                  expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0),
              "expert_ids: [T, k] int64, contiguous");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                  weights.sizes() == expert_ids.sizes(),
              "weights: [T, k] float32, contiguous");
  TORCH_CHECK(gate_up.dim() == 6 && down.dim() == 6 && gate_up.size(0) == down.size(0),
              "gate_up, down: [E, ...] stacks of amx_pack_weight");
  // packed [E, N/16, K/32, 16, 16, 2]: gate_up N = 2I, K = H; down N = H, K = I
  TORCH_CHECK(gate_up.size(2) * 32 == x.size(1) && down.size(1) * 16 == x.size(1) &&
                  gate_up.size(1) * 16 == 2 * down.size(2) * 32,
              "gate_up must be [E] x [2I, H] and down [E] x [H, I] packed");
}

}  // namespace

void moe_experts(
    const at::Tensor& out, const at::Tensor& x, const at::Tensor& expert_ids,
    const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down) {
  check_moe_args(out, x, expert_ids, weights, gate_up, down);
  const int64_t tokens = x.size(0), top_k = expert_ids.size(1), hidden = x.size(1);
  const int64_t num_experts = gate_up.size(0), inter = down.size(2) * 32;
  const int64_t pairs = tokens * top_k;
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  TORCH_CHECK(all_in_range(ids, pairs, 0, num_experts - 1), "expert id out of range");
  if (top_k == 0) {
    out.zero_();
    return;
  }
  // pair p = t * top_k + j sits at row pos[p] of the grouped buffers; expert e owns rows
  // [start[e], start[e + 1])
  std::vector<int64_t> start(num_experts + 1, 0), pos(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  const auto opts = x.options();
  at::Tensor rows = at::empty({pairs, hidden}, opts);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* rp = rows.data_ptr<c10::BFloat16>();
  for (int64_t p = 0; p < pairs; ++p) {
    pos[p] = fill[ids[p]]++;
    std::memcpy(rp + pos[p] * hidden, xp + (p / top_k) * x.stride(0), hidden * 2);
  }
  at::Tensor gu = at::empty({pairs, 2 * inter}, opts);
  at::Tensor act = at::empty({pairs, inter}, opts);
  at::Tensor ys = at::empty({pairs, hidden}, opts);
  std::vector<int64_t> active;  // the experts with rows, in expert order
  for (int64_t e = 0; e < num_experts; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  auto run_expert = [&](int64_t e) {
    const int64_t n = start[e + 1] - start[e];
    at::Tensor gu_e = gu.narrow(0, start[e], n), act_e = act.narrow(0, start[e], n);
    amx_linear(gu_e, rows.narrow(0, start[e], n), gate_up.select(0, e));
    silu_and_mul(act_e, gu_e);
    amx_linear(ys.narrow(0, start[e], n), act_e, down.select(0, e));
  };
  const int64_t num_active = static_cast<int64_t>(active.size());
  if (num_active >= at::get_num_threads()) {
    // one parallel region: each thread takes whole experts (their GEMMs then run on it alone,
    // nested regions run inline), instead of two regions per expert
    WorkQueue(num_active).run([&](WorkQueue& queue) {
      int64_t begin, end;
      while (queue.take(begin, end))
        for (int64_t i = begin; i < end; ++i) run_expert(active[i]);
    });
  } else {
    for (const int64_t e : active) run_expert(e);  // few experts: their columns split instead
  }
  const float* wp = weights.data_ptr<float>();
  const c10::BFloat16* yp = ys.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t os = out.stride(0);
  at::parallel_for(0, tokens, row_grain(top_k * hidden), [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(top_k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t* tid = ids + t * top_k;
      for (int64_t j = 0; j < top_k; ++j) slots[j] = j;
      std::stable_sort(slots.begin(), slots.end(),
                       [&](int64_t a, int64_t b) { return tid[a] < tid[b]; });
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t p = t * top_k + slots[j];
        add_term(op + t * os, yp + pos[p] * hidden, wp[p], hidden, j == 0);
      }
    }
  });
}

}  // namespace pagedserve_cpu
