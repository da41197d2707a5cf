// The residual sampler's 1-D draw s ~ psi_alpha(.; delta) (specray/methods/diffusion/residual.py: the Newton
// solve of _sample_psi_one_row), row by row in one call. Every +, -, *, /, and comparison is the Python path's,
// in its order, on doubles (built with -ffp-contract=off: nothing fuses); every transcendental is the routine
// torch's CPU kernels run for float64 (torch 2.x on x86): log, exp, erfc and sqrt are MKL's vector math in its
// high-accuracy mode, log1p and expm1 SLEEF's 1-ulp functions (the same bits in their AVX2 and AVX-512 builds),
// and ndtri is torch's own operation. Those routines are looked up as weak symbols of libtorch_cpu: a torch build
// without them leaves them null and the call is refused. residual.py compares the kernel with the Python path
// before using it.
#include "kernels.h"

#include <ATen/ops/special_ndtri.h>
#include <ATen/ops/scalar_tensor.h>
#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

extern "C" {
// MKL's vector math (Fortran interface, 32-bit length), as torch calls it (ATen/cpu/vml.h).
void VMDLN_(const int* n, const double* a, double* y, const int64_t* mode) __attribute__((weak));
void VMDEXP_(const int* n, const double* a, double* y, const int64_t* mode) __attribute__((weak));
void VMDERFC_(const int* n, const double* a, double* y, const int64_t* mode) __attribute__((weak));
void VMDSQRT_(const int* n, const double* a, double* y, const int64_t* mode) __attribute__((weak));
__m256d Sleef_log1pd4_u10avx2(__m256d) __attribute__((weak));
__m256d Sleef_expm1d4_u10avx2(__m256d) __attribute__((weak));
}

namespace {

constexpr int64_t kVmlMode = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
constexpr int kNewtonSteps = 16;                     // residual.NEWTON_STEPS

using VmlFunction = void (*)(const int*, const double*, double*, const int64_t*);

double vml(VmlFunction f, double x) {
  const int one = 1;
  double y;
  f(&one, &x, &y, &kVmlMode);
  return y;
}

double log_(double x) { return vml(VMDLN_, x); }
double exp_(double x) { return vml(VMDEXP_, x); }
double erfc_(double x) { return vml(VMDERFC_, x); }
double sqrt_(double x) { return vml(VMDSQRT_, x); }
double log1p_(double x) { return _mm256_cvtsd_f64(Sleef_log1pd4_u10avx2(_mm256_set1_pd(x))); }
double expm1_(double x) { return _mm256_cvtsd_f64(Sleef_expm1d4_u10avx2(_mm256_set1_pd(x))); }
double ndtri_(double x) { return at::special_ndtri(at::scalar_tensor(x, at::kDouble)).item<double>(); }

// residual.py's constants, passed in (their values are Python's, not the compiler's folding of log and sqrt).
struct Constants {
  double log_half, sqrt_half, half_log_2pi, tail;
};

double clamp_max(double x, double bound) { return bound < x ? bound : x; }  // torch.clamp: NaN kept

double log1mexp(const Constants& k, double x) {
  if (x > k.log_half) return log_(-expm1_(x));
  return log1p_(-exp_(x));
}

double log_mills_series(double x) {
  const double x2 = 1.0 / (x * x);
  return log1p_(x2 * (-1.0 + x2 * (3.0 + x2 * (-15.0 + x2 * 105.0))));
}

double log_ndtr(const Constants& k, double x, bool far) {
  const double head = log_(erfc_((far ? -k.tail : x) * -k.sqrt_half) * 0.5);
  if (!far) return head;
  const double t = clamp_max(x, -k.tail);
  return -0.5 * t * t - log_(-t) - k.half_log_2pi + log_mills_series(t);
}

double log_G_at(const Constants& k, double s, double v, double delta, double log_alpha) {
  const double shifted = s - delta;
  const bool far_shifted = shifted < -k.tail;
  const bool far = far_shifted && s < -k.tail;
  const double log_phi_s = log_ndtr(k, s, far);
  double inner = log_ndtr(k, shifted, far_shifted) - log_phi_s - log_alpha;
  if (far) {
    const double t = clamp_max(s, -k.tail);
    inner = delta * v - log1p_(delta / (-t)) + log_mills_series(t - delta) - log_mills_series(t);
  }
  return (log_alpha + log_phi_s) + log1mexp(k, clamp_max(inner, 0.0));
}

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
  const bool routines = VMDLN_ && VMDEXP_ && VMDERFC_ && VMDSQRT_ && Sleef_log1pd4_u10avx2 && Sleef_expm1d4_u10avx2;
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
