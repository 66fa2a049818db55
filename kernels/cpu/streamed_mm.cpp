// Products of a few rows that stream their weight from memory, on AVX-512:
//   int8_scaled_mm: x [M, K] @ (qweight [N, K] int8 * scale [N])^T + bias
//                   (kernels.reference.int8_scaled_mm);
//   streamed_mm:    x [M, K] @ weight [N, K]^T + bias, weight in x's float type.
//
// Decode multiplies one row (or a verify's k + 1 rows) by every weight, so it is bound by
// the bytes of weight it streams: int8 weights stream half the bytes of bf16. Each weight
// row is widened to float32 in registers and multiplied with float32 activations, so the
// only error is the weight's own rounding (to int8; none for float weights).
//
// Float weights have the same loop because torch's own one-row products streamed far below
// the machine's bandwidth on a 2-core Xeon without AVX-512 BF16 (one row through a SmolLM2
// gate/up weight, 3.5 MB in bf16, 30 copies so it comes from DRAM): bf16 9.3 GB/s plain and
// 7.8 GB/s on oneDNN's reordered weight, this loop 13.9; float32 15.3 against 17.1.
//
// Every output element is one fixed sequence of float32 FMAs over k, whatever the number of
// rows of x, the pass a row falls in, or the thread its weight rows run on: a row's result
// does not depend on what it is batched with (a speculative verify of k + 1 rows gives each
// row exactly what a decode of that row alone gives).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "float_types.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using kvmesh_cpu::with_float_type;

constexpr int kWeightRows = 4;  // weight rows read together (4 * K weights: well inside L1)
// Rows of x per pass over those weight rows: 24 accumulators + 4 weight vectors + x in the 32
// registers. A verify of 4 or 5 drafts (5 or 6 rows) fits one pass: 5 rows took 10.4 ms over
// SmolLM2's layers, against 12.4 ms with passes of at most 4 (one row: 7.0 ms).
constexpr int kMaxXRows = 6;
constexpr int64_t kBlocksPerTask = 8;
// Past this many rows of x (prefill chunks, large decode batches), the product is bound by
// arithmetic, not by weight bytes: the GEMM (AMX for bf16) runs it, on an int8 weight widened
// to x's dtype in one pass. SmolLM2's layers, bf16: streamed 29.6 / 48.8 / 68.9 ms at 17 / 32 /
// 48 rows, widened 45.8 / 47.2 / 50.8 ms (the GEMM also repacks the fresh weight every call).
constexpr int64_t kMaxStreamedRows = 32;
// Rows of x per pass over the weight (a multiple of kMaxXRows): 48 rows of SmolLM2's widest
// input (1,536 float32) are 295 KB, inside a core's L2.
constexpr int64_t kChunkRows = 48;

// 16 weights from w as float32 (exact for every type); the _masked forms read the first
// lanes of mask only.
inline __m512 widen(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
inline __m512 widen_masked(const int8_t* w, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w)));
}
inline __m512 widen(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 widen_masked(const float* w, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, w); }
// A bf16 is the top half of the float32 with the same bits.
inline __m512 bf16_bits_to_float(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 widen(const at::BFloat16* w) {
  return bf16_bits_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
inline __m512 widen_masked(const at::BFloat16* w, __mmask16 mask) {
  return bf16_bits_to_float(_mm256_maskz_loadu_epi16(mask, w));
}
inline __m512 widen(const at::Half* w) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))); }
inline __m512 widen_masked(const at::Half* w, __mmask16 mask) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w)); }

// out[m, r] = scale[r] * sum_k x[m, k] * w[r, k] (+ bias[r]) for MB rows of x and up to
// kWeightRows weight rows of type W (no scale: scale == nullptr), rounded once to the
// output's type T. out points at out[0, n0]; its rows are n_out apart.
template <int MB, typename W, typename T>
void dot_block(const float* x, int64_t K, const W* w, int rows, const float* scale,
               const float* bias, T* out, int64_t n_out) {
  __m512 acc[MB][kWeightRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kWeightRows; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    // The next block's weight rows, one block ahead: with the int8 -> float32 widening
    // between loads, the hardware prefetcher alone kept half the memory bandwidth idle.
    // (After the last block this points past the weight: a prefetch never faults.) One
    // prefetch per row and 64-byte line: every 64 int8, 32 bf16 or 16 float32 weights.
    if (((k * static_cast<int64_t>(sizeof(W))) & 63) == 0)
      for (int r = 0; r < kWeightRows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + kWeightRows) * K + k), _MM_HINT_T0);
    __m512 wv[kWeightRows];
    for (int r = 0; r < kWeightRows; ++r) wv[r] = r < rows ? widen(w + r * K + k) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < kWeightRows; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  if (k < K) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[kWeightRows];
    for (int r = 0; r < kWeightRows; ++r)
      wv[r] = r < rows ? widen_masked(w + r * K + k, tail) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * K + k);
      for (int r = 0; r < kWeightRows; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < rows; ++r) {
      const float sum = _mm512_reduce_add_ps(acc[m][r]);
      const float dot = scale ? sum * scale[r] : sum;
      out[m * n_out + r] = static_cast<T>(bias ? dot + bias[r] : dot);
    }
}

// Stores 16 float32 values as T, rounding to nearest even (the weights are finite).
inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store16(at::Half* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store16(at::BFloat16* dst, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// The weight widened to T in one pass: w[n, k] = qweight[n, k] * scale[n].
template <typename T>
void dequantize(const int8_t* W, const float* S, int64_t N, int64_t K, T* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const __m512 s = _mm512_set1_ps(S[n]);
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) store16(out + n * K + k, _mm512_mul_ps(widen(W + n * K + k), s));
      for (; k < K; ++k) out[n * K + k] = static_cast<T>(static_cast<float>(W[n * K + k]) * S[n]);
    }
  });
}

// O [M, N] = X [M, K] @ (W [N, K] * S [N])^T + B [N] (S, B: nullptr for none).
// Rows of X go in chunks of kChunkRows, each a pass over the whole weight: a chunk's rows stay
// in cache while the weight streams (a prefill chunk of 512 rows would not), and the weight is
// read once per chunk rather than once per kMaxXRows rows.
template <typename Wt, typename T>
void stream_rows(const float* X, int64_t M, int64_t K, const Wt* W, int64_t N, const float* S,
                 const float* B, T* O) {
  using Block = void (*)(const float*, int64_t, const Wt*, int, const float*, const float*, T*, int64_t);
  constexpr Block kBlocks[kMaxXRows] = {dot_block<1, Wt, T>, dot_block<2, Wt, T>, dot_block<3, Wt, T>,
                                        dot_block<4, Wt, T>, dot_block<5, Wt, T>, dot_block<6, Wt, T>};
  const int64_t blocks = (N + kWeightRows - 1) / kWeightRows;
  for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
    const int64_t c1 = std::min<int64_t>(M, c0 + kChunkRows);
    at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) {
        const int64_t n0 = block * kWeightRows;
        const int rows = static_cast<int>(std::min<int64_t>(kWeightRows, N - n0));
        for (int64_t m0 = c0; m0 < c1; m0 += kMaxXRows) {
          const int mb = static_cast<int>(std::min<int64_t>(kMaxXRows, c1 - m0));
          kBlocks[mb - 1](X + m0 * K, K, W + n0 * K, rows, S ? S + n0 : nullptr, B ? B + n0 : nullptr,
                          O + m0 * N + n0, N);
        }
      }
    });
  }
}

// The rows of x as float32: x itself, or widened (exactly) into ``buffer``. A torch conversion
// here (x.to(kFloat)) showed in the profiler at 0.25 ms a step over the 121 calls of a
// SmolLM2 decode step: 4% of a compiled one-row bf16 + int8 step (5.75 ms).
const float* rows_as_float(const at::Tensor& xc, std::vector<float>& buffer) {
  const float* X = nullptr;
  with_float_type(xc, "x", [&](auto tag) {
    using T = decltype(tag);
    const T* src = xc.data_ptr<T>();
    if constexpr (std::is_same_v<T, float>) {
      X = src;
    } else {
      buffer.resize(static_cast<size_t>(xc.numel()));
      for (int64_t i = 0; i < xc.numel(); ++i) buffer[i] = static_cast<float>(src[i]);
      X = buffer.data();
    }
  });
  return X;
}

at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t N) {
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "bias must have ", N, " values");
  return b;
}

at::Tensor int8_scaled_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x must be a 2-D CPU tensor");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be a contiguous 2-D int8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K, "x has ", K, " columns, qweight ", qweight.size(1));
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "scale must be ", N, " contiguous float32 values");
  const at::Tensor b = float_bias(bias, N);

  if (M > kMaxStreamedRows) {
    at::Tensor w = at::empty({N, K}, x.options());
    with_float_type(x, "x", [&](auto tag) {
      using T = decltype(tag);
      dequantize(qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), N, K, w.data_ptr<T>());
    });
    return at::linear(x, w, b.defined() ? c10::optional<at::Tensor>(b.to(x.scalar_type())) : c10::nullopt);
  }
  const at::Tensor xc = x.contiguous();
  std::vector<float> widened;
  const float* X = rows_as_float(xc, widened);
  const int8_t* W = qweight.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  const float* B = b.defined() ? b.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  with_float_type(x, "x", [&](auto tag) { stream_rows(X, M, K, W, N, S, B, out.data_ptr<decltype(tag)>()); });
  return out;
}

// x [M, K] @ weight [N, K]^T + bias through stream_rows, whatever M.
at::Tensor stream_float_weight(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x must be a 2-D CPU tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous 2-D tensor of x's dtype (", x.scalar_type(), "), not ",
              weight.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "x has ", K, " columns, weight ", weight.size(1));
  const at::Tensor b = float_bias(bias, N);
  const at::Tensor xc = x.contiguous();
  std::vector<float> widened;
  const float* X = rows_as_float(xc, widened);
  const float* B = b.defined() ? b.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  with_float_type(x, "x", [&](auto tag) {
    using T = decltype(tag);
    stream_rows(X, M, K, weight.data_ptr<T>(), N, nullptr, B, out.data_ptr<T>());
  });
  return out;
}

at::Tensor streamed_mm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (x.dim() == 2 && x.size(0) > kMaxStreamedRows) return at::linear(x, weight, bias);
  return stream_float_weight(x, weight, bias);
}

// The product for deterministic serving: every row streamed, however many there are, so each
// output element is the same FMA sequence whether its row came alone, in a decode batch of 64
// or in a prefill chunk (the GEMMs choose their blocking, and so their rounding, by M).
at::Tensor invariant_mm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return stream_float_weight(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("int8_scaled_mm(Tensor x, Tensor qweight, Tensor scale, Tensor? bias=None) -> Tensor");
  m.def("streamed_mm(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("invariant_mm(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh_cpu, CPU, m) {
  m.impl("int8_scaled_mm", int8_scaled_mm);
  m.impl("streamed_mm", streamed_mm);
  m.impl("invariant_mm", invariant_mm);
}
