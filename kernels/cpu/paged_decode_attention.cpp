// Decode attention over the paged KV cache on AVX-512: kernels.reference.paged_decode_attention.
//
// One query row per sequence attends to its first seq_lens[b] cached tokens (with a sliding
// window W > 0, to the last W of them: the others are never read), in place through its block table. The reference gathers every sequence's blocks into a padded copy,
// widens it to float32 and calls SDPA with a mask: at SmolLM2's shapes (9 query heads over 3
// KV heads of 64, ~180 tokens) that was ~50 us a layer, 1.5 ms of a 9 ms bf16 decode step,
// for work worth a few microseconds. This reads each K/V row once per query head, from L1/L2.
//
// Math in float32 (scores, softmax, weighted sum), rounded once to the query's type. Every
// (sequence, head) is one task with one fixed order of operations over its tokens, so a row's
// result does not depend on the rows it is batched with, nor on the thread it runs on: a
// verify row computed as the decode of its token (kernels.cpu.extend_attention) is bitwise
// that decode.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "float_types.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using kvmesh_cpu::with_float_type;

constexpr int kMaxVectors = 36;  // head_dim up to 576 (MLA's latent: 512 + 64 rope), in vectors of 16 floats

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// exp of 16 lanes (all <= 0 here: scores minus their max). x = n ln2 + r with |r| <= ln2/2
// (ln2 split in two parts so r keeps its bits), exp(r) by its degree-7 Taylor polynomial
// (truncation below 3e-8 relative: under float32's rounding), times 2^n.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // below, expf underflows to 0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

struct Cache {
  int64_t block_stride, offset_stride, head_stride, block_size;
};

// One (sequence, query head): out[d] = sum_t softmax(scale * q.k_t)_t v_t[d], begin <= t < len.
// ``scores`` holds len - begin floats (+16 for the last masked vector).
template <typename Q, typename T>
void attend_one(const Q* q, const T* k_cache, const T* v_cache, const Cache& c, const int64_t* table, int64_t begin,
                int64_t len, int64_t kv_head, int64_t head_dim, float scale, float* scores, Q* out) {
  const int vectors = static_cast<int>((head_dim + 15) / 16);
  __mmask16 mask[kMaxVectors];
  __m512 qv[kMaxVectors];
  for (int v = 0; v < vectors; ++v) {
    mask[v] = first_lanes(head_dim - v * 16);
    qv[v] = _mm512_mul_ps(load16(q + v * 16, mask[v]), _mm512_set1_ps(scale));
  }
  // Token t lives in block table[t / block_size] at offset t % block_size: walked block by
  // block (a division per token cost more than its dot product), from the block holding ``begin``.
  const int64_t head_offset = kv_head * c.head_stride;
  const int64_t count = len - begin;
  float max_score = -INFINITY;
  for (int64_t blk = begin / c.block_size, first = blk * c.block_size; first < len; first += c.block_size, ++blk) {
    const int64_t lo = std::max(first, begin);
    const T* k = k_cache + table[blk] * c.block_stride + head_offset + (lo - first) * c.offset_stride;
    const int64_t n = std::min(first + c.block_size, len) - lo;
    float* s = scores + (lo - begin);
    for (int64_t o = 0; o < n; ++o, k += c.offset_stride) {
      __m512 acc = _mm512_setzero_ps();
      for (int v = 0; v < vectors; ++v) acc = _mm512_fmadd_ps(qv[v], load16(k + v * 16, mask[v]), acc);
      s[o] = _mm512_reduce_add_ps(acc);
      max_score = std::max(max_score, s[o]);
    }
  }
  const __m512 shift = _mm512_set1_ps(max_score);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < count; t += 16) {
    const __mmask16 m = first_lanes(count - t);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), shift)));
    _mm512_mask_storeu_ps(scores + t, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  __m512 acc[kMaxVectors];
  for (int v = 0; v < vectors; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t blk = begin / c.block_size, first = blk * c.block_size; first < len; first += c.block_size, ++blk) {
    const int64_t lo = std::max(first, begin);
    const T* vt = v_cache + table[blk] * c.block_stride + head_offset + (lo - first) * c.offset_stride;
    const int64_t n = std::min(first + c.block_size, len) - lo;
    const float* s = scores + (lo - begin);
    for (int64_t o = 0; o < n; ++o, vt += c.offset_stride) {
      const __m512 p = _mm512_set1_ps(s[o]);
      for (int v = 0; v < vectors; ++v) acc[v] = _mm512_fmadd_ps(p, load16(vt + v * 16, mask[v]), acc[v]);
    }
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  alignas(64) float o[kMaxVectors * 16];
  for (int v = 0; v < vectors; ++v) _mm512_store_ps(o + v * 16, _mm512_mul_ps(acc[v], inv));
  for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<Q>(o[d]);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3, "q must be a 3-D CPU tensor [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be alike [num_blocks, block_size, Hk, D]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D <= kMaxVectors * 16, "head_dim ", D, " (cache ", k_cache.size(3),
              ") must match and be at most ", kMaxVectors * 16);
  TORCH_CHECK(Hk > 0 && Hq % Hk == 0, Hq, " query heads cannot share ", Hk, " KV heads");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1, "each head's D values must be contiguous");
  TORCH_CHECK(window >= 0, "window ", window, " must be 0 (none) or a positive number of tokens");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && seq_lens.numel() == B,
              "block_tables [B, W] and seq_lens [B] must have one row per query");
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t width = tables.size(1);
  const Cache c{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.size(1)};
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= width * c.block_size, "seq_lens[", b, "] = ", len[b],
                " is outside 1..", width * c.block_size, " (the block table's width)");
    max_len = std::max(max_len, len[b]);
  }
  at::Tensor out = at::empty({B, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t group = Hq / Hk;
  with_float_type(q, "q", [&](auto q_type) {
    using Q = decltype(q_type);
    with_float_type(k_cache, "the cache", [&](auto cache_type) {
      using T = decltype(cache_type);
      const Q* qp = q.data_ptr<Q>();
      const T* kp = k_cache.data_ptr<T>();
      const T* vp = v_cache.data_ptr<T>();
      Q* op = out.data_ptr<Q>();
      // One task per (sequence, head); even SmolLM2's one sequence (9 tasks of ~1 us) ran
      // 1.4x faster on two threads than on one.
      at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores(static_cast<size_t>(max_len) + 16);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = i / Hq, h = i % Hq;
          const int64_t begin = window > 0 ? std::max<int64_t>(0, len[b] - window) : 0;
          attend_one(qp + b * q.stride(0) + h * q.stride(1), kp, vp, c, table + b * width, begin, len[b], h / group,
                     D, static_cast<float>(scale), scores.data(), op + i * D);
        }
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }
