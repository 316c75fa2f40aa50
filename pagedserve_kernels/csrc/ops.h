// The ops registered under torch.ops.pagedserve_cpu (registration.cpp), one family per file.
// decode_layers.cpp calls them too; a new family adds its file, its lines here and in
// registration.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pagedserve_cpu {

// elementwise.cpp
void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_embedding(
    const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& cos_sin_cache);
void silu_and_mul(const at::Tensor& out, const at::Tensor& x);
void write_kv(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& slot_mapping);

// decode.cpp
void paged_attention_decode(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
    double scale, int64_t window = 0, double softcap = 0.0);
bool set_amx_decode(bool enabled);
std::string decode_kernel(const at::Tensor& query, const at::Tensor& k_cache);

// prefill.cpp
bool prefill_supported(int64_t head_dim, int64_t block_size);
std::string prefill_kernel(int64_t head_dim, int64_t block_size);
bool set_amx_prefill(bool enabled);
void paged_attention_prefill(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& q_start,
    const at::Tensor& q_len, const at::Tensor& seq_lens, double scale, int64_t window = 0,
    double softcap = 0.0);

// cascade.cpp
bool cascade_supported(int64_t head_dim, int64_t block_size, int64_t group);
void paged_attention_cascade(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& prefix_blocks, int64_t prefix_len,
    const at::Tensor& block_table, const at::Tensor& seq_lens, double scale);

// argmax.cpp
at::Tensor argmax_rows(const at::Tensor& x);

// linear.cpp
bool amx_available();
at::Tensor amx_pack_weight(const at::Tensor& w);
std::string dense_linear_kernel();
bool set_amx_dense_linear(bool enabled);
void dense_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias);
void amx_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                const std::optional<at::Tensor>& bias = std::nullopt);

// experts.cpp
void moe_experts(
    const at::Tensor& out, const at::Tensor& x, const at::Tensor& expert_ids,
    const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down);

// quant_linear.cpp
void int8_linear(
    const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
    const at::Tensor& w_scale, const at::Tensor& w_sum, const std::optional<at::Tensor>& bias);
std::string int8_kernel();
bool set_int8_portable(bool portable);

// gguf_quant.cpp
void gguf_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qs,
                 const std::optional<at::Tensor>& qh, const at::Tensor& scales,
                 const std::optional<at::Tensor>& mins, int64_t bits, int64_t zero,
                 const std::optional<at::Tensor>& bias);
void gguf_dequantize(const at::Tensor& out, const at::Tensor& qs,
                     const std::optional<at::Tensor>& qh, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, int64_t bits, int64_t zero);
void gguf_dequantize_rows(const at::Tensor& out, const at::Tensor& ids, const at::Tensor& qs,
                          const std::optional<at::Tensor>& qh, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins, int64_t n, int64_t bits,
                          int64_t zero);
std::string gguf_kernel();
bool set_gguf_portable(bool portable);
// One part of a GGUF-packed linear: n consecutive outputs of one type in gguf_quant.cpp's layout.
struct GgufPart {
  const at::Tensor* qs;
  const at::Tensor* qh;  // nullptr: 4 or 8 bits
  const at::Tensor* scales;
  const at::Tensor* mins;  // nullptr: a type without a min
  int64_t n, bits, zero;
};
// out = x @ W^T (+ bias) for W the parts' rows one after another: the bits of gguf_linear part
// by part, with x quantized once and every part in one parallel region.
void gguf_linear_parts(const at::Tensor& out, const at::Tensor& x,
                       const std::vector<GgufPart>& parts, const at::Tensor* bias);

// gguf_gemm.cpp
void gguf_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qs,
               const std::optional<at::Tensor>& qh, const at::Tensor& scales,
               const std::optional<at::Tensor>& mins, int64_t bits, int64_t zero,
               const std::optional<at::Tensor>& bias);
bool gguf_gemm_available();
// Calls of at least this many rows go to gguf_gemm where it is available: the fused decode step's
// rule, the same as engine/layers/quantization/gguf.py GEMM_MIN_ROWS (tests/test_gguf_decode.py holds
// the two paths to the same bits at this many rows).
constexpr int64_t kGgufGemmMinRows = 16;

// decode_layers.cpp
at::Tensor decode_layers(
    const at::Tensor& embeds, const at::Tensor& positions, const at::Tensor& cos_sin,
    const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& caches,
    const at::Tensor& final_norm, const at::Tensor& slot_mapping, const at::Tensor& block_table,
    const at::Tensor& seq_lens, int64_t cascade_prefix_len, const at::Tensor& prefix_blocks,
    const at::Tensor& suffix_table, const at::Tensor& suffix_lens, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool batch_invariant);
at::Tensor decode_layers_mixed(
    const at::Tensor& embeds, const at::Tensor& positions, const at::Tensor& cos_sin,
    const std::vector<at::Tensor>& weights, const at::Tensor& spec, bool qkv_bias, bool qk_norm,
    const std::vector<at::Tensor>& caches, const at::Tensor& final_norm,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& seq_lens,
    int64_t cascade_prefix_len, const at::Tensor& prefix_blocks, const at::Tensor& suffix_table,
    const at::Tensor& suffix_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double eps, double scale, bool batch_invariant);
at::Tensor decode_layers_lora(
    const at::Tensor& embeds, const at::Tensor& positions, const at::Tensor& cos_sin,
    const std::vector<at::Tensor>& weights, const at::Tensor& spec, bool qkv_bias, bool qk_norm,
    const std::vector<at::Tensor>& caches, const at::Tensor& final_norm,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& seq_lens,
    int64_t cascade_prefix_len, const at::Tensor& prefix_blocks, const at::Tensor& suffix_table,
    const at::Tensor& suffix_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double eps, double scale, bool batch_invariant, const std::vector<at::Tensor>& lora,
    const at::Tensor& token_slots, const at::Tensor& slot_scaling, int64_t max_rank);

// lora.cpp
void lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a_all,
              const at::Tensor& bt_all, const at::Tensor& token_slots,
              const at::Tensor& slot_scaling, at::IntArrayRef part_sizes, int64_t max_rank);

}  // namespace pagedserve_cpu
