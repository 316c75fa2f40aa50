// The AMX decode kernel's pieces that the cascade (cascade.cpp) runs on each sequence's own
// blocks; the kernel itself is in decode.cpp.
#pragma once

#include "common.h"

#ifdef PAGEDSERVE_AMX
namespace pagedserve_cpu {

// Per-thread buffers of decode_heads_amx, kept across its tasks.
struct DecodeAmxScratch {
  std::vector<float> scores;          // one head's scores, [len_pad]
  std::vector<float> inv_sum;         // [heads, G]
  std::vector<float> probs;           // [heads, G, len_pad], rounded to bf16 precision
  std::vector<c10::BFloat16> qt;      // [heads, D / 32, 16, G * 2]
  std::vector<float> st;              // scores as the tiles hold them: [heads, len_pad, G]
};

// Tile 0: 16 K rows; tile 1: q^T of the G query heads; tile 2: scores^T [16 tokens, G].
inline void amx_configure_decode(int64_t group) {
  TileConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = 64;
  cfg.rows[1] = 16, cfg.colsb[1] = static_cast<uint16_t>(4 * group);
  cfg.rows[2] = 16, cfg.colsb[2] = static_cast<uint16_t>(4 * group);
  load_tile_config(cfg);
}

// The AMX kernel applies: bf16, head_dim a multiple of 32 from 64 on (q.k in 32-dim tile
// chunks; P x V in passes of 64 dims, the last of 96 where d % 64 == 32), whole 16-token
// tiles per block, at most 16 query heads per KV head, the process may use AMX, and
// set_amx_decode left it on.
bool decode_amx_applies(int64_t d, int64_t block_size, int64_t group);

// KV heads [h0, h1) of one sequence into float32 rows of out (query head j at
// out + j * out_head_stride), lse[j] = log(sum exp(scaled scores)); tiles configured by
// amx_configure_decode(group).
void decode_heads_amx_f32(
    float* out, int64_t out_head_stride, const c10::BFloat16* q, int64_t q_head_stride,
    const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* blocks,
    int64_t len, int64_t block_size, int64_t kv_heads, int64_t h0, int64_t h1, int64_t group,
    int64_t d, float scale, DecodeAmxScratch& s, float* lse);

}  // namespace pagedserve_cpu
#endif
