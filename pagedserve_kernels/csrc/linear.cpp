// Small-batch bf16 linear on AMX: amx_pack_weight, amx_linear (and amx_available).
// out[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) for decode-sized M, where oneDNN's per-call
// overhead dominates, and for any M where a row's result must not depend on M (batch
// invariance): every row runs the same K loop from zeroed float32 tiles, whatever M is, and
// the bias is added in float32 before the one rounding to bf16. W is packed once into AMX's B-tile layout: for each 16 output columns and 32 k,
// a 16 x 64-byte tile whose row r holds (W[n][k0+2r], W[n][k0+2r+1]) for n in 0..15.
// Threads take 32-column chunks (two B tiles, back to back in the packed layout) from a
// WorkQueue; C tiles 0-3, A tiles 4-5, B tiles 6-7 (amx_configure_square).
#include "common.h"
#include "ops.h"

namespace pagedserve_cpu {

namespace {

void check_linear_args(
    const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "bf16");
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(
      packed.dim() == 5 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
      "packed must come from amx_pack_weight");
  const int64_t m = x.size(0), k = x.size(1), nt = packed.size(0), kt = packed.size(1);
  TORCH_CHECK(kt * 32 == k && out.size(1) == nt * 16 && out.size(0) == m, "shapes");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->size(0) == nt * 16,
                "bias: [N] bf16, contiguous");
}

}  // namespace

#ifdef PAGEDSERVE_AMX
namespace {

constexpr int64_t kPrefetchTiles = 8;

// Decode-sized rows: the weights stream into L2 one chunk ahead of use, 16 lines (one tile)
// per dot step in both passes, so memory stays busy while rows 16-31 run from cache; at the
// end of a thread's range of chunks it runs on into the next range that thread has taken
// (bench/README.md, "Decode linears: the weight stream keeps pace through both 16-row passes").
struct Stream {
  const char *at = nullptr, *end = nullptr, *next = nullptr, *next_end = nullptr;
  PAGEDSERVE_INLINE void advance() {
    for (int line = 0; line < 16; ++line, at += 64) {
      if (at >= end) {
        if (next == nullptr) return;
        at = next, end = next_end, next = nullptr;
      }
      _mm_prefetch(at, _MM_HINT_T1);
    }
  }
};

// One amx_linear call's operands. A tiles read 16 full rows straight from x; a last partial
// tile reads `tail`, a zero-padded copy of the remaining rows.
struct LinearCall {
  const c10::BFloat16* xp;
  int64_t ldx, full_rows, k;
  const c10::BFloat16* tail;
  const c10::BFloat16* wp;
  int64_t nt, kt;  // 16-column weight tiles, 32-wide K steps
  c10::BFloat16* op;
  int64_t os, m;
  const c10::BFloat16* bias;  // [N] or nullptr
  PAGEDSERVE_INLINE std::pair<const c10::BFloat16*, int64_t> a_tile(int64_t m0) const {
    if (m0 < full_rows) return {xp + m0 * ldx, ldx * 2};
    return {tail, k * 2};
  }
};

// The weight tiles of one 32-column chunk: b0 and, unless the chunk is the last odd tile, b1.
struct Chunk {
  const c10::BFloat16* b0;
  const c10::BFloat16* b1;
  int64_t n0, kt;
  bool two;
  // C tiles 0 (and 1) += 16 rows of x (A tile 4) x the chunk's K-step kb (B tiles 6, 7)
  PAGEDSERVE_INLINE void dot_rows(const c10::BFloat16* a, int64_t lda, int64_t kb) const {
    _tile_loadd(4, a + kb * 32, lda);
    _tile_loadd(6, b0 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) {
      _tile_loadd(7, b1 + kb * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
  }
  // B streams from memory: fetch ahead, into this thread's next chunk near the end (chunks lie
  // back to back: its tiles start 2 * kt tiles after this one's).
  PAGEDSERVE_INLINE void prefetch(int64_t kb, bool next_is_ours, int64_t nt) const {
    const int64_t ahead = kb + kPrefetchTiles;
    if (ahead < kt || (next_is_ours && ahead < 2 * kt)) {
      const c10::BFloat16* f = ahead < kt ? b0 + ahead * 512 : b0 + (kt + ahead) * 512;
      const char* f0 = reinterpret_cast<const char*>(f);
      const char* f1 = reinterpret_cast<const char*>(f + kt * 512);
      const bool next_two = ahead < kt ? two : n0 + 3 < nt;
      for (int line = 0; line < 1024; line += 64) {
        _mm_prefetch(f0 + line, _MM_HINT_T0);
        if (next_two) _mm_prefetch(f1 + line, _MM_HINT_T0);
      }
    }
  }
};

// Decode-sized (17-32 rows): the first 16 rows read the chunk's weights, the next 16 read them
// back from cache. One loop over both row tiles holds up the weight stream with its extra dot
// products (bench/README.md, "Decode linears: two 16-row passes instead of one 2 x 2 tile
// loop"); the stream keeps pace across both passes.
PAGEDSERVE_INLINE void chunk_two_passes(
    const LinearCall& c, const Chunk& ch, int64_t m0, Stream& stream, float (*cbuf)[16 * 16]) {
  for (int64_t mi = 0; mi < 2; ++mi) {
    const auto [a, lda] = c.a_tile(m0 + 16 * mi);
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < c.kt; ++kb) {
      stream.advance();
      ch.dot_rows(a, lda, kb);
    }
    _tile_stored(0, cbuf[2 * mi], 64);
    if (ch.two) _tile_stored(1, cbuf[2 * mi + 1], 64);
  }
}

// 2 x 2 tiles per K step (prefill-sized rows, or one row tile): every further 32 rows reuse
// the chunk from cache; the first 32 prefetch it.
PAGEDSERVE_INLINE void chunk_2x2(
    const LinearCall& c, const Chunk& ch, int64_t m0, bool two_m, bool first_rows,
    bool next_is_ours, float (*cbuf)[16 * 16]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const auto [a0, lda0] = c.a_tile(m0);
  const auto [a1, lda1] = two_m ? c.a_tile(m0 + 16) : c.a_tile(m0);
  for (int64_t kb = 0; kb < c.kt; ++kb) {
    if (first_rows) ch.prefetch(kb, next_is_ours, c.nt);
    ch.dot_rows(a0, lda0, kb);  // keeps the chunk's B tiles in 6 and 7 for rows 16-31
    if (two_m) {
      _tile_loadd(5, a1 + kb * 32, lda1);
      _tile_dpbf16ps(2, 5, 6);
      if (ch.two) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf[0], 64);
  if (ch.two) _tile_stored(1, cbuf[1], 64);
  if (two_m) {
    _tile_stored(2, cbuf[2], 64);
    if (ch.two) _tile_stored(3, cbuf[3], 64);
  }
}

// Rows m0.. (up to 32, those below m) of the C tiles in cbuf -> bf16 columns n0.. of out.
PAGEDSERVE_INLINE void store_chunk(
    const LinearCall& c, const Chunk& ch, int64_t m0, bool two_m, float (*cbuf)[16 * 16]) {
  for (int64_t mi = 0; mi < 2; ++mi) {
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t row = m0 + mi * 16 + r;
      if (row >= c.m || (mi == 1 && !two_m)) break;
      c10::BFloat16* orow = c.op + row * c.os + ch.n0 * 16;
      __m512 lo = _mm512_loadu_ps(cbuf[mi * 2] + r * 16);
      __m512 hi = ch.two ? _mm512_loadu_ps(cbuf[mi * 2 + 1] + r * 16) : _mm512_setzero_ps();
      if (c.bias != nullptr) {  // in float32, so the output is rounded once
        lo = _mm512_add_ps(lo, load16(c.bias + ch.n0 * 16));
        if (ch.two) hi = _mm512_add_ps(hi, load16(c.bias + ch.n0 * 16 + 16));
      }
      store16(orow, lo);
      if (ch.two) store16(orow + 16, hi);
    }
  }
}

// Output columns [begin, end) in 32-column chunks for rows [pass, pass_end), in this thread's
// tile configuration.
PAGEDSERVE_INLINE void run_chunks(
    const LinearCall& c, int64_t pass, int64_t pass_end, int64_t begin, int64_t end,
    Stream& stream, float (*cbuf)[16 * 16]) {
  for (int64_t chunk = begin; chunk < end; ++chunk) {
    Chunk ch;
    ch.n0 = chunk * 2, ch.kt = c.kt, ch.two = ch.n0 + 1 < c.nt;
    ch.b0 = c.wp + ch.n0 * c.kt * 512;
    ch.b1 = ch.b0 + c.kt * 512;
    for (int64_t m0 = pass; m0 < pass_end; m0 += 32) {
      const bool two_m = m0 + 16 < pass_end;
      if (two_m && pass_end - pass <= 32) {
        chunk_two_passes(c, ch, m0, stream, cbuf);
      } else {
        chunk_2x2(c, ch, m0, two_m, m0 == pass, chunk + 1 < end, cbuf);
      }
      store_chunk(c, ch, m0, two_m, cbuf);
    }
  }
}

}  // namespace
#endif

#ifdef PAGEDSERVE_AVX512BF16
namespace {

// The vector body of dense_linear (no AMX): the same packed weight, whose 16-column tile nt is
// one contiguous stream of K / 2 rows of 64 bytes (k pair p: 16 columns x 2 bf16). R rows of x
// by 4 tiles (64 columns) per block: per k pair, 4 weight rows and R broadcast x pairs feed
// 4R vdpbf16ps into float32 accumulators; the bias is added in float32 before the one
// rounding to bf16, as on AMX. Tiles past the last are clamped to it and not stored.
template <int R>
void vec_block(const c10::BFloat16* const* xr, int64_t k, const c10::BFloat16* wp, int64_t nt,
               int64_t kt, int64_t nt0, c10::BFloat16* const* orow,
               const c10::BFloat16* bias) {
  const c10::BFloat16* b[4];
  for (int j = 0; j < 4; ++j) b[j] = wp + std::min<int64_t>(nt0 + j, nt - 1) * kt * 512;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[4];
    for (int j = 0; j < 4; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b[j] + p * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh a =
          (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr[r] + 2 * p));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, bv[j]);
    }
  }
  const int64_t tiles = std::min<int64_t>(4, nt - nt0);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < tiles; ++j) {
      __m512 v = acc[r][j];
      if (bias != nullptr) v = _mm512_add_ps(v, load16(bias + (nt0 + j) * 16));
      store16(orow[r] + (nt0 + j) * 16, v);
    }
}

void dense_linear_vec(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), k = x.size(1), nt = packed.size(0), kt = packed.size(1);
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), os = out.stride(0);
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const int64_t chunks = (nt + 3) / 4;  // 64 output columns each
  // Threads take column chunks; each runs every row over its chunk, 4 rows at a time, so the
  // chunk's weights are read from memory once and from cache by the later rows.
  WorkQueue(chunks).run([&](WorkQueue& queue) {
    int64_t begin, end;
    while (queue.take(begin, end)) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        for (int64_t m0 = 0; m0 < m; m0 += 4) {
          const int64_t rows = std::min<int64_t>(4, m - m0);
          const c10::BFloat16* xr[4];
          c10::BFloat16* orow[4];
          for (int64_t r = 0; r < rows; ++r) {
            xr[r] = xp + (m0 + r) * ldx;
            orow[r] = op + (m0 + r) * os;
          }
          switch (rows) {
            case 4: vec_block<4>(xr, k, wp, nt, kt, chunk * 4, orow, bp); break;
            case 3: vec_block<3>(xr, k, wp, nt, kt, chunk * 4, orow, bp); break;
            case 2: vec_block<2>(xr, k, wp, nt, kt, chunk * 4, orow, bp); break;
            default: vec_block<1>(xr, k, wp, nt, kt, chunk * 4, orow, bp); break;
          }
        }
      }
    }
  });
}

}  // namespace
#endif

bool amx_available() {
#ifdef PAGEDSERVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor amx_pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w: [N, K] bfloat16");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % 16 == 0 && k % 32 == 0, "AMX packing needs N % 16 == 0 and K % 32 == 0");
  // [N/16, K/32, 16 (k pairs), 16 (n), 2] as a view of w
  return w.contiguous().view({n / 16, 16, k / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

// On by default; set_amx_dense_linear(false) sends dense_linear to the vector body (tests).
std::atomic<bool> amx_dense_enabled{true};

bool dense_on_amx() {
#ifdef PAGEDSERVE_AMX
  return amx_dense_enabled.load(std::memory_order_relaxed) && amx_permitted();
#else
  return false;
#endif
}

bool set_amx_dense_linear(bool enabled) { return amx_dense_enabled.exchange(enabled); }

// Which body dense_linear runs: "amx", "avx512_bf16", or "" where neither can.
std::string dense_linear_kernel() {
  if (dense_on_amx()) return "amx";
#ifdef PAGEDSERVE_AVX512BF16
  return "avx512_bf16";
#else
  return "";
#endif
}

// amx_linear where AMX is, else its vector body (AVX-512 BF16) on the same packed weight.
void dense_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias) {
#ifdef PAGEDSERVE_AMX
  if (dense_on_amx()) return amx_linear(out, x, packed, bias);
#endif
#ifdef PAGEDSERVE_AVX512BF16
  check_linear_args(out, x, packed, bias);
  dense_linear_vec(out, x, packed, bias);
#else
  (void)out, (void)x, (void)packed, (void)bias;
  TORCH_CHECK(false, "built without AMX or AVX-512 BF16 support");
#endif
}

void amx_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                const std::optional<at::Tensor>& bias) {
#ifdef PAGEDSERVE_AMX
  TORCH_CHECK(amx_permitted(), "AMX is not available to this process");
  check_linear_args(out, x, packed, bias);
  LinearCall c;
  c.m = x.size(0), c.k = x.size(1), c.nt = packed.size(0), c.kt = packed.size(1);
  const int64_t m_pad = (c.m + 15) / 16 * 16, k = c.k;
  c.xp = x.data_ptr<c10::BFloat16>();
  c.ldx = x.stride(0), c.full_rows = c.m / 16 * 16;
  std::vector<c10::BFloat16> tail(16 * k, c10::BFloat16(0.0f));
  for (int64_t r = c.full_rows; r < c.m; ++r)
    std::memcpy(tail.data() + (r - c.full_rows) * k, c.xp + r * c.ldx, k * sizeof(c10::BFloat16));
  c.tail = tail.data();
  c.wp = packed.data_ptr<c10::BFloat16>();
  c.op = out.data_ptr<c10::BFloat16>();
  c.os = out.stride(0);
  c.bias = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const int64_t n_chunks = (c.nt + 1) / 2;  // 32 output columns (two B tiles) per chunk
  const auto* w_bytes = reinterpret_cast<const char*>(c.wp);
  auto chunk_bytes = [&](int64_t chunk) {
    return w_bytes + std::min(2 * chunk, c.nt) * c.kt * 1024;
  };
  // Rows go in passes small enough for their slice of x to stay in L2 while every weight
  // chunk streams past it; within a pass the threads take ranges of output columns in turn.
  const int64_t rows_per_pass = std::max<int64_t>(32, (256 * 1024 / (2 * k)) / 32 * 32);
  for (int64_t pass = 0; pass < m_pad; pass += rows_per_pass) {
    const int64_t pass_end = std::min(m_pad, pass + rows_per_pass);
    WorkQueue(n_chunks).run([&](WorkQueue& queue) {
      amx_configure_square();
      alignas(64) float cbuf[4][16 * 16];
      Stream stream;
      int64_t begin, end;
      bool have = queue.take(begin, end);
      if (have) stream.at = chunk_bytes(std::min(begin + 1, end)), stream.end = chunk_bytes(end);
      while (have) {  // the next range is taken first, so the weight stream can run on into it
        int64_t next_begin, next_end;
        const bool more = queue.take(next_begin, next_end);
        if (more) stream.next = chunk_bytes(next_begin), stream.next_end = chunk_bytes(next_end);
        run_chunks(c, pass, pass_end, begin, end, stream, cbuf);
        begin = next_begin, end = next_end, have = more;
      }
      _tile_release();
    });
  }
#else
  TORCH_CHECK(false, "built without AMX support");
#endif
}

}  // namespace pagedserve_cpu
