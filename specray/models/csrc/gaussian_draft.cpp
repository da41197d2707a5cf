// The states a speculative diffusion round drafts with a fixed eps (the Frozen and Free drafters of
// specray/methods/diffusion/loop.py on an affine chain), on a CPU in one call: y_{j+1} = A_j y_j + B_j eps +
// sigma_j xi_j in float64, rounded to the state's dtype after every step. Each product and sum rounds once, in
// the order of torch's elementwise operations in specray/methods/diffusion/cpu_draft.py (built with
// -ffp-contract=off: nothing fuses), so the values are torch's; there they are ~40 operations of a few
// microseconds of dispatch each at batch 1. cpu_draft.py compares the kernel with torch's operations before
// using it.
#include "kernels.h"

#include <cstdint>

namespace {

template <typename State>
void draft(State* Y, const State* y0, const double* coef, const double* eps, const double* xi, int64_t n, int64_t G,
           int64_t E) {
  const double* A = coef;  // coef [3, n, G]: A, B, sigma per row and slot
  const double* B = coef + n * G;
  const double* sigma = coef + 2 * n * G;
  for (int64_t i = 0; i < n; ++i) {
    State* row = Y + i * (G + 1) * E;  // Y [n, G + 1, E]: slot 0 is y0
    const double* row_eps = eps + i * E;
    for (int64_t e = 0; e < E; ++e) row[e] = y0[i * E + e];
    for (int64_t j = 0; j < G; ++j) {
      const double a = A[i * G + j], b = B[i * G + j], s = sigma[i * G + j];
      const State* y = row + j * E;
      State* next = row + (j + 1) * E;
      const double* noise = xi + (i * G + j) * E;
      for (int64_t e = 0; e < E; ++e) {
        const double drift = b * row_eps[e];
        const double mean = a * static_cast<double>(y[e]) + drift;
        next[e] = static_cast<State>(mean + s * noise[e]);
      }
    }
  }
}

}  // namespace

bool draft_affine(at::Tensor& Y, const at::Tensor& y0, const at::Tensor& coef, const at::Tensor& eps,
                  const at::Tensor& xi) {
  if (y0.dim() < 1 || coef.dim() < 3) return false;
  const int64_t n = y0.size(0), G = coef.size(2);
  const int64_t E = n > 0 ? y0.numel() / n : 0;
  const bool cpu = Y.device().is_cpu() && y0.device().is_cpu() && coef.device().is_cpu() && eps.device().is_cpu() &&
                   xi.device().is_cpu();
  const auto state = y0.scalar_type();
  const bool types = (state == at::kFloat || state == at::kDouble) && Y.scalar_type() == state &&
                     coef.scalar_type() == at::kDouble && eps.scalar_type() == at::kDouble &&
                     xi.scalar_type() == at::kDouble;
  const bool shapes = n > 0 && G > 0 && coef.size(0) == 3 && coef.size(1) == n && coef.numel() == 3 * n * G &&
                      Y.numel() == n * (G + 1) * E && eps.numel() == n * E && xi.numel() == n * G * E;
  const bool dense = Y.is_contiguous() && y0.is_contiguous() && coef.is_contiguous() && eps.is_contiguous() &&
                     xi.is_contiguous();
  if (!cpu || !types || !shapes || !dense) return false;
  if (state == at::kFloat) {
    draft(Y.data_ptr<float>(), y0.data_ptr<float>(), coef.data_ptr<double>(), eps.data_ptr<double>(),
          xi.data_ptr<double>(), n, G, E);
  } else {
    draft(Y.data_ptr<double>(), y0.data_ptr<double>(), coef.data_ptr<double>(), eps.data_ptr<double>(),
          xi.data_ptr<double>(), n, G, E);
  }
  return true;
}
