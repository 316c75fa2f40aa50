// paged_attention_cascade: decode for sequences that share a prefix, then their own blocks.
// Decoding sequences that share their first `prefix_len` tokens (the same physical blocks,
// a prefix-cache hit) read that prefix once for all of them instead of once each: per KV head
// its B x G queries go through the prefill kernel 16 at a time against the prefix (all keys
// visible), every sequence's remaining tokens through the decode kernel, and the two partial
// results are merged by their log-sum-exp in float32, rounded to bf16 once.
//   prefix_blocks [>= prefix_len / block_size] int32: the shared blocks;
//   block_table [B, *] int32 and seq_lens [B]: each sequence's blocks and tokens after them.
// Two bodies: on AMX the suffixes go through the AMX decode kernel and the prefix through the
// prefill kernel's AMX block; without AMX (AVX-512 BF16) both go through the prefill kernel's
// vector block, a suffix as the G query heads of one token (per sequence and KV head, its V^T
// built per call).
#include "common.h"
#include "decode.h"
#include "ops.h"
#include "prefill.h"

namespace pagedserve_cpu {

#ifdef PAGEDSERVE_AVX512BF16
namespace {

// Shapes, dtypes and ranges paged_attention_cascade relies on.
void check_cascade_args(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& prefix_blocks, int64_t prefix_len,
    const at::Tensor& block_table, const at::Tensor& seq_lens) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [B, H, D], D contiguous");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1, "out: [B, H, D], D contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "bf16 only");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens");
  TORCH_CHECK(prefix_blocks.scalar_type() == at::kInt && prefix_blocks.is_contiguous(),
              "prefix_blocks: int32");
  const int64_t batch = query.size(0), heads = query.size(1), d = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == d && v_cache.sizes() == k_cache.sizes(),
              "head shapes");
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(cascade_supported(d, block_size, group), "shapes the cascade does not cover");
  TORCH_CHECK(out.size(0) == batch && out.size(1) == heads && out.size(2) == d, "out like query");
  TORCH_CHECK(block_table.size(0) == batch && seq_lens.numel() == batch, "one row per sequence");
  TORCH_CHECK(prefix_len >= 1 && prefix_len <= prefix_blocks.numel() * block_size,
              "prefix_len must be in [1, len(prefix_blocks) * block_size]");
  TORCH_CHECK(
      all_in_range(seq_lens.data_ptr<int32_t>(), batch, 1, block_table.size(1) * block_size),
      "seq_lens must be in [1, max_blocks * block_size]");
  const int64_t num_blocks = k_cache.size(0);
  TORCH_CHECK(
      all_in_range(prefix_blocks.data_ptr<int32_t>(), prefix_blocks.numel(), 0, num_blocks - 1),
      "prefix_blocks out of range");
}

// The raw pointers and sizes both passes share.
struct CascadeArgs {
  const c10::BFloat16 *qp, *kp, *vp;
  c10::BFloat16* op;
  const int32_t *pb, *bt, *lens;
  int64_t batch, heads, d, block_size, kv_heads, group, prefix_len, token_stride, pad;
  int64_t q_stride, qh, bt_stride, out_stride, out_head_stride;
  float scale;
};

// Pass 1's first kv_heads tasks: the prefix's V^T of KV head h into its slot of vt.
PAGEDSERVE_INLINE void prefix_vt(const CascadeArgs& a, c10::BFloat16* vt, int64_t h) {
  build_vt(vt + h * a.d * a.pad, a.vp, a.pb, a.prefix_len, a.block_size, a.token_stride, h, a.d);
}

#ifdef PAGEDSERVE_AMX
// Pass 1: V^T of the prefix per KV head into vt, and every sequence's suffix (all heads per
// task) into os [B, H, D] float32 with its log-sum-exp in ls [B, H].
void cascade_suffix_pass(const CascadeArgs& a, c10::BFloat16* vt, float* os, float* ls) {
  const int64_t kv_heads = a.kv_heads, d = a.d, heads = a.heads;
  WorkQueue(kv_heads + a.batch).run([&](WorkQueue& queue) {
    bool tiles = false;
    DecodeAmxScratch scratch;
    int64_t begin, end;
    while (queue.take(begin, end)) {
      for (int64_t task = begin; task < end; ++task) {
        if (task < kv_heads) {
          prefix_vt(a, vt, task);
          continue;
        }
        if (!tiles) amx_configure_decode(a.group), tiles = true;
        const int64_t b = task - kv_heads;
        decode_heads_amx_f32(os + b * heads * d, d, a.qp + b * a.q_stride, a.qh, a.kp, a.vp,
                             a.bt + b * a.bt_stride, a.lens[b], a.block_size, kv_heads, 0,
                             kv_heads, a.group, d, a.scale, scratch, ls + b * heads);
      }
    }
    if (tiles) _tile_release();
  });
}
#endif

// Pass 1 without AMX: V^T of the prefix per KV head into vt; per (sequence, KV head) the G
// query heads of its one token against its suffix, through the prefill kernel's vector block
// (all keys visible), into os and ls as above.
void cascade_suffix_pass_vec(const CascadeArgs& a, c10::BFloat16* vt, float* os, float* ls) {
  const int64_t kv_heads = a.kv_heads, d = a.d, heads = a.heads, group = a.group;
  WorkQueue(kv_heads + a.batch * kv_heads).run([&](WorkQueue& queue) {
    PrefillScratch scratch;
    std::vector<c10::BFloat16> suffix_vt;
    int64_t begin, end;
    while (queue.take(begin, end)) {
      for (int64_t task = begin; task < end; ++task) {
        if (task < kv_heads) {
          prefix_vt(a, vt, task);
          continue;
        }
        const int64_t b = (task - kv_heads) / kv_heads, h = (task - kv_heads) % kv_heads;
        const int64_t len = a.lens[b], pad = (len + 31) / 32 * 32;
        const int32_t* blocks = a.bt + b * a.bt_stride;
        suffix_vt.resize(d * pad);
        build_vt(suffix_vt.data(), a.vp, blocks, len, a.block_size, a.token_stride, h, d);
        prefill_block_f32(false, d, os + (b * heads + h * group) * d, d,
                          a.qp + b * a.q_stride + h * group * a.qh, a.qh, group, len - 1, len,
                          a.kp, suffix_vt.data(), pad, blocks, a.block_size, a.token_stride, h,
                          a.scale, scratch, ls + b * heads + h * group);
      }
    }
  });
}

// dst = (prefix * e^lp + suffix * e^ls) / (e^lp + e^ls), weights taken relative to their max.
PAGEDSERVE_INLINE void merge_by_lse(
    c10::BFloat16* dst, const float* prefix, float lp, const float* suffix, float lsfx,
    int64_t d) {
  const float m = std::max(lp, lsfx);
  const float wp = std::exp(lp - m), ws = std::exp(lsfx - m), inv = 1.0f / (wp + ws);
  const __m512 vp_ = _mm512_set1_ps(wp * inv), vs_ = _mm512_set1_ps(ws * inv);
  for (int64_t i = 0; i < d; i += 16)
    store16(dst + i, _mm512_fmadd_ps(_mm512_loadu_ps(prefix + i), vp_,
                                     _mm512_mul_ps(_mm512_loadu_ps(suffix + i), vs_)));
}

// Pass 2: per (KV head, 16 of its B x G queries): the prefix, then the merge into out (the
// prefill block on AMX tiles or on vectors).
void cascade_prefix_pass(
    const CascadeArgs& a, const c10::BFloat16* vt, const float* os, const float* ls, bool amx) {
  const int64_t d = a.d, heads = a.heads, group = a.group;
  const int64_t nqk = a.batch * group, chunks = (nqk + 15) / 16;
  WorkQueue(a.kv_heads * chunks).run([&](WorkQueue& queue) {
#ifdef PAGEDSERVE_AMX
    if (amx) amx_configure_square();
#endif
    PrefillScratch scratch;
    alignas(64) c10::BFloat16 qbuf[16 * 256];  // head_dim <= 256 (prefill_amx_applies)
    alignas(64) float obuf[16 * 256];
    float lse[16];
    int64_t seq[16], head[16];  // query n of the task: (sequence, query head)
    int64_t begin, end;
    while (queue.take(begin, end)) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / chunks, i0 = (task % chunks) * 16;
        const int64_t nq = std::min<int64_t>(16, nqk - i0);
        for (int64_t n = 0; n < nq; ++n) {
          seq[n] = (i0 + n) / group, head[n] = h * group + (i0 + n) % group;
          std::memcpy(qbuf + n * d, a.qp + seq[n] * a.q_stride + head[n] * a.qh,
                      d * sizeof(c10::BFloat16));
        }
        prefill_block_f32(amx, d, obuf, d, qbuf, d, nq, a.prefix_len - 1, a.prefix_len, a.kp,
                          vt + h * d * a.pad, a.pad, a.pb, a.block_size, a.token_stride, h,
                          a.scale, scratch, lse);
        for (int64_t n = 0; n < nq; ++n) {
          const int64_t b = seq[n];
          merge_by_lse(a.op + b * a.out_stride + head[n] * a.out_head_stride, obuf + n * d,
                       lse[n], os + (b * heads + head[n]) * d, ls[b * heads + head[n]], d);
        }
      }
    }
#ifdef PAGEDSERVE_AMX
    if (amx) _tile_release();
#endif
  });
}

// The AMX body where both its kernels apply (their switches on), else the vector body.
bool cascade_on_amx(int64_t head_dim, int64_t block_size, int64_t group) {
#ifdef PAGEDSERVE_AMX
  return prefill_kernel(head_dim, block_size) == "amx" &&
         decode_amx_applies(head_dim, block_size, group);
#else
  (void)head_dim, (void)block_size, (void)group;
  return false;
#endif
}

}  // namespace
#endif

bool cascade_supported(int64_t head_dim, int64_t block_size, int64_t group) {
#ifdef PAGEDSERVE_AVX512BF16
  return prefill_shapes_ok(head_dim, block_size) && group <= 16;
#else
  (void)head_dim, (void)block_size, (void)group;
  return false;
#endif
}

void paged_attention_cascade(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& prefix_blocks, int64_t prefix_len,
    const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
#ifdef PAGEDSERVE_AVX512BF16
  check_cascade_args(out, query, k_cache, v_cache, prefix_blocks, prefix_len, block_table,
                     seq_lens);
  CascadeArgs a;
  a.qp = query.data_ptr<c10::BFloat16>();
  a.op = out.data_ptr<c10::BFloat16>();
  a.kp = k_cache.data_ptr<c10::BFloat16>();
  a.vp = v_cache.data_ptr<c10::BFloat16>();
  a.pb = prefix_blocks.data_ptr<int32_t>();
  a.bt = block_table.data_ptr<int32_t>();
  a.lens = seq_lens.data_ptr<int32_t>();
  a.batch = query.size(0), a.heads = query.size(1), a.d = query.size(2);
  a.block_size = k_cache.size(1), a.kv_heads = k_cache.size(2), a.group = a.heads / a.kv_heads;
  a.prefix_len = prefix_len;
  a.token_stride = a.kv_heads * a.d, a.pad = (prefix_len + 31) / 32 * 32;
  a.q_stride = query.stride(0), a.qh = query.stride(1), a.bt_stride = block_table.stride(0);
  a.out_stride = out.stride(0), a.out_head_stride = out.stride(1);
  a.scale = static_cast<float>(scale);
  // Reused across calls (see paged_attention_prefill): the prefix's V^T per KV head, and the
  // suffix results in float32 with their log-sum-exp.
  static thread_local std::vector<c10::BFloat16> vt_buf;
  static thread_local std::vector<float> os_buf, ls_buf;
  vt_buf.resize(a.kv_heads * a.d * a.pad);
  os_buf.resize(a.batch * a.heads * a.d);
  ls_buf.resize(a.batch * a.heads);
  const bool amx = cascade_on_amx(a.d, a.block_size, a.group);
#ifdef PAGEDSERVE_AMX
  if (amx) cascade_suffix_pass(a, vt_buf.data(), os_buf.data(), ls_buf.data());
#endif
  if (!amx) cascade_suffix_pass_vec(a, vt_buf.data(), os_buf.data(), ls_buf.data());
  cascade_prefix_pass(a, vt_buf.data(), os_buf.data(), ls_buf.data(), amx);
#else
  TORCH_CHECK(false, "built without AVX-512 BF16 support");
#endif
}

}  // namespace pagedserve_cpu
