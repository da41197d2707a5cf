// The verdicts of a diffusion round's token and block verification (specray/methods/diffusion/rules.py) on a CPU,
// one call each: element by element with the tensor paths' arithmetic and torch's transcendental routines
// (gaussian_math.h). The operations whose values depend on the tensor's shape run as torch operations on the
// tensor paths' shapes: sigmoid (its vector and scalar kernels differ) on [n, G], and the sums over a row. rules.py
// compares each kernel with its tensor path before using it.
#include "kernels.h"
#include "gaussian_math.h"

#include <ATen/ops/sigmoid.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <limits>

using namespace gaussian_math;

namespace {

bool serves(const at::Tensor& log_rho, const at::Tensor& delta, const at::Tensor& g, const at::Tensor& eta) {
  if (!routines_found() || log_rho.dim() != 2) return false;
  const int64_t n = log_rho.size(0), G = log_rho.size(1);
  for (const at::Tensor* t : {&log_rho, &delta, &eta}) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kDouble || !t->is_contiguous() || t->dim() != 2 ||
        t->size(0) != n || t->size(1) != G)
      return false;
  }
  if (!g.device().is_cpu() || g.scalar_type() != at::kLong || !g.is_contiguous() || g.numel() != n) return false;
  const int64_t* gg = g.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (gg[i] < 0 || gg[i] > G) return false;  // the tensor path's index h[rows, g] would fail
  }
  return true;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_verdict(const at::Tensor& log_rho, const at::Tensor& delta,
                                                             const at::Tensor& g, const at::Tensor& eta,
                                                             double delta_min) {
  if (!serves(log_rho, delta, g, eta)) return std::make_tuple(at::Tensor(), at::Tensor(), at::Tensor());
  const int64_t n = log_rho.size(0), G = log_rho.size(1);
  const int64_t* gg = g.data_ptr<int64_t>();
  const double* lr = log_rho.data_ptr<double>();
  const double* dl = delta.data_ptr<double>();
  const double* coins = eta.data_ptr<double>();
  at::Tensor tau = at::empty({n}, g.options());
  at::Tensor weights = at::empty({n, G}, log_rho.options());
  int64_t* t = tau.data_ptr<int64_t>();
  double* w = weights.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    int64_t accepted = 0;
    bool run = true;  // the drafted slots form a prefix: tau is its accepted run
    double log_v = 0.0;  // torch's cumsum: a running sum from zero
    double v_prev = 1.0;
    for (int64_t j = 0; j < G; ++j) {
      const int64_t e = i * G + j;
      const bool valid = j < gg[i];
      const double r = dl[e] <= delta_min ? 0.0 : lr[e];  // identical kernels
      run = run && valid && log_(coins[e]) <= r;
      accepted += run;
      w[e] = valid ? v_prev : 0.0;
      log_v += valid ? clamp_max(r, 0.0) : 0.0;
      v_prev = exp_(log_v);
    }
    t[i] = accepted;
  }
  return std::make_tuple(tau, at::zeros({n}, log_rho.options()), at::sum(weights, 1));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_verdict(const at::Tensor& log_rho,
                                                                         const at::Tensor& delta, const at::Tensor& g,
                                                                         const at::Tensor& eta,
                                                                         const at::Tensor& constants, double delta_min) {
  if (!serves(log_rho, delta, g, eta) || !constants.device().is_cpu() || constants.scalar_type() != at::kDouble ||
      constants.numel() != 4 || !constants.is_contiguous())
    return std::make_tuple(at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor());
  const int64_t n = log_rho.size(0), G = log_rho.size(1);
  const int64_t* gg = g.data_ptr<int64_t>();
  const double* c = constants.data_ptr<double>();
  const Constants k{c[0], c[1], c[2], c[3]};
  const double* lr = log_rho.data_ptr<double>();
  const double* dl = delta.data_ptr<double>();
  const double* coins = eta.data_ptr<double>();

  at::Tensor log_w = at::empty({n, G + 1}, log_rho.options());
  at::Tensor odds = at::empty({n, G}, log_rho.options());
  at::Tensor weights = at::empty({n, G}, log_rho.options());
  double* lw = log_w.data_ptr<double>();
  double* od = odds.data_ptr<double>();
  double* w = weights.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    double* row_w = lw + i * (G + 1);
    row_w[0] = 0.0;
    for (int64_t j = 0; j < G; ++j) {
      const int64_t e = i * G + j;
      const bool tiny = dl[e] <= delta_min;
      const double r = j < gg[i] ? (tiny ? 0.0 : lr[e]) : 0.0;  // past g, log rho = 0 keeps w
      const double sum = row_w[j] + r;
      row_w[j + 1] = sum > 0.0 ? 0.0 : sum;  // torch.clamp(max=0): NaN and -0.0 kept
      const double x = row_w[j];
      const double cc = dl[e] / 2 + x / dl[e];
      const double log_R = tiny ? -std::numeric_limits<double>::infinity() : log_G_at(k, cc + 0.0, 0.0, dl[e], x);
      od[e] = log_R - log1mexp(k, clamp_max(x, -1e-300));
      w[e] = j < gg[i] ? exp_(x) : 0.0;
    }
  }
  at::sigmoid_(odds);  // the tensor path's shape and layout: [n, G], contiguous

  at::Tensor tau = at::empty({n}, g.options());
  at::Tensor log_alpha = at::empty({n}, log_rho.options());
  at::Tensor h = at::empty({n, G + 1}, log_rho.options());
  int64_t* t = tau.data_ptr<int64_t>();
  double* la = log_alpha.data_ptr<double>();
  double* hh = h.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    const double* row_w = lw + i * (G + 1);
    double* row_h = hh + i * (G + 1);
    for (int64_t j = 0; j < G; ++j) row_h[j] = j < gg[i] ? (row_w[j] >= 0 ? 1.0 : od[i * G + j]) : 0.0;
    row_h[G] = 0.0;
    row_h[gg[i]] = exp_(row_w[gg[i]]);
    int64_t cut = 0;  // the last index passing its coin (coin 0 is 0: index 0 always passes)
    for (int64_t j = 1; j <= gg[i]; ++j) {
      if (coins[i * G + j - 1] <= row_h[j]) cut = j;
    }
    t[i] = cut;
    la[i] = cut < gg[i] ? row_w[cut] : 0.0;
  }
  return std::make_tuple(tau, log_alpha, at::sum(weights, 1), h);
}
