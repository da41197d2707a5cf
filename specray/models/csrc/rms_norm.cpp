// RMSNorm of float32 rows on a CPU in one pass, with the values of the five torch operations that
// discrete_ar.RMSNorm runs in CPU inference (a few microseconds of dispatch each, most of a norm at batch 1):
//   scale = rsqrt(sum(x * x, -1) / D + eps);  out = (x * scale) * weight
// Every step but the sum rounds once, whatever the order. The sum follows torch's CPU sum over a contiguous
// last dimension (SumKernel.cpp's cascade sum) for rows of fewer than 512 floats, 8 lanes to a vector:
// vector j of the row goes to accumulator j % 4 (from zero) for the first 4 * (V / 4) of its V vectors, the
// rest to accumulator 0; then ((a0 + a1) + a2) + a3; then one scalar running sum from zero over the floats
// past the last whole vector, then over the 8 lanes in order. Rows of whole vectors go 8 at a time: their
// lane totals transposed, so that the 8 running sums, the division, the root and the reciprocal run as
// vector operations (the same operations, each exactly rounded). specray/models/cpu_norm.py compares the
// kernel with torch's operations before using it.
#include "kernels.h"
#include "transpose8.h"

#include <immintrin.h>

#include <cmath>

namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kMaxDim = 512;  // from 64 vectors on the cascade sum adds in levels, not written out here
// Below one vector torch sums the row as scalars in another order: such rows are not served.

inline __m256 squared(const float* x) {
  const __m256 v = _mm256_loadu_ps(x);
  return _mm256_mul_ps(v, v);
}

// The four accumulators of a row of `vectors` whole vectors, combined: ((a0 + a1) + a2) + a3, lane by lane.
__m256 lane_totals(const float* x, int64_t vectors) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 4 <= vectors; j += 4) {
    a0 = _mm256_add_ps(a0, squared(x + j * kLanes));
    a1 = _mm256_add_ps(a1, squared(x + (j + 1) * kLanes));
    a2 = _mm256_add_ps(a2, squared(x + (j + 2) * kLanes));
    a3 = _mm256_add_ps(a3, squared(x + (j + 3) * kLanes));
  }
  for (; j < vectors; ++j) a0 = _mm256_add_ps(a0, squared(x + j * kLanes));
  return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), a2), a3);
}

void scale_row(const float* x, const float* w, float scale, int64_t dim, float* out) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t k = 0;
  for (; k + kLanes <= dim; k += kLanes) {
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), s), _mm256_loadu_ps(w + k)));
  }
  for (; k < dim; ++k) out[k] = (x[k] * scale) * w[k];
}

// One row, any width the kernel serves.
void norm_row(const float* x, const float* w, int64_t dim, float count, float eps, float* out) {
  const int64_t vectors = dim / kLanes;
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, lane_totals(x, vectors));
  float sum = 0.0f;
  for (int64_t k = vectors * kLanes; k < dim; ++k) sum += x[k] * x[k];
  for (int64_t k = 0; k < kLanes; ++k) sum += lanes[k];
  scale_row(x, w, 1.0f / std::sqrt(sum / count + eps), dim, out);
}

// Eight rows of whole vectors: row r's running sum over its lanes is lane r of `sum`.
void norm_rows8(const float* x, const float* w, int64_t dim, float count, float eps, float* out) {
  const int64_t vectors = dim / kLanes;
  __m256 totals[kLanes];
  for (int64_t r = 0; r < kLanes; ++r) totals[r] = lane_totals(x + r * dim, vectors);
  transpose8(totals);  // totals[k]: lane k of each row
  __m256 sum = _mm256_setzero_ps();
  for (int64_t k = 0; k < kLanes; ++k) sum = _mm256_add_ps(sum, totals[k]);
  const __m256 mean = _mm256_add_ps(_mm256_div_ps(sum, _mm256_set1_ps(count)), _mm256_set1_ps(eps));
  alignas(32) float scales[kLanes];
  _mm256_store_ps(scales, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(mean)));
  for (int64_t r = 0; r < kLanes; ++r) scale_row(x + r * dim, w, scales[r], dim, out + r * dim);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.dim() < 1 ||
      !weight.device().is_cpu() || weight.scalar_type() != at::kFloat || !weight.is_contiguous() ||
      weight.dim() != 1 || weight.size(0) != x.size(-1) || x.size(-1) < kLanes || x.size(-1) >= kMaxDim) {
    return at::Tensor();
  }
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  at::Tensor out = at::empty_like(x);
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const float count = static_cast<float>(dim), epsilon = static_cast<float>(eps);
  int64_t r = 0;
  if (dim % kLanes == 0) {
    for (; r + kLanes <= rows; r += kLanes) norm_rows8(in + r * dim, w, dim, count, epsilon, dst + r * dim);
  }
  for (; r < rows; ++r) norm_row(in + r * dim, w, dim, count, epsilon, dst + r * dim);
  return out;
}
