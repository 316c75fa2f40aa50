// int8 linears (W8A8): int8_linear, int8_kernel, set_int8_portable.
// out[M, N] = x[M, K] @ W[N, K]^T with W int8 and one float32 scale per output channel (set at
// load, engine/layers/quantization/int8.py), x quantized here per row (token): scale = max|x| / 127,
// q = round-half-even(x / scale) in [-127, 127]. The int32 dot of the quantized values is exact;
// out = float(dot) * (x_scale * w_scale) (+ bias), rounded once to x's dtype.
// W arrives packed [ceil(N/16), ceil(K/4), 16, 4] (zero padded): one 64-byte vector holds four
// consecutive k of 16 output channels, the operand layout of vpdpbusd, so a GEMV broadcasts
// four bytes of x and needs no horizontal sum. vpdpbusd multiplies unsigned by signed bytes:
// x goes in as q + 128 and 128 * sum_k W[n][k] (w_sum, from the loader) is subtracted after.
// AVX-512 VNNI where the build has it, a portable loop elsewhere (or when set_int8_portable).
#include "common.h"
#include "ops.h"

#include <optional>
#include <string>

namespace pagedserve_cpu {
namespace {

constexpr int64_t kLanes = 16;  // output channels per packed block
constexpr int64_t kGroup = 4;   // k values per int32 lane
constexpr int kMaxRows = 8;     // rows sharing one weight load

std::atomic<bool> g_portable{false};

// The rows of x quantized: u[m][k] = q + 128 (padding k holds 128, i.e. q = 0).
struct QuantRows {
  std::vector<uint8_t> u;
  std::vector<float> scale;
  int64_t kp;
};

template <typename T>
void quantize_row(const T* x, int64_t k, uint8_t* u, float& scale_out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < k; ++i) amax = std::fmax(amax, std::fabs(to_f(x[i])));
  const float scale = amax / 127.0f;
  scale_out = scale;
  if (scale == 0.0f) {
    std::memset(u, 128, k);
    return;
  }
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  if constexpr (kVec<T>) {
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (; i + 16 <= k; i += 16) {
      // the division (not a multiply by 1/scale) rounds as the torch oracle's does
      __m512 q = _mm512_roundscale_ps(
          _mm512_div_ps(load16(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
      __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u + i), _mm512_cvtepi32_epi8(v));
    }
  }
#endif
  for (; i < k; ++i) {
    float q = std::nearbyint(to_f(x[i]) / scale);
    q = std::fmin(std::fmax(q, -127.0f), 127.0f);
    u[i] = static_cast<uint8_t>(static_cast<int32_t>(q) + 128);
  }
}

template <typename T>
QuantRows quantize_rows(const at::Tensor& x, int64_t kp) {
  const int64_t m = x.size(0), k = x.size(1), ldx = x.stride(0);
  QuantRows rows{std::vector<uint8_t>(m * kp, 128), std::vector<float>(m), kp};
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, m, row_grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(xp + r * ldx, k, rows.u.data() + r * kp, rows.scale[r]);
  });
  return rows;
}

struct Int8Call {
  const QuantRows* rows;
  const int8_t* w;  // packed
  const float* w_scale;
  const int32_t* w_sum;
  int64_t n, kp;
};

// One output row's 16 channels of block nb, from exact int32 sums.
template <typename T>
PAGEDSERVE_INLINE void store_block(
    const Int8Call& c, const int32_t* acc, int64_t m, int64_t nb, const T* bias, T* out,
    int64_t ldo) {
  const float xs = c.rows->scale[m];
  const int64_t n0 = nb * kLanes, lanes = std::min(kLanes, c.n - n0);
  for (int64_t l = 0; l < lanes; ++l) {
    float y = static_cast<float>(acc[l]) * (xs * c.w_scale[n0 + l]);
    if (bias != nullptr) y += to_f(bias[n0 + l]);
    out[m * ldo + n0 + l] = from_f<T>(y);
  }
}

template <typename T>
void portable_block(const Int8Call& c, int64_t nb, int64_t m0, int64_t m1, const T* bias, T* out,
                    int64_t ldo) {
  const int8_t* wb = c.w + nb * c.kp * kLanes;
  for (int64_t m = m0; m < m1; ++m) {
    const uint8_t* u = c.rows->u.data() + m * c.kp;
    int32_t acc[kLanes] = {};
    for (int64_t g = 0; g < c.kp / kGroup; ++g)
      for (int64_t l = 0; l < kLanes; ++l)
        for (int64_t j = 0; j < kGroup; ++j)
          acc[l] += (static_cast<int32_t>(u[g * kGroup + j]) - 128) *
                    wb[(g * kLanes + l) * kGroup + j];
    store_block(c, acc, m, nb, bias, out, ldo);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDSERVE_VNNI 1

// R rows (R <= kMaxRows) of one 16-channel block: one weight load feeds R vpdpbusd.
template <int R, typename T>
PAGEDSERVE_INLINE void vnni_rows(const Int8Call& c, int64_t nb, int64_t m0, const T* bias,
                                 T* out, int64_t ldo) {
  const int8_t* wb = c.w + nb * c.kp * kLanes;
  const uint8_t* u = c.rows->u.data() + m0 * c.kp;
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  const int64_t groups = c.kp / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i w = _mm512_loadu_si512(wb + g * kLanes * kGroup);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, u + r * c.kp + g * kGroup, 4);
      acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(four), w);
    }
  }
  const int64_t n0 = nb * kLanes;
  const int64_t lanes = std::min(kLanes, c.n - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
  // w_sum past N reads as 0 (masked): the padded channels' results are never stored
  const __m512i shift =
      _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, c.w_sum + n0), 7);  // 128 * w_sum
  for (int r = 0; r < R; ++r) {
    alignas(64) int32_t sums[kLanes];
    _mm512_store_si512(sums, _mm512_sub_epi32(acc[r], shift));
    store_block(c, sums, m0 + r, nb, bias, out, ldo);
  }
}

template <typename T>
void vnni_block(const Int8Call& c, int64_t nb, int64_t m0, int64_t m1, const T* bias, T* out,
                int64_t ldo) {
  int64_t m = m0;
  for (; m + kMaxRows <= m1; m += kMaxRows) vnni_rows<kMaxRows>(c, nb, m, bias, out, ldo);
  switch (m1 - m) {
    case 7: vnni_rows<7>(c, nb, m, bias, out, ldo); break;
    case 6: vnni_rows<6>(c, nb, m, bias, out, ldo); break;
    case 5: vnni_rows<5>(c, nb, m, bias, out, ldo); break;
    case 4: vnni_rows<4>(c, nb, m, bias, out, ldo); break;
    case 3: vnni_rows<3>(c, nb, m, bias, out, ldo); break;
    case 2: vnni_rows<2>(c, nb, m, bias, out, ldo); break;
    case 1: vnni_rows<1>(c, nb, m, bias, out, ldo); break;
    default: break;
  }
}
#endif

bool use_vnni() {
#ifdef PAGEDSERVE_VNNI
  return !g_portable.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// Work items are (channel block, row tile): rows in tiles of 64 keep a block's weights in L1
// while every row tile of a prefill chunk passes over them.
template <typename T>
void run_int8(const Int8Call& c, const T* bias, T* out, int64_t ldo, int64_t m) {
  constexpr int64_t kRowTile = 64;
  const int64_t blocks = (c.n + kLanes - 1) / kLanes;
  const int64_t tiles = (m + kRowTile - 1) / kRowTile;
  const bool vnni = use_vnni();
  WorkQueue(blocks * tiles).run([&](WorkQueue& queue) {
    int64_t begin, end;
    while (queue.take(begin, end)) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t nb = item % blocks, m0 = (item / blocks) * kRowTile;
        const int64_t m1 = std::min(m, m0 + kRowTile);
#ifdef PAGEDSERVE_VNNI
        if (vnni) {
          vnni_block(c, nb, m0, m1, bias, out, ldo);
          continue;
        }
#endif
        (void)vnni;
        portable_block(c, nb, m0, m1, bias, out, ldo);
      }
    }
  });
}

}  // namespace

void int8_linear(
    const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
    const at::Tensor& w_scale, const at::Tensor& w_sum, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "int8_linear: x must be [M, K], rows contiguous");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 4,
              "int8_linear: packed must be contiguous int8 [N/16, K/4, 16, 4]");
  TORCH_CHECK(packed.size(2) == kLanes && packed.size(3) == kGroup, "int8_linear: packed layout");
  const int64_t m = x.size(0), k = x.size(1), n = w_scale.numel();
  const int64_t kp = packed.size(1) * kGroup;
  TORCH_CHECK(kp >= k && kp < k + kGroup, "int8_linear: packed K does not match x");
  TORCH_CHECK(packed.size(0) == (n + kLanes - 1) / kLanes, "int8_linear: packed N vs w_scale");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous(),
              "int8_linear: w_scale must be contiguous float32 [N]");
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && w_sum.is_contiguous() && w_sum.numel() == n,
              "int8_linear: w_sum must be contiguous int32 [N]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "int8_linear: out must be [M, N] of x's dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n &&
                    bias->scalar_type() == x.scalar_type(),
                "int8_linear: bias must be contiguous [N] of x's dtype");
  if (m == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_linear", [&] {
    const QuantRows rows = quantize_rows<scalar_t>(x, kp);
    const Int8Call call{&rows, packed.data_ptr<int8_t>(), w_scale.data_ptr<float>(),
                        w_sum.data_ptr<int32_t>(), n, kp};
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    run_int8<scalar_t>(call, b, out.data_ptr<scalar_t>(), out.stride(0), m);
  });
}

std::string int8_kernel() { return use_vnni() ? "avx512_vnni" : "portable"; }

bool set_int8_portable(bool portable) { return g_portable.exchange(portable); }

}  // namespace pagedserve_cpu
