// A speculative diffusion round's work after its verify call, on a CPU in one call, for an affine chain's full round
// (specray/methods/diffusion/cpu_commit.py): the log ratios (round_ratios), the verdict (token_verdict or
// block_verdict), the cut rows' new states (residual_states or reflected_states), the kept rows' last drafted states,
// the Free drafter's eps and the rows' next steps. In Python these are some 40 torch operations and calls, about
// 0.2 ms a round at batch 1. It calls the same kernels on the same inputs as loop.py's _commit_tensors, and its own
// work is copies and integer arithmetic (and the cast of a new state to the state's dtype, rounded as torch rounds
// it), so the values are theirs; cpu_commit.py still compares it with that path before using it.
#include "kernels.h"

#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

bool is_state(const at::Tensor& t) {
  return t.device().is_cpu() && t.is_contiguous() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

// Row i's slot j of t [n, slots, E...] (contiguous), copied into row r of out [rows, E...] of the same dtype.
void copy_slot(at::Tensor& out, int64_t r, const at::Tensor& t, int64_t i, int64_t j, int64_t slots, int64_t E) {
  const int64_t bytes = E * t.element_size();
  std::memcpy(static_cast<char*>(out.data_ptr()) + r * bytes,
              static_cast<const char*>(t.data_ptr()) + (i * slots + j) * bytes, bytes);
}

}  // namespace

// See kernels.h.
std::vector<at::Tensor> round_commit(const at::Tensor& coef_in, const at::Tensor& eps_draft, const at::Tensor& E,
                                     const at::Tensor& xi, const at::Tensor& eta, const at::Tensor& Y,
                                     const at::Tensor& kk, const at::Tensor& g, bool block,
                                     const std::optional<at::Tensor>& u, const std::optional<at::Tensor>& zeta,
                                     bool alpha_one, bool with_stale, const at::Tensor& constants, double delta_min) {
  if (!is_state(E) || !is_state(Y) || Y.scalar_type() != E.scalar_type() || E.dim() < 3 || Y.dim() != E.dim() ||
      !on_cpu({&kk, &g}, at::kLong) || !kk.is_contiguous() || !g.is_contiguous() || !xi.is_contiguous() ||
      u.has_value() != zeta.has_value())
    return {};
  const int64_t n = E.size(0), G = E.size(1);
  if (n == 0 || G == 0 || Y.size(0) != n || Y.size(1) != G + 1 || kk.numel() != n || g.numel() != n) return {};
  const int64_t elements = E.numel() / (n * G);
  if (Y.numel() != n * (G + 1) * elements) return {};
  if (u.has_value() && (!on_cpu({&*u, &*zeta}, at::kDouble) || !u->is_contiguous() || !zeta->is_contiguous() ||
                        u->numel() != n * G || zeta->numel() != n * G * elements))
    return {};
  const int64_t* gg = g.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (gg[i] != G) return {};  // a full round: every row drafts every slot
  }
  auto [Delta, log_rho, delta] = round_ratios(coef_in, eps_draft, E, xi);
  if (!Delta.defined()) return {};
  at::Tensor tau, log_alpha, expected;
  if (block) {
    at::Tensor h;
    std::tie(tau, log_alpha, expected, h) = block_verdict(log_rho, delta, g, eta, constants, delta_min);
  } else {
    std::tie(tau, log_alpha, expected) = token_verdict(log_rho, delta, g, eta, delta_min);
  }
  if (!tau.defined()) return {};
  const int64_t* t = tau.data_ptr<int64_t>();

  // The cut rows' new states, from slot tau of the round's tensors (a residual draw, or the rejected draft reflected).
  std::vector<int64_t> cut;
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] < gg[i]) cut.push_back(i);
  }
  const int64_t r = static_cast<int64_t>(cut.size());
  std::vector<int64_t> row_shape(E.sizes().begin() + 2, E.sizes().end());
  row_shape.insert(row_shape.begin(), n);
  at::Tensor x_new = at::empty(row_shape, E.options());
  for (int64_t i = 0; i < n; ++i) copy_slot(x_new, i, Y, i, G, G + 1, elements);
  if (r > 0) {
    row_shape[0] = r;
    const at::Tensor coef = coef_in.contiguous();  // [3, n, G, 1...]: A, B, sigma per row and slot
    if (coef.numel() != 3 * n * G || coef.scalar_type() != at::kDouble) return {};
    at::Tensor x = at::empty(row_shape, E.options()), eps = at::empty(row_shape, E.options());
    at::Tensor D = at::empty(row_shape, Delta.options()), noise = at::empty(row_shape, Delta.options());
    at::Tensor coef_cut = at::empty({3, r}, Delta.options());
    at::Tensor la = at::zeros({r}, Delta.options()), uu = at::empty({r}, Delta.options());
    const double* c = coef.data_ptr<double>();
    double* cc = coef_cut.data_ptr<double>();
    for (int64_t q = 0; q < r; ++q) {
      const int64_t i = cut[q], j = t[i];
      copy_slot(x, q, Y, i, j, G + 1, elements);
      copy_slot(eps, q, E, i, j, G, elements);
      copy_slot(D, q, Delta, i, j, G, elements);
      for (int64_t a = 0; a < 3; ++a) cc[a * r + q] = c[(a * n + i) * G + j];
      if (u.has_value()) {
        copy_slot(noise, q, *zeta, i, j, G, elements);
        uu.data_ptr<double>()[q] = u->data_ptr<double>()[i * G + j];
        if (!alpha_one) la.data_ptr<double>()[q] = log_alpha.data_ptr<double>()[i];
      } else {
        copy_slot(noise, q, xi, i, j, G, elements);
      }
    }
    const at::Tensor y = u.has_value() ? residual_states(x, eps, coef_cut, D, la, uu, noise, constants, delta_min)
                                       : reflected_states(x, eps, coef_cut, D, noise, delta_min);
    if (!y.defined()) return {};
    const double* yy = y.data_ptr<double>();
    for (int64_t q = 0; q < r; ++q) {
      const int64_t at_ = cut[q] * elements;
      if (E.scalar_type() == at::kFloat) {
        float* out = x_new.data_ptr<float>() + at_;
        for (int64_t e = 0; e < elements; ++e) out[e] = static_cast<float>(yy[q * elements + e]);
      } else {
        std::memcpy(x_new.data_ptr<double>() + at_, yy + q * elements, elements * sizeof(double));
      }
    }
  }

  // The Free drafter's eps (the target eps of the state before the new one) and the rows' next steps.
  at::Tensor stale, k_new = at::empty({n}, kk.options());
  if (with_stale) {
    row_shape[0] = n;
    stale = at::empty(row_shape, E.options());
    for (int64_t i = 0; i < n; ++i) copy_slot(stale, i, E, i, t[i] < gg[i] ? t[i] : gg[i] - 1, G, elements);
  }
  const int64_t* k = kk.data_ptr<int64_t>();
  int64_t* kn = k_new.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) kn[i] = k[i] + (t[i] < gg[i] ? t[i] + 1 : gg[i]);
  return {x_new, stale, k_new, tau, expected};
}
