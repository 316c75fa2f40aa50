// torch.ops.pagedserve_cpu: every op of the CPU kernels, built on first use by
// pagedserve_kernels/cpu_ops.py (torch.utils.cpp_extension) from all sources in this folder. The torch ops
// (pagedserve_kernels/reference.py and the layers' torch paths) are the oracle the tests compare against.
//   elementwise.cpp
//     rms_norm                 Llama RMSNorm (Hugging Face's rounding) into out
//     fused_add_rms_norm       residual += x, then x = rms_norm(residual), in place
//     rotary_embedding         rotate-half RoPE in place on q and k, from a cos|sin cache
//     silu_and_mul             SwiGLU: silu(x[:, :I]) * x[:, I:]
//     write_kv                 new tokens' K and V into their cache slots
//   decode.cpp
//     paged_attention_decode   one query token per sequence over its paged K/V, GQA-aware,
//                              with an optional sliding window and logit soft-capping
//     set_amx_decode           route bf16 decode to AMX or AVX-512; returns the old setting
//     decode_kernel            which body paged_attention_decode runs for a query and cache
//   prefill.cpp
//     prefill_supported        whether paged_attention_prefill covers these shapes
//     prefill_kernel           which body it runs for them: "amx", "avx512_bf16" or ""
//     set_amx_prefill          route it to AMX or the AVX-512 BF16 body; returns the old setting
//     paged_attention_prefill  any number of new tokens per sequence, bottom-right causal,
//                              with an optional sliding window and logit soft-capping
//   cascade.cpp
//     cascade_supported        whether paged_attention_cascade covers these shapes
//     paged_attention_cascade  decode over a prefix shared by every sequence, read once
//   argmax.cpp
//     argmax_rows              first index of each row's maximum (greedy sampling)
//   linear.cpp
//     amx_available            whether this build and process may use AMX
//     amx_pack_weight          a bf16 weight [N, K] in AMX B-tile layout
//     amx_linear               out = x @ W^T (+ bias) for any rows, W from amx_pack_weight
//     dense_linear             amx_linear where AMX is, else its AVX-512 BF16 vector body
//     dense_linear_kernel      which body dense_linear runs: "amx", "avx512_bf16" or ""
//     set_amx_dense_linear     route dense_linear to AMX or the vector body; returns the old one
//   experts.cpp
//     moe_experts              routed tokens through their SwiGLU experts, packed by amx_pack_weight
//   quant_linear.cpp
//     int8_linear              W8A8: out = x @ W^T, W int8 per channel, x quantized per token
//     int8_kernel / set_int8_portable   which int8 path runs (VNNI or portable); force portable
//   gguf_quant.cpp
//     gguf_linear              out = x @ W^T, W a GGUF quant type re-packed at load
//     gguf_dequantize          such a W as a float [N, K] (the many-row path)
//     gguf_dequantize_rows     rows ids of such a W (a packed embedding's lookup)
//     gguf_kernel / set_gguf_portable   which path runs (VNNI or portable); force portable
//   gguf_gemm.cpp
//     gguf_gemm                gguf_linear for many rows: weight tiles dequantized to bf16, AMX
//     gguf_gemm_available      whether this build and process may run it
//   decode_layers.cpp
//     decode_layers            one decode step through every decoder layer
//     decode_layers_mixed      the same, each linear AMX-packed bf16 or GGUF-packed parts
//     decode_layers_lora       decode_layers_mixed with the step's LoRA adapters (lora_add)
//   lora.cpp
//     lora_add                 a linear's batched LoRA adapters added to its output, in place
// A new kernel family is one more .cpp here (declared in ops.h) and its m.def lines below.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(pagedserve_cpu, m) {
  using namespace pagedserve_cpu;
  m.def("rms_norm", &rms_norm);
  m.def("fused_add_rms_norm", &fused_add_rms_norm);
  m.def("rotary_embedding", &rotary_embedding);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("write_kv", &write_kv);
  // window and softcap default to 0 (full causal, no cap), so older callers keep working
  m.def(
      "paged_attention_decode(Tensor out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor seq_lens, float scale, int window=0, float softcap=0.0) -> ()",
      &paged_attention_decode);
  m.def("amx_available", &amx_available);
  m.def("set_amx_decode", &set_amx_decode);
  m.def("decode_kernel", &decode_kernel);
  m.def("prefill_supported", &prefill_supported);
  m.def("prefill_kernel", &prefill_kernel);
  m.def("set_amx_prefill", &set_amx_prefill);
  m.def(
      "paged_attention_prefill(Tensor out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor q_start, Tensor q_len, Tensor seq_lens, float scale, "
      "int window=0, float softcap=0.0) -> ()",
      &paged_attention_prefill);
  m.def("cascade_supported", &cascade_supported);
  m.def("paged_attention_cascade", &paged_attention_cascade);
  m.def("argmax_rows", &argmax_rows);
  m.def("amx_pack_weight", &amx_pack_weight);
  m.def("amx_linear(Tensor out, Tensor x, Tensor packed, Tensor? bias=None) -> ()", &amx_linear);
  m.def("dense_linear(Tensor out, Tensor x, Tensor packed, Tensor? bias=None) -> ()",
        &dense_linear);
  m.def("dense_linear_kernel", &dense_linear_kernel);
  m.def("set_amx_dense_linear", &set_amx_dense_linear);
  m.def("moe_experts", &moe_experts);
  m.def("decode_layers", &decode_layers);
  m.def("decode_layers_mixed", &decode_layers_mixed);
  m.def("decode_layers_lora", &decode_layers_lora);
  m.def("int8_linear", &int8_linear);
  m.def("int8_kernel", &int8_kernel);
  m.def("set_int8_portable", &set_int8_portable);
  m.def("gguf_linear", &gguf_linear);
  m.def("gguf_dequantize", &gguf_dequantize);
  m.def("gguf_dequantize_rows", &gguf_dequantize_rows);
  m.def("gguf_kernel", &gguf_kernel);
  m.def("set_gguf_portable", &set_gguf_portable);
  m.def("gguf_gemm", &gguf_gemm);
  m.def("gguf_gemm_available", &gguf_gemm_available);
  m.def("lora_add", &lora_add);
}
