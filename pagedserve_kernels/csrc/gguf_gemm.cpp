// Many-row GGUF linears on AMX-BF16: gguf_gemm, gguf_gemm_available.
// out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for prefill chunks and batched decode, W in the packed
// GGUF layout described at the top of gguf_quant.cpp (read here, never changed).
//
// Each work item is 32 output channels (two channel groups). Its weights are dequantized once
// into a bf16 buffer of AMX B tiles, K/32 tiles of 16 rows x 64 bytes per group (under 100 KiB
// for K <= 1536, so it stays in L1/L2), exactly as gguf-py dequantizes them: float32
// s * (u - zero), or s * u then + m, rounded to bf16 (gguf_dequantize's bits). Then every 32-row
// tile of x runs the usual 2 x 2 tile loop over them (C tiles 0-3, A 4-5, B 6-7). x is rounded
// to bf16 once per call (float32 x too); sums are float32, the bias is added in float32 and the
// output rounded once to x's dtype. So a bf16 call computes what gguf_dequantize + a bf16
// matmul computes, in another summation order. Rows go in passes whose bf16 x stays within
// kPassBytes, each pass dequantizing the weights again (a pass has at least 32 rows).
//
// Why dequantize-to-bf16 rather than AMX-INT8 on the int8 activations gguf_linear uses: the
// weights' float scale changes every 32 k (16 for Q6_K) per channel, so an INT8 tile dot could
// only cover one block, and every 16 x 16 int32 result would go through memory and 16 vector
// multiply-adds per block of 32 k; here the scaling is paid once per weight and amortized over
// all the rows, and a C tile accumulates across the whole K. (The INT8 variant was chosen
// against on those operation counts, not built; bench/micro/gguf_gemm.py measures this kernel
// against VNNI, dequantize + matmul and bf16 weights.)
#include "common.h"
#include "gguf_layout.h"
#include "ops.h"

#include <optional>

namespace pagedserve_cpu {

#if defined(PAGEDSERVE_AMX) && defined(__AVX512BF16__)
#define PAGEDSERVE_GGUF_GEMM 1
namespace {

constexpr int64_t kLanes = 16;                 // output channels per group
constexpr int64_t kBlock = 32;                 // k per block (= one bf16 tile's K step)
constexpr int64_t kTile = 16 * 32;             // bf16 elements of one B tile
constexpr int64_t kPassBytes = 1024 * 1024;    // bf16 x per row pass (kept in L2)

struct Packed {
  const uint8_t* qs;
  const uint8_t* qh;  // nullptr for 4 and 8 bits
  const void* scales;  // fp16 (half: the 32-weight types) or float32 (the K types)
  const void* mins;    // the scales' dtype; nullptr for the types without a min
  int64_t n, k, groups, blocks, nq, nh, subs;
  int bits, zero;
  bool half;
};

// Channel group g as K/32 bf16 B tiles, tile b at dst + b * step: row r holds
// (W[n][32b + 2r], W[n][32b + 2r + 1]) for n = 0..15. Dword lane l of a block's vector v holds
// channel l's quants at k 4v..4v+3, one per byte: shifting byte j down gives 16 channels at
// k 4v + j in the lanes the scales are in; two such vectors round to 32 bf16 and one word
// permute interleaves them into a tile row.
// The float32 values are the oracle's bits: s * u is exact (s has at most 18 significant bits,
// u at most 6) and s * zero too (zero is a power of two), so one fma rounds s * (u - zero), or
// s * u + m, once, as the oracle's s * (u - zero) and (s * u) + m do. fp16 scales and mins are
// widened (exactly) once per block.
template <int Bits, bool Mins, int PerBlock, bool Half>
void dequantize_tiles(const Packed& w, int64_t g, c10::BFloat16* dst, int64_t step) {
  constexpr int kPerSub = 8 / PerBlock;  // vectors per scale
  const uint8_t* qs_g = w.qs + g * w.blocks * w.nq * 64;
  const uint8_t* qh_g = w.qh != nullptr ? w.qh + g * w.blocks * w.nh * 64 : nullptr;
  const int64_t sc_g = g * w.subs * kLanes, mn_g = g * w.blocks * kLanes;  // elements
  alignas(64) int16_t zip[32];  // words i: channel i / 2 of the first (i even) or second vector
  for (int i = 0; i < 32; ++i) zip[i] = static_cast<int16_t>((i % 2) * 16 + i / 2);
  const __m512i interleave = _mm512_load_si512(zip);
  const __m512i byte = _mm512_set1_epi32(0xFF);
  const __m512 neg_zero = _mm512_set1_ps(-static_cast<float>(w.zero));
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512i wv[8];
    gguf_decode_block<Bits>(qs_g + b * w.nq * 64, qh_g != nullptr ? qh_g + b * w.nh * 64 : nullptr,
                       wv);
    c10::BFloat16* tile = dst + b * step;
    for (int s = 0; s < PerBlock; ++s) {
      const __m512 sc = gguf_load_scales<Half>(w.scales, sc_g + (b * PerBlock + s) * kLanes);
      const __m512 add = Mins ? gguf_load_scales<Half>(w.mins, mn_g + b * kLanes)
                              : _mm512_mul_ps(sc, neg_zero);
      for (int v = s * kPerSub; v < (s + 1) * kPerSub; ++v) {
        const __m512i q = wv[v];
        const __m512i u[4] = {_mm512_and_si512(q, byte),
                              _mm512_and_si512(_mm512_srli_epi32(q, 8), byte),
                              _mm512_and_si512(_mm512_srli_epi32(q, 16), byte),
                              _mm512_srli_epi32(q, 24)};
        __m512 f[4];
        for (int j = 0; j < 4; ++j) f[j] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(u[j]), add);
        const __m512i k01 = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);  // k 4v, 4v + 1
        const __m512i k23 = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);  // k 4v + 2, 4v + 3
        _mm512_storeu_si512(tile + (2 * v) * 32, _mm512_permutexvar_epi16(interleave, k01));
        _mm512_storeu_si512(tile + (2 * v + 1) * 32, _mm512_permutexvar_epi16(interleave, k23));
      }
    }
  }
}

using DequantFn = void (*)(const Packed&, int64_t, c10::BFloat16*, int64_t);

template <bool Half>
DequantFn dequant_for_width(const Packed& w) {
  const bool mins = w.mins != nullptr;
  const int64_t per_block = w.subs / w.blocks;
  if (per_block == 2)
    return w.bits == 6 && !mins ? &dequantize_tiles<6, false, 2, Half> : nullptr;
  if (per_block != 1) return nullptr;
  switch (w.bits) {
    case 8: return mins ? nullptr : &dequantize_tiles<8, false, 1, Half>;
    case 4:
      return mins ? &dequantize_tiles<4, true, 1, Half> : &dequantize_tiles<4, false, 1, Half>;
    case 5:
      return mins ? &dequantize_tiles<5, true, 1, Half> : &dequantize_tiles<5, false, 1, Half>;
    case 6:
      return mins ? &dequantize_tiles<6, true, 1, Half> : &dequantize_tiles<6, false, 1, Half>;
    default: return nullptr;
  }
}

DequantFn dequant_for(const Packed& w) {
  return w.half ? dequant_for_width<true>(w) : dequant_for_width<false>(w);
}

Packed check_packed(const at::Tensor& qs, const std::optional<at::Tensor>& qh,
                    const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t n,
                    int64_t bits, int64_t zero) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "gguf_gemm: bits must be 4-8");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 4 &&
                  qs.size(3) == 64 && qs.size(2) == (bits == 8 ? 8 : 4),
              "gguf_gemm: qs must be contiguous uint8 [G, B, 4 or 8, 64]");
  const int64_t groups = qs.size(0), blocks = qs.size(1);
  TORCH_CHECK(groups == (n + kLanes - 1) / kLanes, "gguf_gemm: qs has ", groups,
              " groups for ", n, " outputs");
  const int64_t nh = bits == 5 ? 1 : bits == 6 ? 2 : 0;
  TORCH_CHECK(qh.has_value() == (nh > 0), "gguf_gemm: qh is needed exactly for 5 and 6 bits");
  if (nh > 0)
    TORCH_CHECK(qh->scalar_type() == at::kByte && qh->is_contiguous() &&
                    qh->sizes() == at::IntArrayRef({groups, blocks, nh, 64}),
                "gguf_gemm: qh must be contiguous uint8 [G, B, ", nh, ", 64]");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == groups && scales.size(2) == kLanes &&
                  (scales.size(1) == blocks || scales.size(1) == 2 * blocks),
              "gguf_gemm: scales must be contiguous float16 or float32 [G, B or 2B, 16]");
  if (mins.has_value())
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                    mins->sizes() == at::IntArrayRef({groups, blocks, kLanes}),
                "gguf_gemm: mins must be contiguous [G, B, 16] of the scales' dtype");
  return Packed{qs.data_ptr<uint8_t>(),
                nh > 0 ? qh->data_ptr<uint8_t>() : nullptr,
                scales.data_ptr(),
                mins.has_value() ? mins->data_ptr() : nullptr,
                n, blocks * kBlock, groups, blocks, qs.size(2), nh, scales.size(1),
                static_cast<int>(bits), static_cast<int>(zero), half};
}

// x [M, K] -> bf16 [m_pad, K], the pad rows zero (float32 rounds to nearest even).
template <typename T>
void x_to_bf16(const T* x, int64_t ldx, int64_t m, int64_t m_pad, int64_t k,
               c10::BFloat16* xb) {
  at::parallel_for(0, m_pad, row_grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      c10::BFloat16* dst = xb + r * k;
      if (r >= m) {
        std::memset(static_cast<void*>(dst), 0, k * sizeof(c10::BFloat16));
      } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
        std::memcpy(static_cast<void*>(dst), x + r * ldx, k * sizeof(c10::BFloat16));
      } else {
        for (int64_t i = 0; i < k; i += 16) store16(dst + i, load16(x + r * ldx + i));
      }
    }
  });
}

// C tile rows m0.. (those below m) of channels n0.. (lanes of them) + bias -> out.
template <typename T>
PAGEDSERVE_INLINE void store_tile(const float* c, int64_t m0, int64_t m, int64_t n0,
                                  int64_t lanes, const T* bias, T* out, int64_t ldo) {
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr && lanes == kLanes) b = load16(bias + n0);
  for (int64_t r = 0; r < 16 && m0 + r < m; ++r) {
    T* row = out + (m0 + r) * ldo + n0;
    if (lanes == kLanes) {
      store16(row, _mm512_add_ps(_mm512_loadu_ps(c + r * 16), b));
    } else {
      for (int64_t l = 0; l < lanes; ++l)
        row[l] = from_f<T>(c[r * 16 + l] + (bias != nullptr ? to_f(bias[n0 + l]) : 0.0f));
    }
  }
}

template <typename T>
void run_gemm(const Packed& w, DequantFn dequant, const T* x, int64_t ldx, int64_t m,
              const T* bias, T* out, int64_t ldo) {
  const int64_t k = w.k, kt = w.blocks, m_pad = (m + 15) / 16 * 16;
  std::vector<c10::BFloat16> xb(m_pad * k);
  x_to_bf16(x, ldx, m, m_pad, k, xb.data());
  const int64_t items = (w.groups + 1) / 2;
  const int64_t rows_per_pass = std::max<int64_t>(32, kPassBytes / (2 * k) / 32 * 32);
  for (int64_t pass = 0; pass < m_pad; pass += rows_per_pass) {
    const int64_t pass_end = std::min(m_pad, pass + rows_per_pass);
    WorkQueue(items).run([&](WorkQueue& queue) {
      amx_configure_square();
      std::vector<c10::BFloat16> wbuf(kt * 2 * kTile);  // [kb][group of the pair][tile]
      alignas(64) float cbuf[4][16 * 16];
      int64_t begin, end;
      while (queue.take(begin, end)) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t g0 = 2 * item;
          const bool two = g0 + 1 < w.groups;
          dequant(w, g0, wbuf.data(), 2 * kTile);
          if (two) dequant(w, g0 + 1, wbuf.data() + kTile, 2 * kTile);
          for (int64_t m0 = pass; m0 < pass_end; m0 += 32) {
            const bool two_m = m0 + 16 < pass_end;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const c10::BFloat16* a0 = xb.data() + m0 * k;
            const c10::BFloat16* a1 = a0 + 16 * k;
            for (int64_t kb = 0; kb < kt; ++kb) {
              const c10::BFloat16* bt = wbuf.data() + kb * 2 * kTile;
              _tile_loadd(4, a0 + kb * kBlock, k * 2);
              _tile_loadd(6, bt, 64);
              _tile_dpbf16ps(0, 4, 6);
              if (two) {
                _tile_loadd(7, bt + kTile, 64);
                _tile_dpbf16ps(1, 4, 7);
              }
              if (two_m) {
                _tile_loadd(5, a1 + kb * kBlock, k * 2);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
              }
            }
            _tile_stored(0, cbuf[0], 64);
            if (two) _tile_stored(1, cbuf[1], 64);
            if (two_m) {
              _tile_stored(2, cbuf[2], 64);
              if (two) _tile_stored(3, cbuf[3], 64);
            }
            for (int mi = 0; mi < (two_m ? 2 : 1); ++mi) {
              for (int t = 0; t < (two ? 2 : 1); ++t) {
                const int64_t n0 = (g0 + t) * kLanes;
                store_tile(cbuf[2 * mi + t], m0 + 16 * mi, m, n0, std::min(kLanes, w.n - n0),
                           bias, out, ldo);
              }
            }
          }
        }
      }
      _tile_release();
    });
  }
}

}  // namespace
#endif

bool gguf_gemm_available() {
#ifdef PAGEDSERVE_GGUF_GEMM
  return amx_permitted();
#else
  return false;
#endif
}

void gguf_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qs,
               const std::optional<at::Tensor>& qh, const at::Tensor& scales,
               const std::optional<at::Tensor>& mins, int64_t bits, int64_t zero,
               const std::optional<at::Tensor>& bias) {
#ifdef PAGEDSERVE_GGUF_GEMM
  TORCH_CHECK(amx_permitted(), "gguf_gemm: AMX is not available to this process");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gguf_gemm: x must be [M, K], rows contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "gguf_gemm: x must be bfloat16 or float32");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "gguf_gemm: out must be [M, N] of x's dtype, rows contiguous");
  const int64_t m = x.size(0), n = out.size(1);
  const Packed w = check_packed(qs, qh, scales, mins, n, bits, zero);
  TORCH_CHECK(x.size(1) == w.k, "gguf_gemm: x has K=", x.size(1), ", the weight ", w.k);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n &&
                    bias->scalar_type() == x.scalar_type(),
                "gguf_gemm: bias must be contiguous [N] of x's dtype");
  const DequantFn dequant = dequant_for(w);
  TORCH_CHECK(dequant != nullptr, "gguf_gemm: no GGUF type has ", bits, " bits with",
              mins.has_value() ? "" : "out", " mins at ", w.k / w.subs, " weights per scale");
  if (m == 0) return;
  if (x.scalar_type() == at::kBFloat16) {
    using T = c10::BFloat16;
    run_gemm<T>(w, dequant, x.data_ptr<T>(), x.stride(0), m,
                bias.has_value() ? bias->data_ptr<T>() : nullptr, out.data_ptr<T>(),
                out.stride(0));
  } else {
    run_gemm<float>(w, dequant, x.data_ptr<float>(), x.stride(0), m,
                    bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(),
                    out.stride(0));
  }
#else
  TORCH_CHECK(false, "gguf_gemm: built without AMX-BF16 support");
#endif
}

}  // namespace pagedserve_cpu
