// paged_attention_prefill: sequences with any number of new tokens over their paged K/V,
// bottom-right causal (bf16, head_dim a multiple of 32 in [64, 256], block_size % 16 == 0).
// Two bodies with the same data layouts and steps, picked per call (prefill_kernel): AMX tiles
// where the process may use them, else AVX-512 BF16 vectors (vdpbf16ps), which compute each
// tile product as 16 rows of broadcast-A x B-row dot products; their scores and outputs agree
// to float32 summation order, the numerators are the same code.
// One task per (sequence, query head, 16 queries); query j of a sequence sits at position
// kv_len - q_len + j and sees keys 0..that position, or under a window W the last W of them
// (the blocks before the sequence's first visible key are never read). Soft-capping replaces
// the raw scores by cap / scale * tanh(scores * scale / cap) before the softmax. Two passes
// over the visible keys, so no running rescale:
//   scores^T [16 keys, 16 queries] = K rows (A tile straight from the cache) x q^T (B tile:
//     row r holds (q[n][2r], q[n][2r+1]) for the 16 queries n), kept for all visible keys;
//   per query (a lane): max over keys, numerators exp(s - max) rounded to bf16, their sum;
//   out^T [16 dims, 16 queries] += V^T (A tile: 16 dims x 32 keys, from a per-(sequence,
//     KV head) transposed copy of V built once per call) x P (B tile: keys paired per query).
// Tile registers (amx_configure_square): 0-1 and 6-7 K, 2-3 q^T, 4-5 scores (head_dim 96: 0, 1,
// 6 K, 2, 3, 5 q^T, 4 scores); then 0 P, 1-3 V^T, 4-7 out^T.
#include "prefill.h"

#include "common.h"
#include "ops.h"

#include <array>

namespace pagedserve_cpu {

#ifdef PAGEDSERVE_AVX512BF16
namespace {

// permutex2var_epi16 indices that interleave the first 16 words of a with those of b
// (a0 b0 a1 b1 ... a15 b15); adding 16 to each interleaves the next 16.
PAGEDSERVE_INLINE __m512i interleave_lo16() {
  return _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
      35, 3, 34, 2, 33, 1, 32, 0);
}

// 16 x 16 transpose of 32-bit words held in 16 vectors.
inline void transpose16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// q^T tiles (queries past nq are zero): word w of query n at [w / 16][w % 16][n].
template <int D>
PAGEDSERVE_INLINE void pack_q_tiles(
    std::vector<c10::BFloat16>& qt, const c10::BFloat16* q, int64_t q_stride, int64_t nq) {
  qt.assign((D / 32) * 512, c10::BFloat16(0.0f));
  for (int64_t n = 0; n < nq; ++n) {
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(q + n * q_stride);
    uint32_t* dst = reinterpret_cast<uint32_t*>(qt.data());
    for (int64_t w = 0; w < D / 2; ++w) dst[(w / 16) * 256 + (w % 16) * 16 + n] = qw[w];
  }
}

// Per query (a lane): causal mask (and window: query n sees key t iff t <= pos0 + n and, with
// window > 0, t > pos0 + n - window), max, bf16 numerators into pt as B-tile rows (zero for
// masked and padded keys), their sum. vmax gets the max raw score (0 in unused lanes).
PAGEDSERVE_INLINE void numerators(
    c10::BFloat16* pt, const float* st, int64_t visible, int64_t vis_pad, int64_t pos0,
    int64_t window, __mmask16 valid_q, float scale, __m512& vmax, __m512& vsum) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  auto live_lanes = [&](int64_t t) -> __mmask16 {  // queries that see key t
    __mmask16 live = valid_q;
    if (t > pos0)
      live &= _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int32_t>(t - pos0)));
    if (window > 0 && t - pos0 + window < 16)  // lanes n >= t - pos0 + window: key t left
      live &= _mm512_cmpgt_epi32_mask(
          _mm512_set1_epi32(static_cast<int32_t>(t - pos0 + window)), lane);
    return live;
  };
  // max of the raw scores (scale > 0 commutes with it); e = 2^(s * scale * log2 e - max'),
  // with a cubic for 2^fraction: plenty for numerators that are rounded to bf16 anyway.
  vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < visible; ++t)
    vmax = _mm512_mask_max_ps(vmax, live_lanes(t), vmax, _mm512_loadu_ps(st + t * 16));
  vmax = _mm512_mask_mov_ps(_mm512_setzero_ps(), valid_q, vmax);  // unused lanes: finite
  const __m512 k2 = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __m512 m2 = _mm512_mul_ps(vmax, k2);
  // minimax cubic for 2^f on [0, 1): relative error 7.5e-5, well under bf16's half ulp
  const __m512 c3 = _mm512_set1_ps(0.07802403f), c2 = _mm512_set1_ps(0.22606707f);
  const __m512 c1 = _mm512_set1_ps(0.69583399f), one = _mm512_set1_ps(0.99992513f);
  vsum = _mm512_setzero_ps();
  const __m512i pair_idx = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
      19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t t = 0; t < vis_pad; t += 2) {
    __m512 e[2];
    for (int i = 0; i < 2; ++i) {
      const int64_t tt = t + i;
      const __mmask16 live = tt < visible ? live_lanes(tt) : 0;
      const __m512 y = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, st + tt * 16), k2, m2);
      const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      const __m512 f = _mm512_sub_ps(y, n);
      __m512 p = _mm512_fmadd_ps(c3, f, c2);
      p = _mm512_fmadd_ps(p, f, c1);
      p = _mm512_fmadd_ps(p, f, one);
      e[i] = _mm512_maskz_scalef_ps(live, p, n);
      vsum = _mm512_add_ps(vsum, e[i]);
    }
    // (e0[n], e1[n]) pairs: B-tile row t / 2
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]);  // e0 low, e1 high
    _mm512_storeu_si512(pt + t * 16, _mm512_permutexvar_epi16(pair_idx, both));
  }
}

// out^T tiles [16 dims][16 queries] -> rows of out divided by their sums (one 16 x 16
// transpose per 16 dims); lse, when given, gets log(sum exp(scaled scores)) per query.
template <int D, typename O>
PAGEDSERVE_INLINE void store_rows(
    O* out, int64_t out_stride, float (*ot)[16 * 16], int64_t nq, __mmask16 valid_q,
    __m512 vmax, __m512 vsum, float scale, float* lse) {
  alignas(64) float inv[16];
  _mm512_store_ps(
      inv, _mm512_div_ps(_mm512_set1_ps(1.0f),
                         _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), valid_q, vsum)));
  if (lse) {
    alignas(64) float mx[16], sm[16];
    _mm512_store_ps(mx, vmax);
    _mm512_store_ps(sm, vsum);
    for (int64_t n = 0; n < nq; ++n) lse[n] = mx[n] * scale + std::log(sm[n]);
  }
  for (int64_t j = 0; j < D / 16; ++j) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(ot[j] + i * 16);
    transpose16_epi32(r);
    for (int64_t n = 0; n < nq; ++n)
      store16(out + n * out_stride + 16 * j,
              _mm512_mul_ps(_mm512_castsi512_ps(r[n]), _mm512_set1_ps(inv[n])));
  }
}

#ifdef PAGEDSERVE_AMX
// The 16 K rows of one tile on their way into L1 (head_dim 64: two lines per row).
PAGEDSERVE_INLINE void prefetch_k_tile(const c10::BFloat16* rows, int64_t kstride) {
  const char* nx = reinterpret_cast<const char*>(rows);
  for (int r = 0; r < 16; ++r) {
    _mm_prefetch(nx + r * kstride, _MM_HINT_T0);
    _mm_prefetch(nx + r * kstride + 64, _MM_HINT_T0);
  }
}

// scores^T for the visible keys, 16 at a time, into st [key][16 queries].
template <int D, typename KRows>
PAGEDSERVE_INLINE void score_tiles(
    float* st, const c10::BFloat16* qt, const KRows& k_rows, int64_t visible, int64_t kstride) {
  constexpr int64_t KC = D / 32;
  if constexpr (D == 64) {
    _tile_loadd(2, qt, 64);
    _tile_loadd(3, qt + 512, 64);
  }
  if constexpr (D == 96) {  // its three q^T tiles stay loaded, as head_dim 64's two do
    _tile_loadd(2, qt, 64);
    _tile_loadd(3, qt + 512, 64);
    _tile_loadd(5, qt + 1024, 64);
    for (int64_t t0 = 0; t0 < visible; t0 += 16) {
      const c10::BFloat16* k0 = k_rows(t0);
      if (t0 + 16 < visible) {  // the next tile's rows, three lines each
        const char* nx = reinterpret_cast<const char*>(k_rows(t0 + 16));
        for (int r = 0; r < 16; ++r)
          for (int l = 0; l < 3; ++l) _mm_prefetch(nx + r * kstride + 64 * l, _MM_HINT_T0);
      }
      _tile_zero(4);
      _tile_loadd(0, k0, kstride);
      _tile_loadd(1, k0 + 32, kstride);
      _tile_loadd(6, k0 + 64, kstride);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(4, 1, 3);
      _tile_dpbf16ps(4, 6, 5);
      _tile_stored(4, st + t0 * 16, 64);
    }
    return;
  }
  int64_t t0 = 0;
  if constexpr (D == 64) {  // two 16-key chunks per round on separate tiles, so they overlap
    for (; t0 + 16 < visible; t0 += 32) {
      const c10::BFloat16* ka = k_rows(t0);
      const c10::BFloat16* kb = k_rows(t0 + 16);
      for (int64_t ahead = 32; ahead < 64; ahead += 16)
        if (t0 + ahead < visible) prefetch_k_tile(k_rows(t0 + ahead), kstride);
      _tile_zero(4);
      _tile_zero(5);
      _tile_loadd(0, ka, kstride);
      _tile_loadd(1, ka + 32, kstride);
      _tile_loadd(6, kb, kstride);
      _tile_loadd(7, kb + 32, kstride);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 6, 2);
      _tile_dpbf16ps(4, 1, 3);
      _tile_dpbf16ps(5, 7, 3);
      _tile_stored(4, st + t0 * 16, 64);
      _tile_stored(5, st + (t0 + 16) * 16, 64);
    }
  }
  for (; t0 < visible; t0 += 16) {
    const c10::BFloat16* k0 = k_rows(t0);
    if (t0 + 16 < visible) prefetch_k_tile(k_rows(t0 + 16), kstride);
    _tile_zero(4);
    for (int64_t c = 0; c + 1 < KC; c += 2) {
      if constexpr (D != 64) {
        _tile_loadd(2, qt + c * 512, 64);
        _tile_loadd(3, qt + (c + 1) * 512, 64);
      }
      _tile_loadd(0, k0 + 32 * c, kstride);
      _tile_loadd(1, k0 + 32 * (c + 1), kstride);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(4, 1, 3);
    }
    if constexpr (KC % 2 == 1) {  // an odd last 32 dims (head_dim 160, 224)
      _tile_loadd(2, qt + (KC - 1) * 512, 64);
      _tile_loadd(0, k0 + 32 * (KC - 1), kstride);
      _tile_dpbf16ps(4, 0, 2);
    }
    _tile_stored(4, st + t0 * 16, 64);
  }
}

// out^T tiles ot[D / 16] += V^T x P, 32 keys at a time, 64 dims per pass, and one pass of 32
// where D % 64 == 32 (its last dims).
template <int D>
PAGEDSERVE_INLINE void pv_tiles(
    float (*ot)[16 * 16], const c10::BFloat16* pt, const c10::BFloat16* vt, int64_t vt_stride,
    int64_t vis_pad) {
  constexpr int64_t D64 = D / 64 * 64;
  if constexpr (D64 < D) {
    _tile_zero(4);
    _tile_zero(5);
    const c10::BFloat16* v0 = vt + D64 * vt_stride;
    for (int64_t t = 0; t < vis_pad; t += 32) {
      _tile_loadd(0, pt + t * 16, 64);
      _tile_loadd(1, v0 + t, vt_stride * 2);
      _tile_dpbf16ps(4, 1, 0);
      _tile_loadd(2, v0 + 16 * vt_stride + t, vt_stride * 2);
      _tile_dpbf16ps(5, 2, 0);
    }
    _tile_stored(4, ot[D64 / 16 + 0], 64);
    _tile_stored(5, ot[D64 / 16 + 1], 64);
  }
  for (int64_t d0 = 0; d0 < D64; d0 += 64) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const c10::BFloat16* v0 = vt + d0 * vt_stride;
    for (int64_t t = 0; t < vis_pad; t += 32) {
      _tile_loadd(0, pt + t * 16, 64);
      _tile_loadd(1, v0 + t, vt_stride * 2);
      _tile_dpbf16ps(4, 1, 0);
      _tile_loadd(2, v0 + 16 * vt_stride + t, vt_stride * 2);
      _tile_dpbf16ps(5, 2, 0);
      _tile_loadd(3, v0 + 32 * vt_stride + t, vt_stride * 2);
      _tile_dpbf16ps(6, 3, 0);
      _tile_loadd(1, v0 + 48 * vt_stride + t, vt_stride * 2);
      _tile_dpbf16ps(7, 1, 0);
    }
    _tile_stored(4, ot[d0 / 16 + 0], 64);
    _tile_stored(5, ot[d0 / 16 + 1], 64);
    _tile_stored(6, ot[d0 / 16 + 2], 64);
    _tile_stored(7, ot[d0 / 16 + 3], 64);
  }
}

#endif

// The vector body's tile product: C rows c[0..15] (16 float32 lanes each) += sum over the
// pairs w < pairs of A row r's pair w (broadcast) . B row w (16 lanes x 2 bf16), A rows
// a_stride elements apart, B rows 32 elements apart: AMX's _tile_dpbf16ps as 16 x pairs
// vdpbf16ps.
PAGEDSERVE_INLINE void dot_rows_vec(
    __m512 (&c)[16], const c10::BFloat16* a, int64_t a_stride, const c10::BFloat16* b,
    int64_t pairs) {
  for (int64_t w = 0; w < pairs; ++w) {
    const __m512bh bw = (__m512bh)_mm512_loadu_si512(b + w * 32);
    for (int r = 0; r < 16; ++r) {
      const int32_t aw = *reinterpret_cast<const int32_t*>(a + r * a_stride + 2 * w);
      c[r] = _mm512_dpbf16_ps(c[r], (__m512bh)_mm512_set1_epi32(aw), bw);
    }
  }
}

// score_tiles on vectors: st [key][16 queries] for the visible keys, whole 16-key tiles (the
// rows past `visible` in the last tile are computed and masked later, as on AMX).
template <int D, typename KRows>
PAGEDSERVE_INLINE void score_vec(
    float* st, const c10::BFloat16* qt, const KRows& k_rows, int64_t visible, int64_t kstride) {
  for (int64_t t0 = 0; t0 < visible; t0 += 16) {
    __m512 c[16];
    for (int r = 0; r < 16; ++r) c[r] = _mm512_setzero_ps();
    dot_rows_vec(c, k_rows(t0), kstride / 2, qt, D / 2);  // qt's pair rows lie back to back
    for (int r = 0; r < 16; ++r) _mm512_storeu_ps(st + (t0 + r) * 16, c[r]);
  }
}

// pv_tiles on vectors: ot[D / 16] = V^T x P, 16 dims at a time over all vis_pad keys.
template <int D>
PAGEDSERVE_INLINE void pv_vec(
    float (*ot)[16 * 16], const c10::BFloat16* pt, const c10::BFloat16* vt, int64_t vt_stride,
    int64_t vis_pad) {
  for (int64_t j = 0; j < D / 16; ++j) {
    __m512 c[16];
    for (int r = 0; r < 16; ++r) c[r] = _mm512_setzero_ps();
    dot_rows_vec(c, vt + 16 * j * vt_stride, vt_stride, pt, vis_pad / 2);
    for (int r = 0; r < 16; ++r) _mm512_storeu_ps(ot[j] + r * 16, c[r]);
  }
}

// nq <= 16 queries at positions pos0..pos0 + nq - 1 of one query head: keys k0 (a multiple
// of 32) to visible - 1 are read (visible = pos0 + nq for a causal block; k0 = 0 without a
// window), and the window, if any, masked; cap > 0 soft-caps the scores. lse, when given,
// receives log(sum exp(scaled scores)) per query. kAmx: tile products on AMX (tiles
// configured by amx_configure_square), else on vectors.
template <int D, typename O, bool kAmx>
void prefill_block(
    O* out, int64_t out_stride, const c10::BFloat16* q, int64_t q_stride, int64_t nq,
    int64_t pos0, int64_t k0, int64_t visible, int64_t window, float cap,
    const c10::BFloat16* k_cache, const c10::BFloat16* vt, int64_t vt_stride,
    const int32_t* blocks, int64_t block_size, int64_t token_stride, int64_t kv_head,
    float scale, PrefillScratch& s, float* lse = nullptr) {
  const int64_t nkeys = visible - k0, vis_pad = (nkeys + 31) / 32 * 32;
  pack_q_tiles<D>(s.qt, q, q_stride, nq);
  s.st.resize(vis_pad * 16);
  auto k_rows = [&](int64_t t0) {
    return k_cache + cache_slot(blocks, k0 + t0, block_size) * token_stride + kv_head * D;
  };
#ifdef PAGEDSERVE_AMX
  if constexpr (kAmx) {
    score_tiles<D>(s.st.data(), s.qt.data(), k_rows, nkeys, token_stride * 2);
  } else
#endif
  {
    score_vec<D>(s.st.data(), s.qt.data(), k_rows, nkeys, token_stride * 2);
  }
  if (cap > 0) cap_scores(s.st.data(), (nkeys + 15) / 16 * 256, cap / scale, scale / cap);
  const __mmask16 valid_q = nq >= 16 ? 0xffff : static_cast<__mmask16>((1u << nq) - 1);
  __m512 vmax, vsum;
  s.pt.resize(vis_pad * 16);
  numerators(s.pt.data(), s.st.data(), nkeys, vis_pad, pos0 - k0, window, valid_q, scale, vmax,
             vsum);
#ifdef PAGEDSERVE_AMX
  if constexpr (kAmx) {
    pv_tiles<D>(s.ot, s.pt.data(), vt + k0, vt_stride, vis_pad);
  } else
#endif
  {
    pv_vec<D>(s.ot, s.pt.data(), vt + k0, vt_stride, vis_pad);
  }
  store_rows<D>(out, out_stride, s.ot, nq, valid_q, vmax, vsum, scale, lse);
}

// prefill_block for head_dim d (prefill_shapes_ok: 64, 96, ..., 256).
template <typename O, bool kAmx, int... I>
constexpr auto prefill_block_table(std::integer_sequence<int, I...>) {
  return std::array{&prefill_block<64 + 32 * I, O, kAmx>...};
}
template <typename O, bool kAmx>
auto prefill_block_for(int64_t d) {
  static constexpr auto table =
      prefill_block_table<O, kAmx>(std::make_integer_sequence<int, 7>{});
  return table[(d - 64) / 32];
}

// Shapes, dtypes and per-sequence ranges paged_attention_prefill relies on.
void check_prefill_args(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& q_start,
    const at::Tensor& q_len, const at::Tensor& seq_lens) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: [T, H, D], heads and D contiguous");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "out: [T, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "bf16 only");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table");
  for (const at::Tensor* t : {&seq_lens, &q_start, &q_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "seq_lens, q_start, q_len: int32");
  const int64_t batch = seq_lens.numel(), heads = query.size(1), d = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(prefill_shapes_ok(d, block_size), "shapes the prefill kernel does not cover");
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == d && v_cache.sizes() == k_cache.sizes(),
              "head shapes");
  TORCH_CHECK(q_start.numel() == batch && q_len.numel() == batch && block_table.size(0) == batch,
              "one entry per sequence");
  TORCH_CHECK(out.size(0) == query.size(0) && out.size(1) == heads && out.size(2) == d,
              "out like query");
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* ql = q_len.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(qs[b] >= 0 && ql[b] >= 1 && qs[b] + ql[b] <= query.size(0) && ql[b] <= lens[b] &&
                    lens[b] <= block_table.size(1) * block_size,
                "need query rows in range and 1 <= q_len <= seq_len <= max_blocks * block_size");
}

}  // namespace


// V^T of one sequence's KV head: dst[i * pad + t] = v[t][i] for t < len, 0 for len <= t < pad
// (pad = len rounded up to 32). Per 32 keys and 16 dims: interleave each pair of rows into
// 16 words (dim i: keys 2p, 2p+1), then transpose the 16 x 16 words.
void build_vt(c10::BFloat16* dst, const c10::BFloat16* v_cache, const int32_t* blocks,
              int64_t len, int64_t block_size, int64_t token_stride, int64_t kv_head, int64_t d) {
  const int64_t pad = (len + 31) / 32 * 32;
  const __m512i lo_idx = interleave_lo16();
  auto rows_at = [&](int64_t t0) {
    const int64_t slot = cache_slot(blocks, t0, block_size);
    return v_cache + slot * token_stride + kv_head * d;
  };
  for (int64_t t0 = 0; t0 < pad; t0 += 32) {
    const c10::BFloat16* first = rows_at(t0);
    const c10::BFloat16* half[2] = {first, t0 + 16 < len ? rows_at(t0 + 16) : first};
    for (int64_t i0 = 0; i0 < d; i0 += 16) {
      __m512i r[16];
      for (int p = 0; p < 16; ++p) {
        const int64_t ta = t0 + 2 * p;
        const c10::BFloat16* ra = half[p / 8] + (2 * p % 16) * token_stride + i0;
        const __m256i a = ta < len ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra))
                                   : _mm256_setzero_si256();
        const __m256i b = ta + 1 < len
            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + token_stride))
            : _mm256_setzero_si256();
        r[p] = _mm512_permutex2var_epi16(
            _mm512_castsi256_si512(a), lo_idx, _mm512_castsi256_si512(b));
      }
      transpose16_epi32(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (i0 + i) * pad + t0, r[i]);
    }
  }
}

#ifdef PAGEDSERVE_AMX
// On by default; set_amx_prefill(false) routes paged_attention_prefill to the vector body
// (tests, benchmarks). The cascade's prefix pass stays on AMX.
std::atomic<bool> amx_prefill_enabled{true};

bool prefill_amx_applies(int64_t d, int64_t block_size) {
  return prefill_shapes_ok(d, block_size) && amx_permitted();
}

#endif

void prefill_block_f32(
    bool amx, int64_t d, float* out, int64_t out_stride, const c10::BFloat16* q,
    int64_t q_stride, int64_t nq, int64_t pos0, int64_t visible, const c10::BFloat16* k_cache,
    const c10::BFloat16* vt, int64_t vt_stride, const int32_t* blocks, int64_t block_size,
    int64_t token_stride, int64_t kv_head, float scale, PrefillScratch& s, float* lse) {
  const auto block =
#ifdef PAGEDSERVE_AMX
      amx ? prefill_block_for<float, true>(d) :
#endif
          prefill_block_for<float, false>(d);
  (void)amx;
  block(out, out_stride, q, q_stride, nq, pos0, 0, visible, 0, 0.0f, k_cache, vt, vt_stride,
        blocks, block_size, token_stride, kv_head, scale, s, lse);
}
#endif  // PAGEDSERVE_AVX512BF16

// The body paged_attention_prefill runs for these shapes: "amx", "avx512_bf16", or "" where
// it cannot run them (no AVX-512 BF16 in this build, or head_dim / block_size outside it).
std::string prefill_kernel(int64_t head_dim, int64_t block_size) {
#ifdef PAGEDSERVE_AVX512BF16
  if (!prefill_shapes_ok(head_dim, block_size)) return "";
#ifdef PAGEDSERVE_AMX
  if (amx_prefill_enabled.load(std::memory_order_relaxed) && amx_permitted()) return "amx";
#endif
  return "avx512_bf16";
#else
  return "";
#endif
}

bool prefill_supported(int64_t head_dim, int64_t block_size) {
  return !prefill_kernel(head_dim, block_size).empty();
}

bool set_amx_prefill(bool enabled) {
#ifdef PAGEDSERVE_AMX
  return amx_prefill_enabled.exchange(enabled);
#else
  (void)enabled;
  return false;
#endif
}

// Attention for sequences with any number of new tokens over their paged K/V, bottom-right
// causal (see prefill_block): sequence i's queries are rows q_start[i] .. q_start[i] +
// q_len[i] of query, and its output goes to the same rows of out; other rows are untouched.
// window > 0: each query sees its last `window` keys; softcap > 0: logit soft-capping.
void paged_attention_prefill(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& q_start,
    const at::Tensor& q_len, const at::Tensor& seq_lens, double scale, int64_t window,
    double softcap) {
#ifdef PAGEDSERVE_AVX512BF16
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  check_prefill_args(out, query, k_cache, v_cache, block_table, q_start, q_len, seq_lens);
  const int64_t batch = seq_lens.numel(), heads = query.size(1), d = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* ql = q_len.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t group = heads / kv_heads, token_stride = kv_heads * d;
  const auto* qp = query.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const auto* kp = k_cache.data_ptr<c10::BFloat16>();
  const auto* vp = v_cache.data_ptr<c10::BFloat16>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0);
  const float cap = static_cast<float>(softcap);
  // Each sequence from the block of its first visible key on (its earliest query's window):
  // keys are counted from kb[b] = first_block[b] * block_size, the blocks before never read.
  std::vector<int64_t> first_block(batch), kb(batch), klen(batch);
  for (int64_t b = 0; b < batch; ++b) {
    first_block[b] = window_start(lens[b] - ql[b], window) / block_size;
    kb[b] = first_block[b] * block_size, klen[b] = lens[b] - kb[b];
  }
  // V^T per (sequence, KV head): [D, klen padded to 32], zero past the end.
  std::vector<int64_t> vt_off(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b)
    vt_off[b + 1] = vt_off[b] + kv_heads * d * ((klen[b] + 31) / 32 * 32);
  // Reused across calls: a fresh multi-MB allocation per layer costs its page faults each time.
  static thread_local std::vector<c10::BFloat16> vt_buf;
  if (static_cast<int64_t>(vt_buf.size()) < vt_off[batch]) vt_buf.resize(vt_off[batch]);
  c10::BFloat16* vt = vt_buf.data();  // build_vt fills every element used
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      build_vt(vt + vt_off[b] + h * d * ((klen[b] + 31) / 32 * 32), vp,
               bt + b * bt_stride + first_block[b], klen[b], block_size, token_stride, h, d);
    }
  });
  // tasks: (sequence, query head, 16-query block)
  std::vector<int64_t> task_off(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) task_off[b + 1] = task_off[b] + heads * ((ql[b] + 15) / 16);
  const bool amx = prefill_kernel(d, block_size) == "amx";
  const auto block_fn =
#ifdef PAGEDSERVE_AMX
      amx ? prefill_block_for<c10::BFloat16, true>(d) :
#endif
          prefill_block_for<c10::BFloat16, false>(d);
  auto run_tasks = [&](int64_t begin, int64_t end, PrefillScratch& scratch) {
    int64_t b = std::upper_bound(task_off.begin(), task_off.end(), begin) - task_off.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_off[b + 1]) ++b;
      const int64_t q_len = ql[b], len = klen[b], qblocks = (q_len + 15) / 16;
      const int64_t local = task - task_off[b], head = local / qblocks, j0 = (local % qblocks) * 16;
      const int64_t nq = std::min<int64_t>(16, q_len - j0), h = head / group;
      const int64_t pad = (len + 31) / 32 * 32, row0 = qs[b] + j0;
      const int64_t pos0 = len - q_len + j0;  // from kb[b]
      const int64_t k0 = window_start(pos0, window) / 32 * 32;  // whole 32-key steps of V^T
      block_fn(
          op + row0 * out.stride(0) + head * d, out.stride(0),
          qp + row0 * query.stride(0) + head * d, query.stride(0), nq, pos0, k0, pos0 + nq,
          window, cap, kp, vt + vt_off[b] + h * d * pad, pad, bt + b * bt_stride + first_block[b],
          block_size, token_stride, h, static_cast<float>(scale), scratch, nullptr);
    }
  };
  WorkQueue(task_off[batch]).run([&](WorkQueue& queue) {
#ifdef PAGEDSERVE_AMX
    if (amx) amx_configure_square();
#endif
    PrefillScratch scratch;
    int64_t begin, end;
    while (queue.take(begin, end)) run_tasks(begin, end, scratch);
#ifdef PAGEDSERVE_AMX
    if (amx) _tile_release();
#endif
  });
#else
  TORCH_CHECK(false, "built without AVX-512 BF16 support");
#endif
}

}  // namespace pagedserve_cpu
