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
// decode_layers_mixed: the same step where each linear is either AMX-packed bf16 or GGUF-packed
// parts (gguf_quant.cpp's layout, consecutive output rows of one type each, multiplied by
// gguf_linear_parts: the bits of gguf_linear part by part, as engine/layers/quantization/gguf.py's
// GGUFWeights calls it, with x quantized once). The layout per
// layer is the one above with each linear a run of tensors that `spec` (int64, read in order,
// one entry list per linear) describes: [0] one AMX-packed tensor follows; [P, then per part
// n, bits, zero, has_qh, has_mins] the tensors qs, (qh), scales, (mins) of each part follow
// (scales and mins fp16 or float32, as gguf_linear_parts reads them).
// decode_layers_lora: decode_layers_mixed with LoRA adapters (engine/layers/lora.py): after each
// projection, lora_add (lora.cpp) adds the step's adapters to its output in place, as the
// layers' wrapped linears do; lora holds per layer [a, bt] of qkv, o, gate_up and down.
// embeds is the residual stream and is overwritten; returns the final norm's output.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "common.h"
#include "ops.h"

namespace pagedserve_cpu {
namespace {

// One projection: AMX-packed bf16 (amx) or GGUF parts; n its output features.
struct LinearW {
  const at::Tensor* amx = nullptr;
  std::vector<GgufPart> parts;
  int64_t n = 0;
};

struct LayerW {
  const at::Tensor* in_norm = nullptr;
  const at::Tensor* qkv_bias = nullptr;
  const at::Tensor* q_norm = nullptr;
  const at::Tensor* k_norm = nullptr;
  const at::Tensor* post_norm = nullptr;
  LinearW qkv, o, gate_up, down;
};

// The step's adapters: per layer 8 tensors (a, bt of qkv, o, gate_up, down), token slots.
struct LoraStep {
  const std::vector<at::Tensor>& tensors;
  const at::Tensor& token_slots;
  const at::Tensor& slot_scaling;
  int64_t max_rank;
};

// out += the adapters' share of projection `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer l.
void add_lora(const LoraStep* lora, size_t l, int which, const at::Tensor& out,
              const at::Tensor& in, at::IntArrayRef sizes) {
  if (lora == nullptr) return;
  const at::Tensor& a = lora->tensors[8 * l + 2 * which];
  const at::Tensor& bt = lora->tensors[8 * l + 2 * which + 1];
  lora_add(out, in, a, bt, lora->token_slots, lora->slot_scaling, sizes, lora->max_rank);
}

std::optional<at::Tensor> maybe(const at::Tensor* t) {
  return t != nullptr ? std::optional<at::Tensor>(*t) : std::nullopt;
}

LinearW amx_weight(const at::Tensor& packed) {
  LinearW w;
  w.amx = &packed;
  w.n = packed.size(0) * 16;  // amx_pack_weight's rows of 16 outputs
  return w;
}

// out [tokens, n] = x @ W^T (+ bias): the bits of the layers' linear for this weight.
void run_linear(const at::Tensor& out, const at::Tensor& x, const LinearW& w,
                const at::Tensor* bias) {
  if (w.amx != nullptr) {
    dense_linear(out, x, *w.amx, maybe(bias));
    return;
  }
  if (x.size(0) >= kGgufGemmMinRows && gguf_gemm_available()) {
    // as engine/layers/quantization/gguf.py dispatches a call of this many rows: part by part on AMX
    int64_t start = 0;
    for (const GgufPart& p : w.parts) {
      std::optional<at::Tensor> b;
      if (bias != nullptr) b = bias->narrow(0, start, p.n);
      gguf_gemm(out.narrow(1, start, p.n), x, *p.qs, maybe(p.qh), *p.scales,
                maybe(p.mins), p.bits, p.zero, b);
      start += p.n;
    }
    return;
  }
  gguf_linear_parts(out, x, w.parts, bias);
}

struct StepArgs {
  const at::Tensor& positions;
  const at::Tensor& cos_sin;
  const std::vector<at::Tensor>& caches;
  const at::Tensor& final_norm;
  const at::Tensor& slot_mapping;
  const at::Tensor& block_table;
  const at::Tensor& seq_lens;
  int64_t cascade_prefix_len;
  const at::Tensor& prefix_blocks;
  const at::Tensor& suffix_table;
  const at::Tensor& suffix_lens;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  bool batch_invariant;
};

at::Tensor run_layers(const at::Tensor& embeds, const std::vector<LayerW>& layers,
                      const StepArgs& s, const LoraStep* lora = nullptr) {
  TORCH_CHECK(s.caches.size() == 2 * layers.size(), "two caches per layer");
  TORCH_CHECK(embeds.dim() == 2 && embeds.is_contiguous() && embeds.size(0) <= 32,
              "embeds: [tokens <= 32, hidden], contiguous");
  const int64_t tokens = embeds.size(0), hidden = embeds.size(1);
  const int64_t head_dim = s.head_dim;
  const int64_t q_size = s.num_heads * head_dim, kv_size = s.num_kv_heads * head_dim;
  const auto opts = embeds.options();
  const at::Tensor& residual = embeds;
  // every layer's activations in the same buffers, allocated once per step; each buffer is
  // read only before it is written again (x: norm out -> qkv in, o out -> gate_up in, down out)
  const int64_t inter = layers.empty() ? 0 : layers[0].gate_up.n;
  at::Tensor x = at::empty_like(embeds);
  at::Tensor qkv = at::empty({tokens, q_size + 2 * kv_size}, opts);
  at::Tensor attn = at::empty({tokens, s.num_heads, head_dim}, opts);
  at::Tensor gate_up = at::empty({tokens, inter}, opts);
  at::Tensor h = at::empty({tokens, inter / 2}, opts);
  const at::Tensor q_view = qkv.narrow(1, 0, q_size).view({tokens, s.num_heads, head_dim});
  const at::Tensor k_view =
      qkv.narrow(1, q_size, kv_size).view({tokens, s.num_kv_heads, head_dim});
  const at::Tensor v =
      qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, s.num_kv_heads, head_dim});
  const at::Tensor attn_rows = attn.view({tokens, q_size});
  // batch_invariant: every row a one-query sequence of the prefill kernel
  at::Tensor q_start, q_len;
  if (s.batch_invariant) {
    q_start = at::empty({tokens}, s.seq_lens.options());
    q_len = at::empty({tokens}, s.seq_lens.options());
    for (int64_t t = 0; t < tokens; ++t) {
      q_start.data_ptr<int32_t>()[t] = static_cast<int32_t>(t);
      q_len.data_ptr<int32_t>()[t] = 1;
    }
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerW& w = layers[l];
    TORCH_CHECK(w.gate_up.n == inter, "decode_layers: every layer's gate_up has one width");
    const at::Tensor& k_cache = s.caches[2 * l];
    const at::Tensor& v_cache = s.caches[2 * l + 1];
    if (l == 0) {
      rms_norm(x, residual, *w.in_norm, s.eps);
    } else {
      fused_add_rms_norm(x, residual, *w.in_norm, s.eps);
    }
    run_linear(qkv, x, w.qkv, w.qkv_bias);
    add_lora(lora, l, 0, qkv, x, {q_size, kv_size, kv_size});
    at::Tensor q = q_view, k = k_view;
    if (w.q_norm != nullptr) {
      const at::Tensor q_rows = q.reshape({-1, head_dim}).contiguous();
      const at::Tensor k_rows = k.reshape({-1, head_dim}).contiguous();
      at::Tensor q_out = at::empty_like(q_rows);
      at::Tensor k_out = at::empty_like(k_rows);
      rms_norm(q_out, q_rows, *w.q_norm, s.eps);
      rms_norm(k_out, k_rows, *w.k_norm, s.eps);
      q = q_out.view({tokens, s.num_heads, head_dim});
      k = k_out.view({tokens, s.num_kv_heads, head_dim});
    }
    rotary_embedding(s.positions, q, k, s.cos_sin);
    write_kv(k, v, k_cache, v_cache, s.slot_mapping);
    if (s.batch_invariant) {
      paged_attention_prefill(attn, q, k_cache, v_cache, s.block_table, q_start, q_len,
                              s.seq_lens, s.scale);
    } else if (s.cascade_prefix_len > 0) {
      paged_attention_cascade(attn, q, k_cache, v_cache, s.prefix_blocks, s.cascade_prefix_len,
                              s.suffix_table, s.suffix_lens, s.scale);
    } else {
      paged_attention_decode(attn, q, k_cache, v_cache, s.block_table, s.seq_lens, s.scale);
    }
    run_linear(x, attn_rows, w.o, nullptr);
    add_lora(lora, l, 1, x, attn_rows, {hidden});
    fused_add_rms_norm(x, residual, *w.post_norm, s.eps);
    run_linear(gate_up, x, w.gate_up, nullptr);
    add_lora(lora, l, 2, gate_up, x, {inter / 2, inter / 2});
    silu_and_mul(h, gate_up);
    run_linear(x, h, w.down, nullptr);
    add_lora(lora, l, 3, x, h, {hidden});
  }
  fused_add_rms_norm(x, residual, s.final_norm, s.eps);
  return x;
}

// Reads one linear of decode_layers_mixed's layout: spec entries from spec[*at], tensors from
// weights[*next].
LinearW read_linear(const std::vector<at::Tensor>& weights, size_t* next, const int64_t* spec,
                    int64_t spec_len, int64_t* pos) {
  TORCH_CHECK(*pos < spec_len, "decode_layers_mixed: spec ends before the weights do");
  const int64_t num_parts = spec[(*pos)++];
  auto take = [&]() -> const at::Tensor* {
    TORCH_CHECK(*next < weights.size(), "decode_layers_mixed: the weights end before the spec");
    return &weights[(*next)++];
  };
  if (num_parts == 0) return amx_weight(*take());
  LinearW w;
  TORCH_CHECK(num_parts > 0 && *pos + 5 * num_parts <= spec_len,
              "decode_layers_mixed: spec ends inside a linear");
  for (int64_t p = 0; p < num_parts; ++p) {
    const int64_t* e = spec + *pos;
    *pos += 5;
    GgufPart part{};
    part.n = e[0];
    part.bits = e[1];
    part.zero = e[2];
    part.qs = take();
    part.qh = e[3] != 0 ? take() : nullptr;
    part.scales = take();
    part.mins = e[4] != 0 ? take() : nullptr;
    w.parts.push_back(part);
    w.n += part.n;
  }
  return w;
}

}  // namespace

at::Tensor decode_layers(
    const at::Tensor& embeds, const at::Tensor& positions, const at::Tensor& cos_sin,
    const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& caches,
    const at::Tensor& final_norm, const at::Tensor& slot_mapping, const at::Tensor& block_table,
    const at::Tensor& seq_lens, int64_t cascade_prefix_len, const at::Tensor& prefix_blocks,
    const at::Tensor& suffix_table, const at::Tensor& suffix_lens, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool batch_invariant) {
  const int64_t num_layers = static_cast<int64_t>(caches.size()) / 2;
  const int64_t per_layer = num_layers > 0 ? static_cast<int64_t>(weights.size()) / num_layers : 6;
  TORCH_CHECK(caches.size() == static_cast<size_t>(2 * num_layers) && per_layer >= 6 &&
                  per_layer <= 9 && weights.size() == static_cast<size_t>(per_layer * num_layers),
              "six weights per layer (seven with a qkv bias, eight with q/k norms, nine with "
              "both) and two caches per layer");
  const bool qkv_bias = per_layer % 2 == 1, qk_norm = per_layer >= 8;
  std::vector<LayerW> layers(num_layers);
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + per_layer * l;
    const at::Tensor* w_qk = w + (qkv_bias ? 3 : 2);  // q norm, k norm
    const at::Tensor* w_out = w + (per_layer - 6);  // o, post norm, gate_up, down at 2..5
    LayerW& layer = layers[l];
    layer.in_norm = &w[0];
    layer.qkv = amx_weight(w[1]);
    layer.qkv_bias = qkv_bias ? &w[2] : nullptr;
    layer.q_norm = qk_norm ? &w_qk[0] : nullptr;
    layer.k_norm = qk_norm ? &w_qk[1] : nullptr;
    layer.o = amx_weight(w_out[2]);
    layer.post_norm = &w_out[3];
    layer.gate_up = amx_weight(w_out[4]);
    layer.down = amx_weight(w_out[5]);
  }
  const StepArgs args{positions,  cos_sin,      caches,       final_norm,  slot_mapping,
                      block_table, seq_lens,    cascade_prefix_len, prefix_blocks,
                      suffix_table, suffix_lens, num_heads,    num_kv_heads, head_dim,
                      eps,          scale,       batch_invariant};
  return run_layers(embeds, layers, args);
}

namespace {

// decode_layers_mixed's layers from its flat weights and spec, checked.
std::vector<LayerW> mixed_layers(const at::Tensor& embeds, const std::vector<at::Tensor>& weights,
                                 const at::Tensor& spec, bool qkv_bias, bool qk_norm,
                                 size_t num_layers, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim) {
  TORCH_CHECK(spec.scalar_type() == at::kLong && spec.dim() == 1 && spec.is_contiguous(),
              "decode_layers_mixed: spec must be contiguous int64 [entries]");
  const int64_t* sp = spec.data_ptr<int64_t>();
  const int64_t spec_len = spec.numel();
  int64_t pos = 0;
  size_t next = 0;
  auto take = [&]() -> const at::Tensor* {
    TORCH_CHECK(next < weights.size(), "decode_layers_mixed: the weights end before the layers");
    return &weights[next++];
  };
  std::vector<LayerW> layers(num_layers);
  for (LayerW& layer : layers) {
    layer.in_norm = take();
    layer.qkv = read_linear(weights, &next, sp, spec_len, &pos);
    if (qkv_bias) layer.qkv_bias = take();
    if (qk_norm) {
      layer.q_norm = take();
      layer.k_norm = take();
    }
    layer.o = read_linear(weights, &next, sp, spec_len, &pos);
    layer.post_norm = take();
    layer.gate_up = read_linear(weights, &next, sp, spec_len, &pos);
    layer.down = read_linear(weights, &next, sp, spec_len, &pos);
  }
  TORCH_CHECK(next == weights.size() && pos == spec_len,
              "decode_layers_mixed: weights or spec left over after the last layer");
  const int64_t hidden = embeds.size(-1), q_size = num_heads * head_dim;
  for (const LayerW& l : layers) {  // AMX widths are checked by amx_linear
    auto fits = [](const LinearW& w, int64_t n) { return w.amx != nullptr || w.n == n; };
    TORCH_CHECK(fits(l.qkv, q_size + 2 * num_kv_heads * head_dim) && fits(l.o, hidden) &&
                    fits(l.down, hidden) && l.gate_up.n % 2 == 0,
                "decode_layers_mixed: a GGUF linear's parts do not add up to its width");
  }
  return layers;
}

}  // namespace

#define MIXED_PARAMS                                                                            \
  const at::Tensor &embeds, const at::Tensor &positions, const at::Tensor &cos_sin,             \
      const std::vector<at::Tensor>&weights, const at::Tensor &spec, bool qkv_bias,             \
      bool qk_norm, const std::vector<at::Tensor>&caches, const at::Tensor &final_norm,         \
      const at::Tensor &slot_mapping, const at::Tensor &block_table, const at::Tensor &seq_lens, \
      int64_t cascade_prefix_len, const at::Tensor &prefix_blocks,                              \
      const at::Tensor &suffix_table, const at::Tensor &suffix_lens, int64_t num_heads,         \
      int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool batch_invariant
#define MIXED_STEP                                                                              \
  TORCH_CHECK(caches.size() % 2 == 0, "two caches per layer");                                  \
  const std::vector<LayerW> layers = mixed_layers(embeds, weights, spec, qkv_bias, qk_norm,     \
                                                  caches.size() / 2, num_heads, num_kv_heads,   \
                                                  head_dim);                                    \
  const StepArgs args{positions,    cos_sin,     caches,    final_norm,         slot_mapping,    \
                      block_table,  seq_lens,    cascade_prefix_len, prefix_blocks,            \
                      suffix_table, suffix_lens, num_heads, num_kv_heads,       head_dim,        \
                      eps,          scale,       batch_invariant};

at::Tensor decode_layers_mixed(MIXED_PARAMS) {
  MIXED_STEP
  return run_layers(embeds, layers, args);
}

at::Tensor decode_layers_lora(MIXED_PARAMS, const std::vector<at::Tensor>& lora,
                              const at::Tensor& token_slots, const at::Tensor& slot_scaling,
                              int64_t max_rank) {
  MIXED_STEP
  TORCH_CHECK(lora.size() == 8 * layers.size(),
              "decode_layers_lora: a, bt of qkv, o, gate_up and down per layer");
  const LoraStep step{lora, token_slots, slot_scaling, max_rank};
  return run_layers(embeds, layers, args, &step);
}

}  // namespace pagedserve_cpu
