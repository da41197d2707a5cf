// The arithmetic the round kernels share (rounds.cpp, tree_rounds.cpp): torch's float64 sum over a row, the
// regular-law test, the inverse-CDF draw, normalising, the pass probability, the [x]_+ clamp and LANTERN's
// relaxed mass; each with the values of the torch operations it stands for.
//
// Every step rounds once whatever the order, but the float64 sums that normalise P, Q and the next token's law
// (and block's residual masses). Those follow torch's CPU sum over a contiguous last dimension (SumKernel.cpp's
// cascade sum) for rows of 4 to 255 doubles, 4 lanes to a vector: vector j of the row goes to accumulator j % 4
// (from zero) for the first 4 * (V / 4) of its V vectors, the rest to accumulator 0; then ((a0 + a1) + a2) + a3;
// then one scalar running sum from zero over the doubles past the last whole vector, then over the 4 lanes in
// order. torch's cumsum is one running sum (the draws' running sums, LANTERN's neighbour masses).
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>

namespace round_math {

constexpr int64_t kLanes = 4;      // doubles to an AVX2 vector
constexpr int64_t kMinWidth = 4;   // below one vector torch sums the row as scalars in another order
constexpr int64_t kMaxWidth = 256; // from 64 vectors on the cascade sum adds in levels, not written out here

inline double torch_sum(const double* x, int64_t n) {
  const int64_t vectors = n / kLanes, paired = 4 * (vectors / 4);
  double acc[4][kLanes] = {};
  for (int64_t j = 0; j < vectors; ++j) {
    double* a = acc[j < paired ? j % 4 : 0];
    for (int64_t l = 0; l < kLanes; ++l) a[l] += x[j * kLanes + l];
  }
  double sum = 0.0;
  for (int64_t k = vectors * kLanes; k < n; ++k) sum += x[k];
  for (int64_t l = 0; l < kLanes; ++l) sum += ((acc[0][l] + acc[1][l]) + acc[2][l]) + acc[3][l];
  return sum;
}

// Whether a law's entries are finite and not negative: the kernels serve only such laws. torch's operations give
// tokens for the others too (NaN passes through its sums, minima and comparisons in its own ways, and a
// binary search over running sums that are not sorted lands elsewhere than a linear one), so those go to torch.
template <typename T>
bool regular(const T* p, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    if (!(p[k] >= 0) || !std::isfinite(static_cast<double>(p[k]))) return false;
  }
  return true;
}

// rng.sample_from_cdf on the running sums of a regular law `p`: searchsorted(cdf, u * cdf[-1], right=True), at most
// n - 1. The test is searchsorted's, !(cdf > target), so that a NaN uniform gives n - 1 as there.
template <typename T>
int64_t draw(const T* p, int64_t n, double u) {
  double cdf[kMaxWidth];
  double running = 0.0;
  for (int64_t k = 0; k < n; ++k) cdf[k] = running += static_cast<double>(p[k]);
  const double target = u * cdf[n - 1];
  int64_t k = 0;
  while (k < n - 1 && !(cdf[k] > target)) ++k;
  return k;
}

// Every row of a contiguous [rows, n] float32 law is regular and has mass (so that its normalised law is finite).
inline bool regular_rows(const at::Tensor& laws) {
  const int64_t n = laws.size(-1), rows = n > 0 ? laws.numel() / n : 0;
  const float* x = laws.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r, x += n) {
    if (!regular(x, n)) return false;
    bool mass = false;
    for (int64_t k = 0; k < n && !mass; ++k) mass = x[k] > 0.0f;
    if (!mass) return false;
  }
  return true;
}

// rules.normalise of one row: float64, divided by its torch sum.
inline void normalised(const float* p, int64_t n, double* out) {
  for (int64_t k = 0; k < n; ++k) out[k] = static_cast<double>(p[k]);
  const double total = torch_sum(out, n);
  for (int64_t k = 0; k < n; ++k) out[k] /= total;
}

// rules._ratio_prob: min(1, numerator / q), q = 0 passing iff numerator > 0.
inline double pass_probability(double numerator, double q) {
  if (!(q > 0.0)) return numerator > 0.0 ? 1.0 : 0.0;
  const double ratio = numerator / q;
  return ratio > 1.0 ? 1.0 : ratio;
}

// max(x, 0) as clamp(min=0) gives it; whether any entry kept mass.
inline bool clamp_positive(double* x, int64_t n) {
  bool mass = false;
  for (int64_t k = 0; k < n; ++k) {
    x[k] = x[k] > 0.0 ? x[k] : 0.0;
    mass = mass || x[k] > 0.0;
  }
  return mass;
}

// LANTERN's relaxed mass of token x under the normalised law p (lantern._mass_from_neighbour_values): p(x) plus
// the running sum of its first k neighbours' masses as far as it stays within the budget, (lam - 1) p(x) or delta.
struct Relaxation {
  const int64_t* neighbours;  // [V, columns], nearest first
  int64_t columns, k;
  bool lambda_mode, forbid_zero_target_mass;
  double lam_minus_one, delta;

  double operator()(const double* p, int64_t x) const {
    const double own = p[x];
    if (k == 0) return own;
    const double budget = lambda_mode ? lam_minus_one * own : delta;
    const int64_t* ids = neighbours + x * columns;
    double running = 0.0, taken = 0.0;
    bool any = false;
    for (int64_t m = 0; m < k; ++m) {
      running += p[ids[m]];
      if (running <= budget) {
        taken = running;
        any = true;
      }
    }
    const double relaxed = own + (any ? taken : 0.0);
    return forbid_zero_target_mass && !(own > 0.0) ? 0.0 : relaxed;
  }
};

}  // namespace round_math
