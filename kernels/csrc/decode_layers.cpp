// decode_layers: one decode step through every decoder layer, in one call.
// A Llama-family decode step (one new token per sequence, at most 32 rows) through all layers,
// calling the kernels of the other files in the order the layer-by-layer path
// (engine/models/llama.py) calls them, with no Python in between: the Python glue between
// kernels costs more than the call (bench/README.md, "Decode steps in one kernel call").
// weights per layer, the linears packed by amx_pack_weight:
//   [input norm, qkv, (qkv bias), (q norm, k norm), o, post-attention norm, gate_up, down]
// six, seven with Qwen2's q/k/v bias (added in the qkv linear's float32 epilogue, as the
// layers' packed linear does), eight with Qwen3's per-head q/k RMSNorm weights (normed over
// head_dim before RoPE, as the layers do: the rms_norm kernel over contiguous
// [tokens * heads, head_dim] rows), nine with both; caches: [k, v] per layer. Attention takes
// the prefill kernel over one-token queries when batch_invariant (the bits a prefill chunk
// gets for the same query, whatever the batch), else the cascade kernel when
// cascade_prefix_len > 0 (prefix_blocks, suffix_table, suffix_lens as TorchAttentionBackend
// prepares them), else the decode kernel.
// embeds is the residual stream and is overwritten; returns the final norm's output.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "common.h"
#include "ops.h"

namespace pagedserve_cpu {

at::Tensor decode_layers(
    const at::Tensor& embeds, const at::Tensor& positions, const at::Tensor& cos_sin,
    const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& caches,
    const at::Tensor& final_norm, const at::Tensor& slot_mapping, const at::Tensor& block_table,
    const at::Tensor& seq_lens, int64_t cascade_prefix_len, const at::Tensor& prefix_blocks,
    const at::Tensor& suffix_table, const at::Tensor& suffix_lens, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool batch_invariant) {
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  const int64_t per_layer = layers > 0 ? static_cast<int64_t>(weights.size()) / layers : 6;
  TORCH_CHECK(caches.size() == static_cast<size_t>(2 * layers) && per_layer >= 6 &&
                  per_layer <= 9 && weights.size() == static_cast<size_t>(per_layer * layers),
              "six weights per layer (seven with a qkv bias, eight with q/k norms, nine with "
              "both) and two caches per layer");
  const bool qkv_bias = per_layer % 2 == 1, qk_norm = per_layer >= 8;
  TORCH_CHECK(embeds.dim() == 2 && embeds.is_contiguous() && embeds.size(0) <= 32,
              "embeds: [tokens <= 32, hidden], contiguous");
  const int64_t tokens = embeds.size(0), hidden = embeds.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const auto opts = embeds.options();
  const at::Tensor& residual = embeds;
  at::Tensor x = at::empty_like(embeds);
  // batch_invariant: every row a one-query sequence of the prefill kernel
  at::Tensor q_start, q_len;
  if (batch_invariant) {
    q_start = at::empty({tokens}, seq_lens.options());
    q_len = at::empty({tokens}, seq_lens.options());
    for (int64_t t = 0; t < tokens; ++t) {
      q_start.data_ptr<int32_t>()[t] = static_cast<int32_t>(t);
      q_len.data_ptr<int32_t>()[t] = 1;
    }
  }
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + per_layer * l;
    const at::Tensor* w_qk = w + (qkv_bias ? 3 : 2);  // q norm, k norm
    const at::Tensor* w_out = w + (per_layer - 6);  // o, post norm, gate_up, down at 2..5
    const at::Tensor& k_cache = caches[2 * l];
    const at::Tensor& v_cache = caches[2 * l + 1];
    if (l == 0) {
      rms_norm(x, residual, w[0], eps);
    } else {
      fused_add_rms_norm(x, residual, w[0], eps);
    }
    const int64_t qkv_cols = q_size + 2 * kv_size;
    at::Tensor qkv = at::empty({tokens, qkv_cols}, opts);
    amx_linear(qkv, x, w[1], qkv_bias ? std::optional<at::Tensor>(w[2]) : std::nullopt);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    if (qk_norm) {
      const at::Tensor q_rows = q.reshape({-1, head_dim}).contiguous();
      const at::Tensor k_rows = k.reshape({-1, head_dim}).contiguous();
      at::Tensor q_out = at::empty_like(q_rows);
      at::Tensor k_out = at::empty_like(k_rows);
      rms_norm(q_out, q_rows, w_qk[0], eps);
      rms_norm(k_out, k_rows, w_qk[1], eps);
      q = q_out.view({tokens, num_heads, head_dim});
      k = k_out.view({tokens, num_kv_heads, head_dim});
    }
    const at::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    rotary_embedding(positions, q, k, cos_sin);
    write_kv(k, v, k_cache, v_cache, slot_mapping);
    at::Tensor attn = at::empty({tokens, num_heads, head_dim}, opts);
    if (batch_invariant) {
      paged_attention_prefill(attn, q, k_cache, v_cache, block_table, q_start, q_len, seq_lens,
                              scale);
    } else if (cascade_prefix_len > 0) {
      paged_attention_cascade(attn, q, k_cache, v_cache, prefix_blocks, cascade_prefix_len,
                              suffix_table, suffix_lens, scale);
    } else {
      paged_attention_decode(attn, q, k_cache, v_cache, block_table, seq_lens, scale);
    }
    x = at::empty({tokens, hidden}, opts);
    amx_linear(x, attn.view({tokens, q_size}), w_out[2]);
    fused_add_rms_norm(x, residual, w_out[3], eps);
    at::Tensor gate_up = at::empty({tokens, w_out[4].size(0) * 16}, opts);
    amx_linear(gate_up, x, w_out[4]);
    at::Tensor h = at::empty({tokens, gate_up.size(1) / 2}, opts);
    silu_and_mul(h, gate_up);
    x = at::empty({tokens, hidden}, opts);
    amx_linear(x, h, w_out[5]);
  }
  fused_add_rms_norm(x, residual, final_norm, eps);
  return x;
}

}  // namespace pagedserve_cpu
