// The residual sampler's draws (specray/methods/diffusion/residual.py) with the Python path's arithmetic and torch's
// transcendental routines (gaussian_math.h): psi_draws, the 1-D draw s ~ psi_alpha(.; delta) (the Newton solve of
// _sample_psi_one_row) row by row in one call, and a diffusion round's new states for its cut rows in one call
// (the affine chain's mean of loop._mean, then sample_residual: residual_states; or reflect: reflected_states), the
// two row sums (the norm of Delta and <V, e>) as torch operations on the Python paths' shapes. residual.py and
// loop.py compare each kernel with the Python path before using it.
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

namespace {

// A round's new states y = (A x + B eps) + sigma z for rows r, with z from the unit vector e of Delta and the noise
// V: ψ_α's draw (s e + V - <V, e> e, or V itself where Delta is below delta_min) given draws (log_alpha, u and the
// constants), else the reflection of the rejected draft (V - 2 <V, e> e).
struct Draws {
  const double* log_alpha;
  const double* u;
  Constants k;
};

bool serves_states(const at::Tensor& x, const at::Tensor& eps, const at::Tensor& coef, const at::Tensor& Delta,
                   const at::Tensor& noise) {
  if (!gaussian_math::routines_found() || x.dim() < 1 || x.size(0) == 0 || x.numel() == 0) return false;
  const int64_t r = x.size(0), E = x.numel() / r;
  for (const at::Tensor* t : {&x, &eps, &Delta, &noise}) {
    if (!t->device().is_cpu() || !t->is_contiguous() || t->numel() != r * E || t->dim() < 1 || t->size(0) != r)
      return false;
  }
  for (const at::Tensor* t : {&coef, &Delta, &noise}) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kDouble || !t->is_contiguous()) return false;
  }
  const auto state = x.scalar_type();
  return (state == at::kFloat || state == at::kDouble) && eps.scalar_type() == state && coef.numel() == 3 * r;
}

at::Tensor new_states(const at::Tensor& x, const at::Tensor& eps, const at::Tensor& coef, const at::Tensor& Delta,
                      const at::Tensor& noise, const Draws* draws, double delta_min) {
  const int64_t r = x.size(0), E = x.numel() / r;
  const at::Tensor D = Delta.view({r, E});
  const at::Tensor norms = at::linalg_vector_norm(D, 2, at::IntArrayRef{1});  // as torch.linalg.vector_norm(D, dim=1)
  const double* d = D.data_ptr<double>();
  const double* v = noise.data_ptr<double>();
  const double* norm = norms.data_ptr<double>();
  at::Tensor e = at::empty({r, E}, D.options());
  at::Tensor ve = at::empty({r, E}, D.options());
  double* ee = e.data_ptr<double>();
  double* vv = ve.data_ptr<double>();
  for (int64_t i = 0; i < r; ++i) {
    const double safe = norm[i] <= delta_min ? 1.0 : norm[i];
    for (int64_t j = 0; j < E; ++j) {
      ee[i * E + j] = d[i * E + j] / safe;
      vv[i * E + j] = v[i * E + j] * ee[i * E + j];
    }
  }
  const at::Tensor dots = at::sum(ve, 1);  // as (V * e).sum(dim=1)
  const double* dot = dots.data_ptr<double>();
  const double* A = coef.data_ptr<double>();
  const double* B = A + r;
  const double* sigma = A + 2 * r;
  const bool single = x.scalar_type() == at::kFloat;
  const float* x32 = single ? x.data_ptr<float>() : nullptr;
  const float* eps32 = single ? eps.data_ptr<float>() : nullptr;
  const double* x64 = single ? nullptr : x.data_ptr<double>();
  const double* eps64 = single ? nullptr : eps.data_ptr<double>();
  at::Tensor y = at::empty({r, E}, D.options());
  double* out = y.data_ptr<double>();
  for (int64_t i = 0; i < r; ++i) {
    const bool tiny = norm[i] <= delta_min;  // identical kernels: ψ_α's state is q's draw, the fresh noise itself
    const double s = draws && !tiny ? sample_psi(draws->k, norm[i], draws->log_alpha[i], draws->u[i]) : 0.0;
    for (int64_t j = 0; j < E; ++j) {
      const int64_t at_ = i * E + j;
      const double mean = A[i] * (single ? x32[at_] : x64[at_]) + B[i] * (single ? eps32[at_] : eps64[at_]);
      double z;
      if (!draws) {
        z = v[at_] - 2 * dot[i] * ee[at_];  // reflect: X - 2 <X, e> e
      } else {
        z = tiny ? v[at_] : s * ee[at_] + (v[at_] - dot[i] * ee[at_]);
      }
      out[at_] = mean + sigma[i] * z;
    }
  }
  return y.view(x.sizes());
}

}  // namespace

at::Tensor residual_states(const at::Tensor& x, const at::Tensor& eps, const at::Tensor& coef, const at::Tensor& Delta,
                           const at::Tensor& log_alpha, const at::Tensor& u, const at::Tensor& zeta,
                           const at::Tensor& constants, double delta_min) {
  if (!serves_states(x, eps, coef, Delta, zeta)) return at::Tensor();
  const int64_t r = x.size(0);
  for (const at::Tensor* t : {&log_alpha, &u, &constants}) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kDouble || !t->is_contiguous()) return at::Tensor();
  }
  if (log_alpha.numel() != r || u.numel() != r || constants.numel() != 4) return at::Tensor();
  const double* c = constants.data_ptr<double>();
  const Draws draws{log_alpha.data_ptr<double>(), u.data_ptr<double>(), Constants{c[0], c[1], c[2], c[3]}};
  return new_states(x, eps, coef, Delta, zeta, &draws, delta_min);
}

at::Tensor reflected_states(const at::Tensor& x, const at::Tensor& eps, const at::Tensor& coef, const at::Tensor& Delta,
                            const at::Tensor& xi, double delta_min) {
  if (!serves_states(x, eps, coef, Delta, xi)) return at::Tensor();
  return new_states(x, eps, coef, Delta, xi, nullptr, delta_min);
}
