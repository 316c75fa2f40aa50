// paged_attention_decode: one query token per sequence over its paged K/V, GQA-aware, with an
// optional sliding window (keys [start, len), start = window_start(len - 1, window): the blocks
// before start's are never read) and logit soft-capping (scores = cap * tanh(scores / cap)).
// Three bodies, picked per call (decode_path, reported by decode_kernel):
//   AMX (bf16, head_dim a multiple of 32 from 64 on, block_size % 16 == 0): decode_heads_amx,
//     also the cascade's suffix pass (decode.h);
//   AVX-512 with head_dim a multiple of 16 in [64, 256] in registers: decode_seq_vec (all heads
//     of a sequence per task) or decode_one_vec (one KV head per task);
//   portable: decode_one (every other head_dim, float16).
#include "decode.h"

#include "common.h"
#include "ops.h"

#include <array>

namespace pagedserve_cpu {
namespace {

// One (sequence, KV head) pair: the G query heads of that group against the sequence's keys
// [start, len). Two passes: scores for every key, then a softmax-weighted sum of the values.
template <typename T>
void decode_one(
    T* out, int64_t out_head_stride, const T* q, int64_t q_head_stride, const T* k_cache,
    const T* v_cache, const int32_t* blocks, int64_t start, int64_t len, int64_t block_size,
    int64_t kv_heads, int64_t kv_head, int64_t group, int64_t d, float scale, float cap,
    std::vector<float>& buf) {
  const int64_t n = len - start;
  buf.resize(group * (n + 2 * d));
  float* scores = buf.data();             // [G, n]
  float* qf = scores + group * n;         // [G, D]
  float* acc = qf + group * d;            // [G, D]
  for (int64_t g = 0; g < group; ++g) {
    const T* qg = q + g * q_head_stride;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_f(qg[i]) * scale;
  }
  const int64_t token_stride = kv_heads * d;
  for (int64_t t = start; t < len; ++t) {
    const int64_t slot = cache_slot(blocks, t, block_size);
    const T* kr = k_cache + slot * token_stride + kv_head * d;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * d;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += qg[i] * to_f(kr[i]);
      scores[g * n + t - start] = s;
    }
  }
  if (cap > 0) cap_scores(scores, group * n, cap, 1.0f / cap);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    float m = -INFINITY;
    for (int64_t t = 0; t < n; ++t) m = std::fmax(m, sg[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      float e = exp_approx(sg[t] - m);
      sg[t] = e;
      sum += e;
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
  }
  std::fill(acc, acc + group * d, 0.0f);
  for (int64_t t = start; t < len; ++t) {
    const int64_t slot = cache_slot(blocks, t, block_size);
    const T* vr = v_cache + slot * token_stride + kv_head * d;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + t - start];
      float* ag = acc + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ag[i] += p * to_f(vr[i]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    T* og = out + g * out_head_stride;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) og[i] = from_f<T>(acc[g * d + i]);
  }
}

#ifdef PAGEDSERVE_AVX512
// Softmax of n scores in place (max-subtracted, float32).
inline void softmax_inplace(float* s, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
  float m = _mm512_reduce_max_ps(vmax);
  for (; t < n; ++t) m = std::fmax(m, s[t]);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (; t < n; ++t) {
    s[t] = exp_approx(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.0f / sum;
  for (t = 0; t < n; ++t) s[t] *= inv;
}

// decode_one with head_dim = 16 * NC held in registers: per key one multiply-add chain and
// one horizontal sum per query head; per value one multiply-add per head and chunk. HG query
// heads at a time: four up to head_dim 128, two below 256, one at 256 (its q alone fills half
// the registers). HG changes no result bit: each head's sums run in the same order.
template <typename T, int NC>
void decode_one_vec(
    T* out, int64_t out_head_stride, const T* q, int64_t q_head_stride, const T* k_cache,
    const T* v_cache, const int32_t* blocks, int64_t start, int64_t len, int64_t block_size,
    int64_t kv_heads, int64_t kv_head, int64_t group, float scale, float cap,
    std::vector<float>& buf) {
  constexpr int64_t d = 16 * NC;
  constexpr int64_t HG = NC >= 16 ? 1 : NC > 8 ? 2 : 4;
  const int64_t n = len - start;
  buf.resize(group * n + 16);
  float* scores = buf.data();  // [G, n]
  const int64_t token_stride = kv_heads * d;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g0 = 0; g0 < group; g0 += HG) {  // HG query heads at a time stay in registers
    const int64_t ng = std::min<int64_t>(HG, group - g0);
    __m512 qv[HG][NC];
    for (int64_t g = 0; g < ng; ++g)
      for (int c = 0; c < NC; ++c)
        qv[g][c] = _mm512_mul_ps(load16(q + (g0 + g) * q_head_stride + 16 * c), vscale);
    for (int64_t t = start; t < len; ++t) {
      const int64_t slot = cache_slot(blocks, t, block_size);
      const T* kr = k_cache + slot * token_stride + kv_head * d;
      __m512 kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = load16(kr + 16 * c);
      for (int64_t g = 0; g < ng; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
        scores[(g0 + g) * n + t - start] = _mm512_reduce_add_ps(acc);
      }
    }
  }
  if (cap > 0) cap_scores(scores, group * n, cap, 1.0f / cap);
  for (int64_t g = 0; g < group; ++g) softmax_inplace(scores + g * n, n);
  for (int64_t g0 = 0; g0 < group; g0 += HG) {
    const int64_t ng = std::min<int64_t>(HG, group - g0);
    __m512 acc[HG][NC];
    for (int64_t g = 0; g < HG; ++g)
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = start; t < len; ++t) {
      const int64_t slot = cache_slot(blocks, t, block_size);
      const T* vr = v_cache + slot * token_stride + kv_head * d;
      __m512 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = load16(vr + 16 * c);
      for (int64_t g = 0; g < ng; ++g) {
        const __m512 p = _mm512_set1_ps(scores[(g0 + g) * n + t - start]);
        for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
    for (int64_t g = 0; g < ng; ++g)
      for (int c = 0; c < NC; ++c) store16(out + (g0 + g) * out_head_stride + 16 * c, acc[g][c]);
  }
}
#endif

#ifdef PAGEDSERVE_AVX512
// All heads of one sequence at once: each key/value row ([Hkv, D], contiguous) is read whole,
// so every cache line fetched is used; rows a few tokens ahead are prefetched, across blocks.
template <typename T, int NC>
void decode_seq_vec(
    T* out, int64_t out_head_stride, const T* q, int64_t q_head_stride, const T* k_cache,
    const T* v_cache, const int32_t* blocks, int64_t start, int64_t len, int64_t block_size,
    int64_t kv_heads, int64_t group, float scale, float cap, std::vector<float>& buf) {
  constexpr int64_t d = 16 * NC;
  constexpr int64_t kAhead = 4;
  const int64_t heads = kv_heads * group, token_stride = kv_heads * d, n = len - start;
  buf.resize(heads * (n + 2 * d) + 32);
  float* scores = buf.data();         // [H, n]
  float* qf = scores + heads * n;     // [H, D]
  float* acc = qf + heads * d;        // [H, D]
  for (int64_t h = 0; h < heads; ++h)
    for (int c = 0; c < NC; ++c)
      _mm512_storeu_ps(
          qf + h * d + 16 * c,
          _mm512_mul_ps(load16(q + h * q_head_stride + 16 * c), _mm512_set1_ps(scale)));
  auto row_of = [&](const T* cache, int64_t t) {
    const int64_t slot = cache_slot(blocks, t, block_size);
    return cache + slot * token_stride;
  };
  auto prefetch_row = [&](const T* row) {
    const char* p = reinterpret_cast<const char*>(row);
    for (int64_t b = 0; b < token_stride * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(p + b, _MM_HINT_T0);
  };
  for (int64_t t = start; t < len; ++t) {
    if (t + kAhead < len) prefetch_row(row_of(k_cache, t + kAhead));
    const T* kr = row_of(k_cache, t);
    for (int64_t h = 0; h < kv_heads; ++h) {
      __m512 kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = load16(kr + h * d + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        const float* qh = qf + (h * group + g) * d;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
        for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kv[c], a);
        scores[(h * group + g) * n + t - start] = _mm512_reduce_add_ps(a);
      }
    }
  }
  if (cap > 0) cap_scores(scores, heads * n, cap, 1.0f / cap);
  for (int64_t h = 0; h < heads; ++h) softmax_inplace(scores + h * n, n);
  std::fill(acc, acc + heads * d, 0.0f);
  for (int64_t t = start; t < len; ++t) {
    if (t + kAhead < len) prefetch_row(row_of(v_cache, t + kAhead));
    const T* vr = row_of(v_cache, t);
    for (int64_t h = 0; h < kv_heads; ++h) {
      __m512 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = load16(vr + h * d + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = h * group + g;
        const __m512 p = _mm512_set1_ps(scores[head * n + t - start]);
        float* ah = acc + head * d;
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(ah + 16 * c, _mm512_fmadd_ps(p, vv[c], _mm512_loadu_ps(ah + 16 * c)));
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int c = 0; c < NC; ++c)
      store16(out + h * out_head_stride + 16 * c, _mm512_loadu_ps(acc + h * d + 16 * c));
}
#endif

#ifdef PAGEDSERVE_AMX
// ---- decode attention on AMX (bf16, head_dim % 32 == 0 from 64, block_size % 16 == 0) -----
// Per (sequence, KV head), with G = query heads per KV head:
//   scores^T [16 tokens, G] = K rows (an A tile read straight from the cache, row stride =
//     the token stride) x q^T (a B tile: row r holds q[g][2r], q[g][2r+1] for each g);
//   softmax over tokens in float32, probabilities rounded to bf16 (as flash attention does);
//   out [G, 64 dims] += P [G, len] x V in AVX-512 float32 FMAs (pv_f32; 96 dims in the last
//     pass of a head_dim 64k + 32), the value rows read straight from the cache. On this CPU
//     float32 FMAs beat bf16 dot products for P x V (bench/README.md, "Decode attention: P x V
//     in float32 FMAs").
// Tile registers (amx_configure_decode): 0 K tile, 1 q^T, 2 scores.

// out[g, d0:d0+32*DC] (DC = 2: 64 dims; 3: 96, the last pass of a head_dim 64k + 32) for NG
// query heads of one KV head: P [NG, len] x V in float32 FMAs, the 2 * DC x NG accumulators in
// registers. Each value row's 32-bit words hold dims (2j, 2j+1): a shift and a mask widen them
// to float32 (even and odd dims in separate registers, put back in order at the end).
// `rows_at(t0)` gives the 16 rows from token t0 (they lie in one block).
// V streams from memory here, prefetched a tile ahead; pulled into L2 during the K pass
// instead, it queued behind K (bench/README.md, "Decode attention: V streams during P x V").
// Out of line, so the accumulators get registers of their own.
template <int NG, int DC, typename O, typename RowsAt>
__attribute__((noinline)) void pv_f32(
    O* out, int64_t out_head_stride, const float* probs, int64_t len_pad, const float* inv_sum,
    RowsAt rows_at, int64_t len, int64_t token_stride) {
  constexpr int NV = 2 * DC;
  __m512 acc[NG][NV];  // [g]: even dims 0-30, odd dims 1-31, even 32-62, odd 33-63, ...
#pragma GCC unroll 4
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 6
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const c10::BFloat16* rows = rows_at(t0);
    if (t0 + 16 < len) {  // the next 16 rows' dims (one line per 32) on their way from memory
      const char* next = reinterpret_cast<const char*>(rows_at(t0 + 16));
      for (int64_t r = 0; r < 16; ++r, next += token_stride * 2)
#pragma GCC unroll 3
        for (int c = 0; c < DC; ++c) _mm_prefetch(next + 64 * c, _MM_HINT_T0);
    }
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t i = 0; i < n; ++i) {
      const c10::BFloat16* row = rows + i * token_stride;
      __m512 v[NV];
#pragma GCC unroll 3
      for (int c = 0; c < DC; ++c) {
        const __m512i w = _mm512_loadu_si512(row + 32 * c);
        v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        v[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, odd_mask));
      }
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g * len_pad + t0 + i]);
#pragma GCC unroll 6
        for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
      }
    }
  }
  // (even, odd) -> dims in order: lanes 0-15 of (e, o) interleaved, then lanes 16-31
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int g = 0; g < NG; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    O* o = out + g * out_head_stride;
    for (int c = 0; c < NV; c += 2) {
      store16(o + 16 * c, _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][c], lo, acc[g][c + 1]), inv));
      store16(o + 16 * c + 16,
              _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][c], hi, acc[g][c + 1]), inv));
    }
  }
}

// pv_f32 for ng (1 to 4) query heads.
template <int DC, typename O, typename RowsAt>
PAGEDSERVE_INLINE void pv_dims(
    int64_t ng, O* out, int64_t out_head_stride, const float* probs, int64_t len_pad,
    const float* inv_sum, RowsAt rows_at, int64_t len, int64_t token_stride) {
  auto* run = ng == 1 ? pv_f32<1, DC, O, RowsAt>
      : ng == 2       ? pv_f32<2, DC, O, RowsAt>
      : ng == 3       ? pv_f32<3, DC, O, RowsAt>
                      : pv_f32<4, DC, O, RowsAt>;
  run(out, out_head_stride, probs, len_pad, inv_sum, rows_at, len, token_stride);
}

// q^T in B-tile layout: [head][32-dim chunk] tiles whose row r is (q[g][2r], q[g][2r+1])_g.
PAGEDSERVE_INLINE void pack_q_tiles(
    c10::BFloat16* qt, const c10::BFloat16* q, int64_t q_head_stride, int64_t h0, int64_t nh,
    int64_t kchunks, int64_t group) {
  const int64_t qt_size = 16 * group * 2;
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t c = 0; c < kchunks; ++c)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const c10::BFloat16* qg = q + ((h0 + h) * group + g) * q_head_stride + 32 * c + 2 * r;
          c10::BFloat16* dst = qt + (h * kchunks + c) * qt_size + r * group * 2 + 2 * g;
          dst[0] = qg[0];
          dst[1] = qg[1];
        }
}

// scores^T, 16 tokens per tile, kept as the tiles hold them: st [head][len_pad][G]. The next
// tile's K rows are prefetched while this one's dot products run.
template <typename RowsAt, typename PrefetchRows>
PAGEDSERVE_INLINE void score_tiles(
    float* st, const c10::BFloat16* qt, const c10::BFloat16* k_cache, const RowsAt& rows_at,
    const PrefetchRows& prefetch_rows, int64_t len, int64_t len_pad, int64_t nh, int64_t kchunks,
    int64_t group, int64_t d, int64_t token_stride) {
  const int64_t qt_size = 16 * group * 2;
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const c10::BFloat16* k0 = rows_at(k_cache, t0);
    if (t0 + 16 < len) prefetch_rows(rows_at(k_cache, t0 + 16), _MM_HINT_T0);
    for (int64_t h = 0; h < nh; ++h) {
      _tile_zero(2);
      for (int64_t c = 0; c < kchunks; ++c) {
        _tile_loadd(0, k0 + h * d + 32 * c, token_stride * 2);
        _tile_loadd(1, qt + (h * kchunks + c) * qt_size, group * 4);
        _tile_dpbf16ps(2, 0, 1);
      }
      _tile_stored(2, st + (h * len_pad + t0) * group, group * 4);
    }
  }
}

// One query head's softmax numerators, rounded to bf16 (kept as float32), into pg [len_pad],
// zero before `lead` (< 16: keys left of a window) and past the end; its column of the tiles'
// [token][G] layout (src, stride G) is gathered and scaled into sg first. Returns the sum of
// the numerators and sets max_score.
PAGEDSERVE_INLINE float head_numerators(
    float* pg, float* sg, const float* src, int64_t lead, int64_t len, int64_t len_pad,
    int64_t group, float scale, float& max_score) {
  const __mmask16 first_live = static_cast<__mmask16>(0xffffu << lead);
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int32_t>(group)));
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += 16) {
    __mmask16 live = t + 16 <= len ? 0xffff : (1u << (len - t)) - 1;
    if (t == 0) live &= first_live;
    const __m512 v = _mm512_mul_ps(
        _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, src + t * group, 4), vscale);
    _mm512_storeu_ps(sg + t, v);
    vmax = _mm512_mask_max_ps(vmax, live, vmax, v);
  }
  max_score = _mm512_reduce_max_ps(vmax);
  const __m512 vm = _mm512_set1_ps(max_score);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < len_pad; t += 16) {
    __mmask16 live = t + 16 <= len ? 0xffff : t < len ? (1u << (len - t)) - 1 : 0;
    if (t == 0) live &= first_live;
    __m512 e = _mm512_maskz_mov_ps(
        live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + t), vm)));
    e = round_bf16(e);
    vsum = _mm512_add_ps(vsum, e);
    _mm512_storeu_ps(pg + t, e);
  }
  return _mm512_reduce_add_ps(vsum);
}

// KV heads [h0, h1) of one sequence over its keys [start, len): q^T tiles, scores on AMX,
// soft-capping (cap > 0), softmax numerators, P x V. Tiles start at `start` rounded down to 16
// (inside its block); the keys before start in that tile are masked.
// lse, when given, receives log(sum exp(scaled scores)) per query head (indexed like the heads).
template <typename O>
void decode_heads_amx(
    O* out, int64_t out_head_stride, const c10::BFloat16* q, int64_t q_head_stride,
    const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* blocks,
    int64_t start, int64_t len_abs, int64_t block_size, int64_t kv_heads, int64_t h0, int64_t h1,
    int64_t group, int64_t d, float scale, float cap, DecodeAmxScratch& s,
    float* lse = nullptr) {
  const int64_t base = start / 16 * 16, lead = start - base, len = len_abs - base;
  const int64_t token_stride = kv_heads * d, len_pad = (len + 31) / 32 * 32;
  const int64_t kchunks = d / 32, nh = h1 - h0;
  // The 16 rows starting at token base + t0 (t0 a multiple of 16) lie in one block: heads
  // h0..h1-1.
  auto rows_at = [&](const c10::BFloat16* cache, int64_t t0) {
    return cache + cache_slot(blocks, base + t0, block_size) * token_stride + h0 * d;
  };
  auto prefetch_rows = [&](const c10::BFloat16* rows, auto hint) {  // 16 rows x these heads
    const char* p = reinterpret_cast<const char*>(rows);
    for (int64_t r = 0; r < 16; ++r, p += token_stride * 2)
      for (int64_t b = 0; b < nh * d * 2; b += 64) _mm_prefetch(p + b, hint);
  };
  s.qt.resize(nh * kchunks * 16 * group * 2);
  pack_q_tiles(s.qt.data(), q, q_head_stride, h0, nh, kchunks, group);
  s.st.resize(nh * len_pad * group);
  score_tiles(s.st.data(), s.qt.data(), k_cache, rows_at, prefetch_rows, len, len_pad, nh,
              kchunks, group, d, token_stride);
  if (cap > 0) cap_scores(s.st.data(), nh * len_pad * group, cap / scale, scale / cap);
  // [head][G][len_pad] numerators; 1 / sum goes on the output.
  s.scores.resize(len_pad);
  s.probs.resize(nh * group * len_pad);
  std::vector<float>& inv_sum = s.inv_sum;
  inv_sum.resize(nh * group);
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t g = 0; g < group; ++g) {
      float max_score;
      const float sum = head_numerators(
          s.probs.data() + (h * group + g) * len_pad, s.scores.data(),
          s.st.data() + h * len_pad * group + g, lead, len, len_pad, group, scale, max_score);
      inv_sum[h * group + g] = 1.0f / sum;
      if (lse) lse[(h0 + h) * group + g] = max_score + std::log(sum);
    }
  // P x V, 64 output dims (the last 96 where d % 64 == 32) and up to 4 query heads at a time.
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t d0 = 0; d0 < d; d0 += 64) {
      const bool last96 = d - d0 == 96;
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t ng = std::min<int64_t>(4, group - g0);
        auto rows = [&](int64_t t0) { return rows_at(v_cache, t0) + h * d + d0; };
        O* o = out + ((h0 + h) * group + g0) * out_head_stride + d0;
        const float* p = s.probs.data() + (h * group + g0) * len_pad;
        const float* inv = inv_sum.data() + h * group + g0;
        if (last96) {
          pv_dims<3>(ng, o, out_head_stride, p, len_pad, inv, rows, len, token_stride);
        } else {
          pv_dims<2>(ng, o, out_head_stride, p, len_pad, inv, rows, len, token_stride);
        }
      }
      if (last96) break;
    }
}

// On by default; set_amx_decode(false) routes bf16 to the AVX-512 paths (tests, benchmarks).
std::atomic<bool> amx_decode_enabled{true};
#endif

// Whether the register-resident kernels cover head_dim d: 16 * NC for NC in [4, 16].
constexpr bool vec_dim(int64_t d) { return d % 16 == 0 && d >= 64 && d <= 256; }

#ifdef PAGEDSERVE_AVX512
// decode_one_vec / decode_seq_vec for head_dim d (vec_dim(d)), one entry per NC = d / 16 - 4.
template <typename T, int... I>
constexpr auto one_vec_table(std::integer_sequence<int, I...>) {
  return std::array{&decode_one_vec<T, I + 4>...};
}
template <typename T, int... I>
constexpr auto seq_vec_table(std::integer_sequence<int, I...>) {
  return std::array{&decode_seq_vec<T, I + 4>...};
}
template <typename T>
auto one_vec_for(int64_t d) {
  static constexpr auto table = one_vec_table<T>(std::make_integer_sequence<int, 13>{});
  return table[d / 16 - 4];
}
template <typename T>
auto seq_vec_for(int64_t d) {
  static constexpr auto table = seq_vec_table<T>(std::make_integer_sequence<int, 13>{});
  return table[d / 16 - 4];
}
#endif

// Picks the register-resident kernel where vec_dim(d) holds on AVX-512, else the portable one.
template <typename T>
void decode_dispatch(
    T* out, int64_t out_head_stride, const T* q, int64_t q_head_stride, const T* k_cache,
    const T* v_cache, const int32_t* blocks, int64_t start, int64_t len, int64_t block_size,
    int64_t kv_heads, int64_t kv_head, int64_t group, int64_t d, float scale, float cap,
    std::vector<float>& buf) {
#ifdef PAGEDSERVE_AVX512
  if constexpr (kVec<T>) {
    if (vec_dim(d))
      return one_vec_for<T>(d)(
          out, out_head_stride, q, q_head_stride, k_cache, v_cache, blocks, start, len,
          block_size, kv_heads, kv_head, group, scale, cap, buf);
  }
#endif
  decode_one(
      out, out_head_stride, q, q_head_stride, k_cache, v_cache, blocks, start, len, block_size,
      kv_heads, kv_head, group, d, scale, cap, buf);
}

enum class DecodePath { kAmx, kSeqVec, kHeadVec, kPortable };

// The body decode_batch runs: AMX where decode_amx_applies (bf16), else on AVX-512 the
// register kernels (per sequence when the batch fills every thread twice), else portable.
template <typename T>
DecodePath decode_path(int64_t d, int64_t block_size, int64_t group, int64_t batch) {
#ifdef PAGEDSERVE_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (decode_amx_applies(d, block_size, group)) return DecodePath::kAmx;
  }
#endif
#ifdef PAGEDSERVE_AVX512
  if constexpr (kVec<T>) {
    if (vec_dim(d))
      return batch >= 2 * at::get_num_threads() ? DecodePath::kSeqVec : DecodePath::kHeadVec;
  }
#endif
  return DecodePath::kPortable;
}

// One task per sequence (all heads) when there are enough sequences to keep every thread
// busy, else one per (sequence, KV head).
template <typename T>
void decode_batch(
    T* out, int64_t out_stride, int64_t out_head_stride, const T* q, int64_t q_stride,
    int64_t q_head_stride, const T* k_cache, const T* v_cache, const int32_t* block_table,
    int64_t bt_stride, const int32_t* lens, int64_t batch, int64_t block_size, int64_t kv_heads,
    int64_t group, int64_t d, float scale, int64_t window, float cap) {
  // each sequence's query sits at len - 1; its window starts at window_start(len - 1, window)
  auto start_of = [&](int64_t b) { return window_start(lens[b] - 1, window); };
  const DecodePath path = decode_path<T>(d, block_size, group, batch);
#ifdef PAGEDSERVE_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (path == DecodePath::kAmx) {
      // Per sequence (all its KV heads) when the batch fills every thread, else per KV head.
      const bool per_seq = batch >= 2 * at::get_num_threads();
      const int64_t tasks = per_seq ? batch : batch * kv_heads;
      WorkQueue(tasks).run([&](WorkQueue& queue) {
        amx_configure_decode(group);
        DecodeAmxScratch scratch;
        int64_t begin, end;
        while (queue.take(begin, end)) {
          for (int64_t task = begin; task < end; ++task) {
            const int64_t b = per_seq ? task : task / kv_heads;
            const int64_t h0 = per_seq ? 0 : task % kv_heads, h1 = per_seq ? kv_heads : h0 + 1;
            decode_heads_amx(
                out + b * out_stride, out_head_stride, q + b * q_stride, q_head_stride, k_cache,
                v_cache, block_table + b * bt_stride, start_of(b), lens[b], block_size, kv_heads,
                h0, h1, group, d, scale, cap, scratch);
          }
        }
        _tile_release();
      });
      return;
    }
  }
#endif
#ifdef PAGEDSERVE_AVX512
  if constexpr (kVec<T>) {
    if (path == DecodePath::kSeqVec) {
      const auto run = seq_vec_for<T>(d);
      at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> buf;
        for (int64_t b = begin; b < end; ++b) {
          run(out + b * out_stride, out_head_stride, q + b * q_stride, q_head_stride, k_cache,
              v_cache, block_table + b * bt_stride, start_of(b), lens[b], block_size, kv_heads,
              group, scale, cap, buf);
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t head0 = h * group;
      decode_dispatch(
          out + b * out_stride + head0 * out_head_stride, out_head_stride,
          q + b * q_stride + head0 * q_head_stride, q_head_stride, k_cache, v_cache,
          block_table + b * bt_stride, start_of(b), lens[b], block_size, kv_heads, h, group, d,
          scale, cap, buf);
    }
  });
}

}  // namespace

#ifdef PAGEDSERVE_AMX
bool decode_amx_applies(int64_t d, int64_t block_size, int64_t group) {
  return amx_decode_enabled.load(std::memory_order_relaxed) && d % 32 == 0 && d >= 64 &&
         block_size % 16 == 0 && group <= 16 && amx_permitted();
}

void decode_heads_amx_f32(
    float* out, int64_t out_head_stride, const c10::BFloat16* q, int64_t q_head_stride,
    const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* blocks,
    int64_t len, int64_t block_size, int64_t kv_heads, int64_t h0, int64_t h1, int64_t group,
    int64_t d, float scale, DecodeAmxScratch& s, float* lse) {
  decode_heads_amx(out, out_head_stride, q, q_head_stride, k_cache, v_cache, blocks, 0, len,
                   block_size, kv_heads, h0, h1, group, d, scale, 0.0f, s, lse);
}
#endif

void paged_attention_decode(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
    double scale, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [B, H, D], D contiguous");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1, "out: [B, H, D], D contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens");
  const int64_t batch = query.size(0), heads = query.size(1), d = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == d, "head shapes");
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(out.size(0) == batch && out.size(1) == heads && out.size(2) == d, "out like query");
  TORCH_CHECK(block_table.size(0) == batch && seq_lens.numel() == batch, "one row per sequence");
  TORCH_CHECK(
      out.scalar_type() == query.scalar_type() && k_cache.scalar_type() == query.scalar_type() &&
          v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
      "dtypes and cache shapes must agree");
  TORCH_CHECK(
      all_in_range(seq_lens.data_ptr<int32_t>(), batch, 1, block_table.size(1) * block_size),
      "seq_lens must be in [1, max_blocks * block_size]");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_decode", [&] {
        const scalar_t* qp = query.data_ptr<scalar_t>();
        scalar_t* op = out.data_ptr<scalar_t>();
        const scalar_t* kp = k_cache.data_ptr<scalar_t>();
        const scalar_t* vp = v_cache.data_ptr<scalar_t>();
        const int32_t* bt = block_table.data_ptr<int32_t>();
        const int32_t* lens = seq_lens.data_ptr<int32_t>();
        decode_batch(
            op, out.stride(0), out.stride(1), qp, query.stride(0), query.stride(1), kp, vp, bt,
            block_table.stride(0), lens, batch, block_size, kv_heads, group, d,
            static_cast<float>(scale), window, static_cast<float>(softcap));
      });
}

// The body paged_attention_decode runs for this query and cache: "amx", "avx512_seq" (all
// heads of a sequence per task), "avx512_head" (one KV head per task) or "portable".
std::string decode_kernel(const at::Tensor& query, const at::Tensor& k_cache) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query [B, H, D], k_cache [N, bs, Hkv, D]");
  const int64_t d = query.size(2), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(kv_heads > 0 && query.size(1) % kv_heads == 0, "head shapes");
  const int64_t group = query.size(1) / kv_heads;
  DecodePath path = DecodePath::kPortable;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode_kernel",
                                  [&] { path = decode_path<scalar_t>(d, block_size, group,
                                                                     query.size(0)); });
  switch (path) {
    case DecodePath::kAmx: return "amx";
    case DecodePath::kSeqVec: return "avx512_seq";
    case DecodePath::kHeadVec: return "avx512_head";
    default: return "portable";
  }
}

// Whether bf16 decode attention may use AMX; returns the previous setting.
bool set_amx_decode(bool enabled) {
#ifdef PAGEDSERVE_AMX
  return amx_decode_enabled.exchange(enabled);
#else
  return false;
#endif
}

}  // namespace pagedserve_cpu
