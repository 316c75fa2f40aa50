// The prefill kernel's pieces that the cascade (cascade.cpp, AMX) runs on the shared prefix;
// the kernel itself is in prefill.cpp.
#pragma once

#include "common.h"

#ifdef PAGEDSERVE_AVX512BF16
namespace pagedserve_cpu {

// Per-thread buffers of one 16-query block, kept across tasks.
struct PrefillScratch {
  std::vector<float> st;              // [visible keys (padded to 32), 16]
  std::vector<c10::BFloat16> pt;      // P in B-tile layout: [keys / 2, 16 queries, 2]
  std::vector<c10::BFloat16> qt;      // [D / 32, 16, 16, 2]
  alignas(64) float ot[16][16 * 16];  // out^T tiles, up to head_dim 256
};

// The shapes both bodies cover: head_dim a multiple of 32 in [64, 256] (out^T fills at most
// 16 tiles), whole 16-token tiles per block.
inline bool prefill_shapes_ok(int64_t d, int64_t block_size) {
  return d % 32 == 0 && d >= 64 && d <= 256 && block_size % 16 == 0;
}

// V^T of one sequence's KV head: dst[i * pad + t] = v[t][i] for t < len, 0 for len <= t < pad
// (pad = len rounded up to 32).
void build_vt(c10::BFloat16* dst, const c10::BFloat16* v_cache, const int32_t* blocks,
              int64_t len, int64_t block_size, int64_t token_stride, int64_t kv_head, int64_t d);

// nq <= 16 queries of one query head (KV head kv_head) at positions pos0.. against the first
// `visible` keys, bottom-right causal, into float32 rows of out; lse[n] = log(sum exp(scaled
// scores)) of query n. vt from build_vt. amx: on AMX tiles (configured by
// amx_configure_square()), else on vectors.
void prefill_block_f32(
    bool amx, int64_t d, float* out, int64_t out_stride, const c10::BFloat16* q,
    int64_t q_stride, int64_t nq, int64_t pos0, int64_t visible, const c10::BFloat16* k_cache,
    const c10::BFloat16* vt, int64_t vt_stride, const int32_t* blocks, int64_t block_size,
    int64_t token_stride, int64_t kv_head, float scale, PrefillScratch& s, float* lse);

}  // namespace pagedserve_cpu
#endif

#ifdef PAGEDSERVE_AMX
namespace pagedserve_cpu {

// prefill_shapes_ok, and the process may use AMX.
bool prefill_amx_applies(int64_t d, int64_t block_size);

}  // namespace pagedserve_cpu
#endif
