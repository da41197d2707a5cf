// The residual sampler's draws (specray/methods/diffusion/residual.py) with the Python path's arithmetic and torch's
// transcendental routines (gaussian_math.h): psi_draws, the 1-D draw s ~ psi_alpha(.; delta) (the Newton solve of
// _sample_psi_one_row) row by row in one call, and residual_states, a diffusion round's resampled states (the
// affine chain's mean of loop._mean, then sample_residual) in one call, the two row sums (the norm of Delta and
// <z, e>) as torch operations on the Python path's shapes. residual.py and loop.py compare each kernel with the
// Python path before using it.
#include "kernels.h"
#include "gaussian_math.h"

#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/sum.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using namespace gaussian_math;

constexpr int kNewtonSteps = 16;  // residual.NEWTON_STEPS

struct State {
  double v, lo, hi;
};

std::array<uint64_t, 3> bits(const State& s) {
  std::array<uint64_t, 3> out;
  std::memcpy(&out[0], &s.v, 8);
  std::memcpy(&out[1], &s.lo, 8);
  std::memcpy(&out[2], &s.hi, 8);
  return out;
}

State newton_step(const Constants& k, State st, double c, double delta, double log_alpha, double target,
                  bool check_finite) {
  const double s = c + st.v;
  const double log_g = log_G_at(k, s, st.v, delta, log_alpha);
  const double f = log_g - target;
  if (f > 0.0) {
    st.hi = st.v;
  } else {
    st.lo = st.v;
  }
  const double log_dg = (log_alpha - 0.5 * s * s) - k.half_log_2pi + log1mexp(k, clamp_max(delta * st.v, -1e-300));
  const double v_new = st.v - f * exp_(log_g - log_dg);
  if (st.lo <= v_new && v_new <= st.hi && (!check_finite || std::isfinite(v_new))) return {v_new, st.lo, st.hi};
  return {0.5 * (st.lo + st.hi), st.lo, st.hi};
}

// _newton_one_row: the same steps, the same early stop on a recurring state (v unchanged, or a period of 2).
double newton(const Constants& k, double lo, double hi, double c, double delta, double log_alpha, double target) {
  State states[kNewtonSteps + 1];
  std::array<uint64_t, 3> keys[kNewtonSteps + 1];
  states[0] = {lo, lo, hi};
  keys[0] = bits(states[0]);
  const bool check_finite = !(lo >= -1e307);
  for (int i = 0; i < kNewtonSteps; ++i) {
    states[i + 1] = newton_step(k, states[i], c, delta, log_alpha, target, check_finite);
    keys[i + 1] = bits(states[i + 1]);
    if (keys[i + 1][0] == keys[i][0]) return states[i + 1].v;
    if (i >= 1 && keys[i + 1] == keys[i - 1]) return states[(kNewtonSteps - 1 - i) % 2 == 0 ? i + 1 : i].v;
  }
  return states[kNewtonSteps].v;
}

double sample_psi(const Constants& k, double delta, double log_alpha, double u) {
  const double c = delta / 2 + log_alpha / delta;
  const double target = log_(u) + log_G_at(k, c + 0.0, 0.0, delta, log_alpha);
  const double a = target - log_alpha;
  double lo = a < -600.0 ? -sqrt_(-2 * a) : ndtri_(exp_(a));
  lo = clamp_max(lo - c, 0.0);
  return c + newton(k, lo, 0.0, c, delta, log_alpha, target);
}

}  // namespace

at::Tensor psi_draws(const at::Tensor& delta, const at::Tensor& log_alpha, const at::Tensor& u,
                     const at::Tensor& constants) {
  const bool routines = gaussian_math::routines_found();
  const int64_t n = delta.numel();
  for (const at::Tensor* t : {&delta, &log_alpha, &u}) {
    if (!routines || !t->device().is_cpu() || t->scalar_type() != at::kDouble || !t->is_contiguous() ||
        t->numel() != n)
      return at::Tensor();
  }
  if (!constants.device().is_cpu() || constants.scalar_type() != at::kDouble || constants.numel() != 4 ||
      !constants.is_contiguous())
    return at::Tensor();
  const double* c = constants.data_ptr<double>();
  const Constants k{c[0], c[1], c[2], c[3]};
  const double* d = delta.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    if (d[i] == 0.0) return at::Tensor();  // the Python path's division by zero raises: torch's operations serve it
  }
  at::Tensor out = at::empty({n}, delta.options());
  const double* la = log_alpha.data_ptr<double>();
  const double* uu = u.data_ptr<double>();
  double* o = out.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) o[i] = sample_psi(k, d[i], la[i], uu[i]);
  return out;
}

at::Tensor residual_states(const at::Tensor& x, const at::Tensor& eps, const at::Tensor& coef, const at::Tensor& Delta,
                           const at::Tensor& log_alpha, const at::Tensor& u, const at::Tensor& zeta,
                           const at::Tensor& constants, double delta_min) {
  if (!gaussian_math::routines_found() || x.dim() < 1) return at::Tensor();
  const int64_t r = x.size(0), E = r > 0 ? x.numel() / r : 0;
  const auto state = x.scalar_type();
  for (const at::Tensor* t : {&x, &eps, &Delta, &zeta}) {
    if (!t->device().is_cpu() || !t->is_contiguous() || t->numel() != r * E || t->dim() < 1 || t->size(0) != r)
      return at::Tensor();
  }
  for (const at::Tensor* t : {&coef, &Delta, &log_alpha, &u, &zeta, &constants}) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kDouble || !t->is_contiguous()) return at::Tensor();
  }
  if ((state != at::kFloat && state != at::kDouble) || eps.scalar_type() != state || coef.numel() != 3 * r ||
      log_alpha.numel() != r || u.numel() != r || constants.numel() != 4 || r == 0 || E == 0)
    return at::Tensor();
  const double* c = constants.data_ptr<double>();
  const Constants k{c[0], c[1], c[2], c[3]};
  const at::Tensor D = Delta.view({r, E});
  const at::Tensor norms = at::linalg_vector_norm(D, 2, at::IntArrayRef{1});  // as torch.linalg.vector_norm(D, dim=1)
  const double* d = D.data_ptr<double>();
  const double* z_in = zeta.data_ptr<double>();
  const double* norm = norms.data_ptr<double>();
  at::Tensor e = at::empty({r, E}, D.options());
  at::Tensor ze = at::empty({r, E}, D.options());
  double* ee = e.data_ptr<double>();
  double* zz = ze.data_ptr<double>();
  for (int64_t i = 0; i < r; ++i) {
    const double safe = norm[i] <= delta_min ? 1.0 : norm[i];
    for (int64_t j = 0; j < E; ++j) {
      ee[i * E + j] = d[i * E + j] / safe;
      zz[i * E + j] = z_in[i * E + j] * ee[i * E + j];
    }
  }
  const at::Tensor dots = at::sum(ze, 1);  // as (Z * e).sum(dim=1)
  const double* dot = dots.data_ptr<double>();
  const double* A = coef.data_ptr<double>();
  const double* B = A + r;
  const double* sigma = A + 2 * r;
  const double* la = log_alpha.data_ptr<double>();
  const double* uu = u.data_ptr<double>();
  const float* x32 = state == at::kFloat ? x.data_ptr<float>() : nullptr;
  const float* eps32 = state == at::kFloat ? eps.data_ptr<float>() : nullptr;
  const double* x_d = state == at::kDouble ? x.data_ptr<double>() : nullptr;
  const double* eps_d = state == at::kDouble ? eps.data_ptr<double>() : nullptr;
  at::Tensor y = at::empty({r, E}, D.options());
  double* out = y.data_ptr<double>();
  for (int64_t i = 0; i < r; ++i) {
    const bool tiny = norm[i] <= delta_min;  // identical kernels: the state is q's draw, the fresh noise itself
    const double s = tiny ? 0.0 : sample_psi(k, norm[i], la[i], uu[i]);
    for (int64_t j = 0; j < E; ++j) {
      const int64_t at_ = i * E + j;
      const double x64 = x32 ? x32[at_] : x_d[at_];
      const double eps64 = eps32 ? eps32[at_] : eps_d[at_];
      const double mean = A[i] * x64 + B[i] * eps64;
      const double z_perp = z_in[at_] - dot[i] * ee[at_];
      const double z = tiny ? z_in[at_] : s * ee[at_] + z_perp;
      out[at_] = mean + sigma[i] * z;
    }
  }
  return y.view(x.sizes());
}
