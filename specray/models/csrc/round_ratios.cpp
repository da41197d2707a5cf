// A speculative diffusion round's log density ratios on a CPU in one call, for an affine chain's full round
// (specray/methods/diffusion/cpu_ratios.py): Delta = B (eps_draft - eps_target) / sigma per slot, then rules.py's
// log_ratio, log rho = -<Delta, xi> - |Delta|^2 / 2 and delta = |Delta|. There they are some 15 torch operations, a
// few microseconds of dispatch each at batch 1. Every elementwise product, difference and quotient rounds once as in
// the Python path (built with -ffp-contract=off: nothing fuses); the two row sums and the square root are torch's own
// operations on tensors of the Python path's shapes, so the values are torch's by construction. cpu_ratios.py still
// compares the kernel with the Python path before using it.
#include "kernels.h"

#include <ATen/ops/sqrt.h>
#include <ATen/ops/sum.h>

#include <cstdint>
#include <tuple>

namespace {

template <typename Eps>
void scaled_gaps(double* Delta, double* squares, double* products, const double* coef, const double* eps_draft,
                 bool one_draft, const Eps* eps_target, const double* xi, int64_t n, int64_t G, int64_t elements) {
  const double* B = coef + n * G;  // coef [3, n, G]: A, B, sigma
  const double* sigma = coef + 2 * n * G;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < G; ++j) {
      const int64_t slot = i * G + j;
      const double* draft = eps_draft + (one_draft ? i : slot) * elements;  // the fixed drafters' one eps per row
      for (int64_t e = 0; e < elements; ++e) {
        const int64_t at = slot * elements + e;
        const double d = (B[slot] * (draft[e] - static_cast<double>(eps_target[at]))) / sigma[slot];
        Delta[at] = d;
        squares[at] = d * d;
        products[at] = d * xi[at];
      }
    }
  }
}

}  // namespace

// See kernels.h.
std::tuple<at::Tensor, at::Tensor, at::Tensor> round_ratios(const at::Tensor& coef_in, const at::Tensor& eps_draft_in,
                                                            const at::Tensor& eps_target_in, const at::Tensor& xi_in) {
  if (!on_cpu({&coef_in, &eps_draft_in, &xi_in}, at::kDouble) || !eps_target_in.device().is_cpu() ||
      (eps_target_in.scalar_type() != at::kFloat && eps_target_in.scalar_type() != at::kDouble) ||
      coef_in.dim() < 3 || eps_target_in.dim() < 3 || xi_in.sizes() != eps_target_in.sizes() ||
      eps_draft_in.dim() != eps_target_in.dim()) {
    return {};
  }
  // A Free drafter's first round drafts from a column of the target eps: a strided view (copied here, the same values)
  const at::Tensor coef = coef_in.contiguous(), eps_draft = eps_draft_in.contiguous();
  const at::Tensor eps_target = eps_target_in.contiguous(), xi = xi_in.contiguous();
  const int64_t n = eps_target.size(0), G = eps_target.size(1);
  if (coef.size(0) != 3 || coef.size(1) != n || coef.size(2) != G || coef.numel() != 3 * n * G ||
      eps_draft.size(0) != n || (eps_draft.size(1) != 1 && eps_draft.size(1) != G)) {
    return {};
  }
  for (int64_t d = 2; d < eps_target.dim(); ++d) {
    if (eps_draft.size(d) != eps_target.size(d)) return {};
  }
  const int64_t elements = n * G == 0 ? 0 : eps_target.numel() / (n * G);
  const auto doubles = coef.options();
  at::Tensor Delta = at::empty(eps_target.sizes(), doubles);
  at::Tensor squares = at::empty({n, G, elements}, doubles), products = at::empty({n, G, elements}, doubles);
  const bool one_draft = eps_draft.size(1) == 1 && G != 1;
  if (eps_target.scalar_type() == at::kFloat) {
    scaled_gaps(Delta.data_ptr<double>(), squares.data_ptr<double>(), products.data_ptr<double>(),
                coef.data_ptr<double>(), eps_draft.data_ptr<double>(), one_draft, eps_target.data_ptr<float>(),
                xi.data_ptr<double>(), n, G, elements);
  } else {
    scaled_gaps(Delta.data_ptr<double>(), squares.data_ptr<double>(), products.data_ptr<double>(),
                coef.data_ptr<double>(), eps_draft.data_ptr<double>(), one_draft, eps_target.data_ptr<double>(),
                xi.data_ptr<double>(), n, G, elements);
  }
  const at::Tensor sq = at::sum(squares, 2);  // as (D * D).sum(dim=2)
  const at::Tensor dots = at::sum(products, 2);  // as (D * X).sum(dim=2)
  at::Tensor log_rho = at::empty({n, G}, doubles);
  const double* s = sq.data_ptr<double>();
  const double* dot = dots.data_ptr<double>();
  double* out = log_rho.data_ptr<double>();
  for (int64_t k = 0; k < n * G; ++k) out[k] = -dot[k] - 0.5 * s[k];
  return {Delta, log_rho, at::sqrt(sq)};
}
