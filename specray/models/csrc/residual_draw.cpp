// The residual sampler's 1-D draw s ~ psi_alpha(.; delta) (specray/methods/diffusion/residual.py: the Newton
// solve of _sample_psi_one_row), row by row in one call, with the Python path's arithmetic and torch's
// transcendental routines (gaussian_math.h). residual.py compares the kernel with the Python path before using it.
#include "kernels.h"
#include "gaussian_math.h"

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
