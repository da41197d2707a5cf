// The states a speculative diffusion round drafts with a fixed eps (the Frozen and Free drafters of
// specray/methods/diffusion/loop.py on an affine chain), on a CPU in one call: y_{j+1} = A_j y_j + B_j eps +
// sigma_j xi_j in float64, rounded to the state's dtype after every step. Each product and sum rounds once, in
// the order of torch's elementwise operations in specray/methods/diffusion/cpu_draft.py (built with
// -ffp-contract=off: nothing fuses), so the values are torch's; there they are ~40 operations of a few
// microseconds of dispatch each at batch 1. draft_step makes one such step where a draft model gives each slot's
// eps, between the model's calls, in the same order. cpu_draft.py compares each kernel with torch's operations before
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

namespace {

template <typename State, typename Eps>
void step(State* S, int64_t j, const double* coef, const Eps* eps, const double* xi, int64_t n, int64_t G,
          int64_t E) {
  const State* y = S + j * n * E;  // S [G + 1, n, E]: slot-major, slot j drafted, slot j + 1 written
  State* next = S + (j + 1) * n * E;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = i * G + j;  // coef [3, n, G], xi [n, G, E]
    const double a = coef[slot], b = coef[n * G + slot], s = coef[2 * n * G + slot];
    for (int64_t e = 0; e < E; ++e) {
      const double mean = a * static_cast<double>(y[i * E + e]) + b * static_cast<double>(eps[i * E + e]);
      next[i * E + e] = static_cast<State>(mean + s * xi[slot * E + e]);
    }
  }
}

}  // namespace

bool draft_step(at::Tensor& S, int64_t j, const at::Tensor& coef, const at::Tensor& eps, const at::Tensor& xi) {
  if (S.dim() < 2 || coef.dim() < 3) return false;
  const int64_t slots = S.size(0), n = S.size(1), G = coef.size(2);
  const int64_t E = n > 0 ? S.numel() / (slots * n) : 0;
  const auto state = S.scalar_type();
  const bool cpu = S.device().is_cpu() && coef.device().is_cpu() && eps.device().is_cpu() && xi.device().is_cpu();
  const bool types = (state == at::kFloat || state == at::kDouble) && coef.scalar_type() == at::kDouble &&
                     (eps.scalar_type() == state || eps.scalar_type() == at::kDouble) &&
                     xi.scalar_type() == at::kDouble;
  const bool shapes = n > 0 && G > 0 && slots == G + 1 && j >= 0 && j < G && coef.size(0) == 3 &&
                      coef.size(1) == n && coef.numel() == 3 * n * G && eps.numel() == n * E &&
                      xi.numel() == n * G * E;
  const bool dense = S.is_contiguous() && coef.is_contiguous() && eps.is_contiguous() && xi.is_contiguous();
  if (!cpu || !types || !shapes || !dense) return false;
  const double* c = coef.data_ptr<double>();
  const double* x = xi.data_ptr<double>();
  if (state == at::kFloat) {
    if (eps.scalar_type() == at::kFloat) {
      step(S.data_ptr<float>(), j, c, eps.data_ptr<float>(), x, n, G, E);
    } else {
      step(S.data_ptr<float>(), j, c, eps.data_ptr<double>(), x, n, G, E);
    }
  } else {
    step(S.data_ptr<double>(), j, c, eps.data_ptr<double>(), x, n, G, E);
  }
  return true;
}
