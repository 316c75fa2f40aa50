// The byte map of the packed GGUF layout (described at the top of gguf_quant.cpp, built by
// engine/layers/quantization/gguf.py PackedQuant): the quants of one block as 8 vectors, for the
// kernels that read it (gguf_quant.cpp's VNNI rows, gguf_gemm.cpp's tile dequantization), and
// its scales in either width.
#pragma once

#include "common.h"

#if defined(__AVX512BW__)
namespace pagedserve_cpu {

// Bits 4-5 (6-bit types) or bit 4 (5-bit) of vector v's quants from the high-bit vectors.
template <int Bits>
PAGEDSERVE_INLINE __m512i gguf_high_bits(const uint8_t* qh, int v) {
  if constexpr (Bits == 5) {
    const __m512i h = _mm512_loadu_si512(qh);
    const __m512i bit = v <= 4 ? _mm512_slli_epi16(h, 4 - v) : _mm512_srli_epi16(h, v - 4);
    return _mm512_and_si512(bit, _mm512_set1_epi8(0x10));
  } else {
    const __m512i h = _mm512_loadu_si512(qh + (v / 4) * 64);
    const int shift = 2 * (v % 4);  // bits shift, shift+1 -> 4, 5
    const __m512i bits =
        shift <= 4 ? _mm512_slli_epi16(h, 4 - shift) : _mm512_srli_epi16(h, shift - 4);
    return _mm512_and_si512(bits, _mm512_set1_epi8(0x30));
  }
}

// The 16 channels' scales (or mins) at element i of a [.., 16] array: fp16 (Half, the 32-weight
// types) widened exactly by one vcvtph2ps, or float32 (the K types).
template <bool Half>
PAGEDSERVE_INLINE __m512 gguf_load_scales(const void* base, int64_t i) {
  if constexpr (Half)
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i)));
  else
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
}

// The 8 quant vectors of one block (16 channels x 32 k), each byte an unsigned quant.
template <int Bits>
PAGEDSERVE_INLINE void gguf_decode_block(const uint8_t* qs, const uint8_t* qh, __m512i* wv) {
  if constexpr (Bits == 8) {
    for (int v = 0; v < 8; ++v) wv[v] = _mm512_loadu_si512(qs + v * 64);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; ++v) {
      const __m512i t = _mm512_loadu_si512(qs + v * 64);
      wv[v] = _mm512_and_si512(t, low);
      wv[v + 4] = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
    }
    if constexpr (Bits == 5 || Bits == 6)
      for (int v = 0; v < 8; ++v) wv[v] = _mm512_or_si512(wv[v], gguf_high_bits<Bits>(qh, v));
  }
}

}  // namespace pagedserve_cpu
#endif
