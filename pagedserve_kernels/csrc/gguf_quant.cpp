// GGUF-quantized linears served packed: gguf_linear, gguf_dequantize, gguf_kernel,
// set_gguf_portable. out[M, N] = x[M, K] @ W[N, K]^T where W stays in its quantized form.
//
// engine/layers/quantization/gguf.py re-packs every GGUF type at load into one layout of unsigned
// quants u (bits = 4, 5, 6 or 8 per weight) with scales, so one kernel serves them all:
//   W[n, k] = s[n, k / sub] * (u[n, k] - zero)           (Q8_0 128, Q4_0 8, Q5_0 16, Q6_K 32)
//   W[n, k] = s[n, k / sub] * u[n, k] + m[n, k / 32]     (the types with a min: Q4_1, Q5_1, Q4_K)
// sub = 32 (16 for Q6_K, whose scales cover 16 weights). Channels go in groups of 16 and k in
// blocks of 32; one 64-byte vector holds four consecutive k of the 16 channels (vpdpbusd's
// operand layout, as in quant_linear.cpp):
//   qs [G, B, 4 or 8, 64]  8 bits: vector v is k 4v..4v+3 of the block; fewer bits: the low
//                          nibble of vector v is k 4v.., the high nibble k 4(v+4)..
//   qh [G, B, 1 or 2, 64]  5 bits: bit v of a byte is bit 4 of vector v's quant;
//                          6 bits: bits 2t, 2t+1 of vector h are bits 4-5 of vector 4h + t's
//   scales [G, B * 32 / sub, 16], mins [G, B, 16]: fp16 for the 32-weight types (Q8_0, Q4_0,
//                          Q4_1, Q5_0, Q5_1: the file's own fp16 d and m, so Q4_0 is 18 bytes
//                          per 32 weights as in the file), float32 for the K types (d * sc is
//                          not fp16-exact); mins have the scales' dtype. Read widened to
//                          float32, which is exact.
// x is quantized here per 32-block as llama.cpp's Q8_0 activations are: d = max|x| / 127,
// q = round-half-even(x / d). The integer dot of u and q over a (sub-)block is exact; with
// xsum = sum q it gives sum_k W x = d * (s * dot + (m or -zero * s) * xsum). Each output is
// rounded once to x's dtype. AVX-512 VNNI where the build has it, a portable loop elsewhere
// (or when set_gguf_portable). Many rows go to gguf_dequantize + a bf16 matmul (the Python side
// picks, bench/quantization.py measures the threshold). gguf_dequantize_rows gathers rows of W
// (a packed embedding's lookup).
#include "common.h"
#include "gguf_layout.h"
#include "ops.h"

#include <optional>
#include <string>

namespace pagedserve_cpu {
namespace {

constexpr int64_t kLanes = 16;  // output channels per group
constexpr int64_t kBlock = 32;  // k per block
constexpr int kRows = 4;        // rows sharing one weight decode
constexpr int64_t kRowTile = 64;  // rows per work item: a group's weights stay in L1 over them

std::atomic<bool> g_portable{false};

// x quantized per 32-block, once for every part of a linear: q int8 [M, K], d [M, K / 32] and
// the sums of q per 16 k [M, K / 16].
struct ActQuant {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sums;
  int64_t m, k;
};

// What one part's kernel reads: per (row, sub-block) the float factors of the dot (xd = d) and
// of the sum (xc = d * xsum, times -zero for the types without a min).
struct ActRows {
  const int8_t* q;            // [M, K]
  std::vector<float> xd, xc;  // [M, K / sub]
  int64_t k, subs;
};

#ifdef PAGEDSERVE_AVX512
// One 32-block of x quantized in two vectors of 16, the scalar loop's operations lane by lane
// (abs, max, one IEEE division per element, round-half-even, clamp): the same bits. Returns d;
// sums[h] = sum of the quants of k 16h..16h+15.
template <typename T>
PAGEDSERVE_INLINE float quantize_block16x2(const T* xb, int8_t* qb, int32_t* sums) {
  const __m512 lo = load16(xb), hi = load16(xb + 16);
  // max(|x|, acc) keeps acc where |x| is NaN, as std::fmax(acc, |x|) does
  const __m512 amax =
      _mm512_max_ps(_mm512_abs_ps(hi), _mm512_max_ps(_mm512_abs_ps(lo), _mm512_setzero_ps()));
  const float d = _mm512_reduce_max_ps(amax) / 127.0f;
  if (d == 0.0f) {
    std::memset(qb, 0, kBlock);
    sums[0] = sums[1] = 0;
    return d;
  }
  const __m512 vd = _mm512_set1_ps(d);
  const __m512 lim = _mm512_set1_ps(127.0f), neg = _mm512_set1_ps(-127.0f);
  const __m512 halves[2] = {lo, hi};
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(halves[h], vd),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // max(v, -127) then min(., 127): NaN goes to -127 as std::fmax / std::fmin take it
    const __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, neg), lim));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16 * h), _mm512_cvtsepi32_epi8(qi));
    sums[h] = _mm512_reduce_add_epi32(qi);
  }
  return d;
}
#endif

// One row of x: d = max|x| / 127, q = round-half-even(x / d) per 32-block.
template <typename T>
void quantize_act_row(const T* x, int64_t k, int8_t* q, float* d, int32_t* sums) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const T* xb = x + b * kBlock;
    int8_t* qb = q + b * kBlock;
    int32_t* sb = sums + 2 * b;
#ifdef PAGEDSERVE_AVX512
    if constexpr (kVec<T>) {
      d[b] = quantize_block16x2(xb, qb, sb);
      continue;
    }
#endif
    float amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(to_f(xb[i])));
    const float db = amax / 127.0f;
    sb[0] = sb[1] = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      // a division (not a multiply by 1/d) rounds as the torch oracle's does
      const float v = db == 0.0f ? 0.0f : std::nearbyint(to_f(xb[i]) / db);
      qb[i] = static_cast<int8_t>(std::fmin(std::fmax(v, -127.0f), 127.0f));
      sb[i / 16] += qb[i];
    }
    d[b] = db;
  }
}

template <typename T>
ActQuant quantize_act(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), ldx = x.stride(0), blocks = k / kBlock;
  ActQuant a{std::vector<int8_t>(m * k), std::vector<float>(m * blocks),
             std::vector<int32_t>(m * 2 * blocks), m, k};
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, m, row_grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_act_row(xp + r * ldx, k, a.q.data() + r * k, a.d.data() + r * blocks,
                       a.sums.data() + r * 2 * blocks);
  });
  return a;
}

// The factors for a part of scale size sub (32 or 16) and sum factor cfac.
ActRows act_rows(const ActQuant& a, int64_t sub, float cfac) {
  const int64_t blocks = a.k / kBlock, per_block = kBlock / sub, subs = blocks * per_block;
  ActRows r{a.q.data(), std::vector<float>(a.m * subs), std::vector<float>(a.m * subs), a.k,
            subs};
  for (int64_t i = 0; i < a.m * blocks; ++i) {
    const float d = a.d[i];
    const int32_t* sb = a.sums.data() + 2 * i;
    for (int64_t s = 0; s < per_block; ++s) {
      const int32_t sum = per_block == 1 ? sb[0] + sb[1] : sb[s];
      r.xd[i * per_block + s] = d;
      r.xc[i * per_block + s] = d * (static_cast<float>(sum) * cfac);
    }
  }
  return r;
}

struct Weights {
  const uint8_t* qs;
  const uint8_t* qh;  // nullptr for 4 and 8 bits
  const void* scales;  // at::Half (half) or float
  const void* mins;    // the scales' dtype; nullptr for the types without a min
  int64_t n, k, blocks, nq, nh, sub;
  int bits;
  float zero;
  bool half;
  int64_t group_qs() const { return blocks * nq * 64; }
  int64_t group_qh() const { return blocks * nh * 64; }
  int64_t subs() const { return k / sub; }
};

// Element i of scales or mins, as float32 (an fp16 one widens exactly).
PAGEDSERVE_INLINE float scale_at(const void* p, bool half, int64_t i) {
  return half ? static_cast<float>(static_cast<const at::Half*>(p)[i])
              : static_cast<const float*>(p)[i];
}

// The unsigned quant of byte i (channel i / 4, k 4v + i % 4 of the block) of vector v.
PAGEDSERVE_INLINE int32_t quant_at(const Weights& w, const uint8_t* qs, const uint8_t* qh, int v,
                                   int i) {
  if (w.bits == 8) return qs[v * 64 + i];
  int32_t u = v < 4 ? (qs[v * 64 + i] & 0x0F) : (qs[(v - 4) * 64 + i] >> 4);
  if (w.bits == 5) u |= ((qh[i] >> v) & 1) << 4;
  if (w.bits == 6) u |= ((qh[(v / 4) * 64 + i] >> (2 * (v % 4))) & 3) << 4;
  return u;
}

template <typename T>
PAGEDSERVE_INLINE void store_row(const float* acc, int64_t n0, int64_t lanes, const T* bias,
                                 T* out_row) {
  for (int64_t l = 0; l < lanes; ++l) {
    float y = acc[l];
    if (bias != nullptr) y += to_f(bias[n0 + l]);
    out_row[n0 + l] = from_f<T>(y);
  }
}

template <typename T>
void portable_group(const Weights& w, const ActRows& a, int64_t g, int64_t m0, int64_t m1,
                    const T* bias, T* out, int64_t ldo) {
  const uint8_t* qs_g = w.qs + g * w.group_qs();
  const uint8_t* qh_g = w.qh != nullptr ? w.qh + g * w.group_qh() : nullptr;
  const int64_t n0 = g * kLanes, lanes = std::min(kLanes, w.n - n0);
  const int64_t per_block = kBlock / w.sub, groups_per_sub = 8 / per_block;
  for (int64_t m = m0; m < m1; ++m) {
    float acc[kLanes] = {};
    const int8_t* xq = a.q + m * a.k;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* qs = qs_g + b * w.nq * 64;
      const uint8_t* qh = qh_g != nullptr ? qh_g + b * w.nh * 64 : nullptr;
      for (int64_t s = 0; s < per_block; ++s) {
        const int64_t j = b * per_block + s;
        const int64_t sc = (g * w.subs() + j) * kLanes;
        for (int64_t l = 0; l < kLanes; ++l) {
          int32_t dot = 0;
          for (int64_t v = s * groups_per_sub; v < (s + 1) * groups_per_sub; ++v)
            for (int i = 0; i < 4; ++i)
              dot += quant_at(w, qs, qh, static_cast<int>(v), static_cast<int>(l * 4 + i)) *
                     xq[b * kBlock + v * 4 + i];
          const float xd = a.xd[m * a.subs + j], xc = a.xc[m * a.subs + j];
          const float s_l = scale_at(w.scales, w.half, sc + l);
          if (w.mins != nullptr)
            acc[l] += s_l * (static_cast<float>(dot) * xd) +
                      scale_at(w.mins, w.half, (g * w.blocks + b) * kLanes + l) * xc;
          else
            acc[l] += s_l * (static_cast<float>(dot) * xd + xc);
        }
      }
    }
    store_row(acc, n0, lanes, bias, out + m * ldo);
  }
}

// One channel group's outputs for rows m0..m1 (a VNNI template or the portable loop).
template <typename T>
using GroupFn = void (*)(const Weights&, const ActRows&, int64_t, int64_t, int64_t, const T*, T*,
                         int64_t);

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDSERVE_GGUF_VNNI 1

// Blocks ahead that vnni_rows asks the cache for: the hardware prefetcher alone leaves a
// one-row GEMV short of the machine's read bandwidth (bench/quantization.py --profile prints
// both).
constexpr int64_t kPrefetchBlocks = 4;

// Into L1: the cache lines of block b of group g (past the group's last block: the next group's
// first, which follow in memory; a prefetch past the tensor's end does not fault).
template <int Bits, bool Mins, int PerBlock, bool Half>
PAGEDSERVE_INLINE void prefetch_block(const Weights& w, int64_t g, int64_t b) {
  constexpr int kNq = Bits == 8 ? 8 : 4, kNh = Bits == 5 ? 1 : Bits == 6 ? 2 : 0;
  const char* qs = reinterpret_cast<const char*>(w.qs + (g * w.blocks + b) * kNq * 64);
  for (int c = 0; c < kNq; ++c) _mm_prefetch(qs + 64 * c, _MM_HINT_T0);
  if constexpr (kNh > 0) {
    const char* qh = reinterpret_cast<const char*>(w.qh + (g * w.blocks + b) * kNh * 64);
    for (int c = 0; c < kNh; ++c) _mm_prefetch(qh + 64 * c, _MM_HINT_T0);
  }
  constexpr int kSize = Half ? 2 : 4;  // bytes per scale
  const char* sc =
      static_cast<const char*>(w.scales) + (g * w.blocks + b) * PerBlock * kLanes * kSize;
  for (int c = 0; c < PerBlock * kLanes * kSize; c += 64) _mm_prefetch(sc + c, _MM_HINT_T0);
  if constexpr (Mins)
    _mm_prefetch(static_cast<const char*>(w.mins) + (g * w.blocks + b) * kLanes * kSize,
                 _MM_HINT_T0);
}

// R rows (R <= kRows) of one channel group: each block is decoded once for all R rows.
template <int R, int Bits, bool Mins, int PerBlock, bool Half, typename T>
PAGEDSERVE_INLINE void vnni_rows(const Weights& w, const ActRows& a, int64_t g, int64_t m0,
                                 const T* bias, T* out, int64_t ldo) {
  constexpr int kPerSub = 8 / PerBlock;  // vectors per scale
  const uint8_t* qs_g = w.qs + g * w.group_qs();
  const uint8_t* qh_g = w.qh != nullptr ? w.qh + g * w.group_qh() : nullptr;
  const int64_t sc_g = g * w.subs() * kLanes, mn_g = g * w.blocks * kLanes;  // elements
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    prefetch_block<Bits, Mins, PerBlock, Half>(w, g, b + kPrefetchBlocks);
    __m512i wv[8];
    gguf_decode_block<Bits>(qs_g + b * w.nq * 64, qh_g != nullptr ? qh_g + b * w.nh * 64 : nullptr,
                       wv);
    // once per block, for every row: the mins, and (per sub-block) the scales, widened
    const __m512 mn = Mins ? gguf_load_scales<Half>(w.mins, mn_g + b * kLanes) : __m512{};
    for (int s = 0; s < PerBlock; ++s) {
      const int64_t j = b * PerBlock + s;
      const __m512 sc = gguf_load_scales<Half>(w.scales, sc_g + j * kLanes);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.q + (m0 + r) * a.k + b * kBlock;
        // two dependency chains of vpdpbusd (its latency, not its throughput, bounds one);
        // the integer sum is exact in any order
        __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
        for (int v = s * kPerSub; v < (s + 1) * kPerSub; v += 2) {
          int32_t f0, f1;
          std::memcpy(&f0, xq + v * 4, 4);
          std::memcpy(&f1, xq + v * 4 + 4, 4);
          dot0 = _mm512_dpbusd_epi32(dot0, wv[v], _mm512_set1_epi32(f0));
          dot1 = _mm512_dpbusd_epi32(dot1, wv[v + 1], _mm512_set1_epi32(f1));
        }
        const __m512i dot = _mm512_add_epi32(dot0, dot1);
        const int64_t at = (m0 + r) * a.subs + j;
        const __m512 xd = _mm512_set1_ps(a.xd[at]), xc = _mm512_set1_ps(a.xc[at]);
        const __m512 dx = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), xd);
        if constexpr (Mins) {
          acc[r] = _mm512_fmadd_ps(sc, dx, acc[r]);
          acc[r] = _mm512_fmadd_ps(mn, xc, acc[r]);
        } else {
          acc[r] = _mm512_fmadd_ps(sc, _mm512_add_ps(dx, xc), acc[r]);
        }
      }
    }
  }
  const int64_t n0 = g * kLanes, lanes = std::min(kLanes, w.n - n0);
  for (int r = 0; r < R; ++r) {
    alignas(64) float tmp[kLanes];
    _mm512_store_ps(tmp, acc[r]);
    store_row(tmp, n0, lanes, bias, out + (m0 + r) * ldo);
  }
}

template <int Bits, bool Mins, int PerBlock, bool Half, typename T>
void vnni_group(const Weights& w, const ActRows& a, int64_t g, int64_t m0, int64_t m1,
                const T* bias, T* out, int64_t ldo) {
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows)
    vnni_rows<kRows, Bits, Mins, PerBlock, Half>(w, a, g, m, bias, out, ldo);
  switch (m1 - m) {
    case 3: vnni_rows<3, Bits, Mins, PerBlock, Half>(w, a, g, m, bias, out, ldo); break;
    case 2: vnni_rows<2, Bits, Mins, PerBlock, Half>(w, a, g, m, bias, out, ldo); break;
    case 1: vnni_rows<1, Bits, Mins, PerBlock, Half>(w, a, g, m, bias, out, ldo); break;
    default: break;
  }
}

// The template for this weight format; nullptr for a combination no GGUF type has (the
// portable loop runs it). fp16 scales: the 32-weight types; float32: any (the K types, and
// the layout before fp16 scales: bench/results/HISTORY.md, "Experiments retired in the house
// issue (2026-12-04)", "fp16 GGUF block scales against float32").
template <typename T>
GroupFn<T> vnni_for(const Weights& w) {
  const bool mins = w.mins != nullptr;
  const int per_block = static_cast<int>(kBlock / w.sub);
  if (per_block == 2)
    return w.bits == 6 && !mins && !w.half ? &vnni_group<6, false, 2, false, T> : nullptr;
  if (per_block != 1) return nullptr;
  if (w.half) {
    switch (w.bits) {
      case 8: return mins ? nullptr : &vnni_group<8, false, 1, true, T>;
      case 4: return mins ? &vnni_group<4, true, 1, true, T> : &vnni_group<4, false, 1, true, T>;
      case 5: return mins ? &vnni_group<5, true, 1, true, T> : &vnni_group<5, false, 1, true, T>;
      default: return nullptr;
    }
  }
  switch (w.bits) {
    case 8: return mins ? nullptr : &vnni_group<8, false, 1, false, T>;
    case 4: return mins ? &vnni_group<4, true, 1, false, T> : &vnni_group<4, false, 1, false, T>;
    case 5: return mins ? &vnni_group<5, true, 1, false, T> : &vnni_group<5, false, 1, false, T>;
    case 6: return mins ? &vnni_group<6, true, 1, false, T> : &vnni_group<6, false, 1, false, T>;
    default: return nullptr;
  }
}
#endif

bool use_vnni() {
#ifdef PAGEDSERVE_GGUF_VNNI
  return !g_portable.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// One part as the kernel runs it: its weights, activation factors, kernel and output columns.
template <typename T>
struct PartRun {
  Weights w;
  ActRows a;
  GroupFn<T> fast;  // nullptr: the portable loop
  const T* bias;    // this part's first column, or nullptr
  T* out;           // this part's first column
  int64_t items;    // groups * row tiles
};

// Work items are (part, channel group, row tile), the parts' items one after another in one
// parallel region: rows in tiles of 64 keep a group's weights in L1 while every row tile
// passes over them.
template <typename T>
void run_gguf(const std::vector<PartRun<T>>& parts, int64_t ldo, int64_t m) {
  const int64_t tiles = (m + kRowTile - 1) / kRowTile;
  int64_t total = 0;
  for (const PartRun<T>& p : parts) total += p.items;
  WorkQueue(total).run([&](WorkQueue& queue) {
    int64_t begin, end;
    while (queue.take(begin, end)) {
      size_t i = 0;
      int64_t first = 0;  // parts[i]'s first item
      for (int64_t item = begin; item < end; ++item) {
        while (item - first >= parts[i].items) first += parts[i++].items;
        const PartRun<T>& p = parts[i];
        const int64_t groups = p.items / tiles, local = item - first;
        const int64_t g = local % groups, m0 = (local / groups) * kRowTile;
        const int64_t m1 = std::min(m, m0 + kRowTile);
        if (p.fast != nullptr)
          p.fast(p.w, p.a, g, m0, m1, p.bias, p.out, ldo);
        else
          portable_group(p.w, p.a, g, m0, m1, p.bias, p.out, ldo);
      }
    }
  });
}

std::optional<at::Tensor> maybe_tensor(const at::Tensor* t) {
  return t != nullptr ? std::optional<at::Tensor>(*t) : std::nullopt;
}

Weights check_weights(const at::Tensor& qs, const std::optional<at::Tensor>& qh,
                      const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t n,
                      int64_t bits, int64_t zero, const char* op) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, op, ": bits must be 4, 5, 6, 8");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 4 &&
                  qs.size(3) == 64 && qs.size(2) == (bits == 8 ? 8 : 4),
              op, ": qs must be contiguous uint8 [G, B, 4 or 8, 64]");
  const int64_t groups = qs.size(0), blocks = qs.size(1);
  TORCH_CHECK(groups == (n + kLanes - 1) / kLanes, op, ": qs has ", groups, " groups for ", n,
              " outputs");
  const int64_t nh = bits == 5 ? 1 : bits == 6 ? 2 : 0;
  TORCH_CHECK(qh.has_value() == (nh > 0), op, ": qh is needed exactly for 5 and 6 bits");
  if (nh > 0)
    TORCH_CHECK(qh->scalar_type() == at::kByte && qh->is_contiguous() && qh->dim() == 4 &&
                    qh->size(0) == groups && qh->size(1) == blocks && qh->size(2) == nh &&
                    qh->size(3) == 64,
                op, ": qh must be contiguous uint8 [G, B, ", nh, ", 64]");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == groups && scales.size(2) == kLanes,
              op, ": scales must be contiguous float16 or float32 [G, S, 16]");
  const int64_t k = blocks * kBlock;
  TORCH_CHECK(scales.size(1) == blocks || scales.size(1) == 2 * blocks, op,
              ": scales must cover 32 or 16 k each");
  const int64_t sub = k / scales.size(1);
  if (mins.has_value())
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                    mins->dim() == 3 && mins->size(0) == groups && mins->size(1) == blocks &&
                    mins->size(2) == kLanes,
                op, ": mins must be contiguous [G, B, 16] of the scales' dtype");
  const uint8_t* qh_ptr = nh > 0 ? qh->data_ptr<uint8_t>() : nullptr;
  const void* mins_ptr = mins.has_value() ? mins->data_ptr() : nullptr;
  return Weights{qs.data_ptr<uint8_t>(), qh_ptr, scales.data_ptr(), mins_ptr, n, k, blocks,
                 qs.size(2), nh, sub, static_cast<int>(bits), static_cast<float>(zero), half};
}

// The 8 quant vectors of one block as bytes: tmp[v * 64 + l * 4 + i].
PAGEDSERVE_INLINE void decode_bytes(const Weights& w, const uint8_t* qs, const uint8_t* qh,
                                    uint8_t* tmp) {
#ifdef PAGEDSERVE_GGUF_VNNI
  __m512i wv[8];
  switch (w.bits) {
    case 8: gguf_decode_block<8>(qs, qh, wv); break;
    case 4: gguf_decode_block<4>(qs, qh, wv); break;
    case 5: gguf_decode_block<5>(qs, qh, wv); break;
    default: gguf_decode_block<6>(qs, qh, wv); break;
  }
  for (int v = 0; v < 8; ++v) _mm512_storeu_si512(tmp + v * 64, wv[v]);
#else
  for (int v = 0; v < 8; ++v)
    for (int i = 0; i < 64; ++i) tmp[v * 64 + i] = static_cast<uint8_t>(quant_at(w, qs, qh, v, i));
#endif
}

// Block b of channel l of group g (its decoded bytes in tmp) -> 32 values of row.
template <typename T>
PAGEDSERVE_INLINE void dequantize_lane(const Weights& w, int64_t g, int64_t b, const uint8_t* tmp,
                                       int64_t l, T* row) {
  const int64_t per_block = kBlock / w.sub;
  const float m =
      w.mins != nullptr ? scale_at(w.mins, w.half, (g * w.blocks + b) * kLanes + l) : 0.0f;
  for (int64_t sb = 0; sb < per_block; ++sb) {
    const float s = scale_at(w.scales, w.half, (g * w.subs() + b * per_block + sb) * kLanes + l);
    for (int64_t kk = sb * w.sub; kk < (sb + 1) * w.sub; ++kk) {
      const float u = static_cast<float>(tmp[(kk / 4) * 64 + l * 4 + kk % 4]);
      // the torch reference's (and gguf-py's) rounding: s * u + m, or s * (u - zero)
      row[kk] = from_f<T>(w.mins != nullptr ? s * u + m : s * (u - w.zero));
    }
  }
}

template <typename T>
void dequantize_group(const Weights& w, int64_t g, T* out, int64_t ldo) {
  const int64_t n0 = g * kLanes, lanes = std::min(kLanes, w.n - n0);
  const uint8_t* qs_g = w.qs + g * w.group_qs();
  const uint8_t* qh_g = w.qh != nullptr ? w.qh + g * w.group_qh() : nullptr;
  alignas(64) uint8_t tmp[8 * 64];
  for (int64_t b = 0; b < w.blocks; ++b) {
    decode_bytes(w, qs_g + b * w.nq * 64, qh_g != nullptr ? qh_g + b * w.nh * 64 : nullptr, tmp);
    for (int64_t l = 0; l < lanes; ++l)
      dequantize_lane(w, g, b, tmp, l, out + (n0 + l) * ldo + b * kBlock);
  }
}

// Row n of W (an embedding lookup): of each block only channel l's 32 bytes are decoded.
template <typename T>
void dequantize_row(const Weights& w, int64_t n, T* row) {
  const int64_t g = n / kLanes, l = n % kLanes;
  const uint8_t* qs_g = w.qs + g * w.group_qs();
  const uint8_t* qh_g = w.qh != nullptr ? w.qh + g * w.group_qh() : nullptr;
  alignas(64) uint8_t tmp[8 * 64];
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* qs = qs_g + b * w.nq * 64;
    const uint8_t* qh = qh_g != nullptr ? qh_g + b * w.nh * 64 : nullptr;
    for (int v = 0; v < 8; ++v)
      for (int j = 0; j < 4; ++j) {
        const int i = static_cast<int>(l) * 4 + j;
        tmp[v * 64 + i] = static_cast<uint8_t>(quant_at(w, qs, qh, v, i));
      }
    dequantize_lane(w, g, b, tmp, l, row + b * kBlock);
  }
}

}  // namespace

void gguf_linear_parts(const at::Tensor& out, const at::Tensor& x,
                       const std::vector<GgufPart>& parts, const at::Tensor* bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gguf_linear: x must be [M, K], rows contiguous");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "gguf_linear: out must be [M, N] of x's dtype, rows contiguous");
  TORCH_CHECK(!parts.empty(), "gguf_linear: a linear has at least one part");
  const int64_t m = x.size(0), n = out.size(1);
  std::vector<Weights> ws;
  int64_t width = 0;
  for (const GgufPart& p : parts) {
    ws.push_back(check_weights(*p.qs, maybe_tensor(p.qh), *p.scales, maybe_tensor(p.mins), p.n,
                               p.bits, p.zero, "gguf_linear"));
    TORCH_CHECK(x.size(1) == ws.back().k, "gguf_linear: x has K=", x.size(1), ", the weight ",
                ws.back().k);
    width += p.n;
  }
  TORCH_CHECK(width == n, "gguf_linear: the parts have ", width, " outputs, out ", n);
  if (bias != nullptr)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n &&
                    bias->scalar_type() == x.scalar_type(),
                "gguf_linear: bias must be contiguous [N] of x's dtype");
  if (m == 0) return;
  const int64_t tiles = (m + kRowTile - 1) / kRowTile;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gguf_linear", [&] {
    const ActQuant aq = quantize_act<scalar_t>(x);  // once for every part
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* b = bias != nullptr ? bias->data_ptr<scalar_t>() : nullptr;
    std::vector<PartRun<scalar_t>> runs;
    int64_t start = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Weights& w = ws[i];
      const float cfac = w.mins != nullptr ? 1.0f : -w.zero;
      GroupFn<scalar_t> fast = nullptr;
#ifdef PAGEDSERVE_GGUF_VNNI
      if (use_vnni()) fast = vnni_for<scalar_t>(w);
#endif
      runs.push_back(PartRun<scalar_t>{w, act_rows(aq, w.sub, cfac), fast,
                                       b != nullptr ? b + start : nullptr, o + start,
                                       (w.n + kLanes - 1) / kLanes * tiles});
      start += w.n;
    }
    run_gguf<scalar_t>(runs, out.stride(0), m);
  });
}

void gguf_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qs,
                 const std::optional<at::Tensor>& qh, const at::Tensor& scales,
                 const std::optional<at::Tensor>& mins, int64_t bits, int64_t zero,
                 const std::optional<at::Tensor>& bias) {
  const GgufPart part{&qs, qh.has_value() ? &*qh : nullptr, &scales,
                      mins.has_value() ? &*mins : nullptr, out.dim() == 2 ? out.size(1) : 0,
                      bits, zero};
  gguf_linear_parts(out, x, {part}, bias.has_value() ? &*bias : nullptr);
}

void gguf_dequantize(const at::Tensor& out, const at::Tensor& qs,
                     const std::optional<at::Tensor>& qh, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, int64_t bits, int64_t zero) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1, "gguf_dequantize: out must be [N, K]");
  const Weights w = check_weights(qs, qh, scales, mins, out.size(0), bits, zero, "gguf_dequantize");
  TORCH_CHECK(out.size(1) == w.k, "gguf_dequantize: out has K=", out.size(1), ", the weight ", w.k);
  const int64_t groups = qs.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "gguf_dequantize", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) dequantize_group(w, g, o, out.stride(0));
    });
  });
}

void gguf_dequantize_rows(const at::Tensor& out, const at::Tensor& ids, const at::Tensor& qs,
                          const std::optional<at::Tensor>& qh, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins, int64_t n, int64_t bits,
                          int64_t zero) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "gguf_dequantize_rows: ids must be [T] int64");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == ids.size(0),
              "gguf_dequantize_rows: out must be [T, K]");
  const Weights w = check_weights(qs, qh, scales, mins, n, bits, zero, "gguf_dequantize_rows");
  TORCH_CHECK(out.size(1) == w.k, "gguf_dequantize_rows: out has K=", out.size(1), ", the weight ",
              w.k);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.size(0); ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < n, "gguf_dequantize_rows: id ", idp[t], " not in [0, ", n,
                ")");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "gguf_dequantize_rows", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    // a row is about 2 us of work: threads only pay for long prompts
    at::parallel_for(0, ids.size(0), 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) dequantize_row(w, idp[t], o + t * out.stride(0));
    });
  });
}

std::string gguf_kernel() { return use_vnni() ? "avx512_vnni" : "portable"; }

bool set_gguf_portable(bool portable) { return g_portable.exchange(portable); }

}  // namespace pagedserve_cpu
