// The transcendental routines torch's CPU kernels run for float64 (torch 2.x on x86), called one element at a time,
// and the residual sampler's log G on doubles (specray/methods/diffusion/residual.py), shared by residual_draw.cpp
// and block_verdict.cpp. log, exp, erfc and sqrt are MKL's vector math in its high-accuracy mode, log1p and expm1
// SLEEF's 1-ulp functions (the same bits in their AVX2 and AVX-512 builds), ndtri torch's own operation. The
// routines are weak symbols of libtorch_cpu: a torch build without them leaves them null (routines_found() false)
// and the kernels refuse every call. Every +, -, *, / and comparison is the Python path's, in its order (built
// with -ffp-contract=off: nothing fuses).
#pragma once

#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/special_ndtri.h>
#include <immintrin.h>

#include <cstdint>

extern "C" {
// MKL's vector math (Fortran interface, 32-bit length), as torch calls it (ATen/cpu/vml.h).
void VMDLN_(const int* n, const double* a, double* y, const int64_t* mode) __attribute__((weak));
void VMDEXP_(const int* n, const double* a, double* y, const int64_t* mode) __attribute__((weak));
void VMDERFC_(const int* n, const double* a, double* y, const int64_t* mode) __attribute__((weak));
void VMDSQRT_(const int* n, const double* a, double* y, const int64_t* mode) __attribute__((weak));
__m256d Sleef_log1pd4_u10avx2(__m256d) __attribute__((weak));
__m256d Sleef_expm1d4_u10avx2(__m256d) __attribute__((weak));
}

namespace gaussian_math {

constexpr int64_t kVmlMode = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE

using VmlFunction = void (*)(const int*, const double*, double*, const int64_t*);

inline double vml(VmlFunction f, double x) {
  const int one = 1;
  double y;
  f(&one, &x, &y, &kVmlMode);
  return y;
}

inline double log_(double x) { return vml(VMDLN_, x); }
inline double exp_(double x) { return vml(VMDEXP_, x); }
inline double erfc_(double x) { return vml(VMDERFC_, x); }
inline double sqrt_(double x) { return vml(VMDSQRT_, x); }
inline double log1p_(double x) { return _mm256_cvtsd_f64(Sleef_log1pd4_u10avx2(_mm256_set1_pd(x))); }
inline double expm1_(double x) { return _mm256_cvtsd_f64(Sleef_expm1d4_u10avx2(_mm256_set1_pd(x))); }
inline double ndtri_(double x) { return at::special_ndtri(at::scalar_tensor(x, at::kDouble)).item<double>(); }

// residual.py's constants, passed in (their values are Python's, not the compiler's folding of log and sqrt).
struct Constants {
  double log_half, sqrt_half, half_log_2pi, tail;
};

inline double clamp_max(double x, double bound) { return bound < x ? bound : x; }  // torch.clamp: NaN kept

inline double log1mexp(const Constants& k, double x) {
  if (x > k.log_half) return log_(-expm1_(x));
  return log1p_(-exp_(x));
}

inline double log_mills_series(double x) {
  const double x2 = 1.0 / (x * x);
  return log1p_(x2 * (-1.0 + x2 * (3.0 + x2 * (-15.0 + x2 * 105.0))));
}

inline double log_ndtr(const Constants& k, double x, bool far) {
  const double head = log_(erfc_((far ? -k.tail : x) * -k.sqrt_half) * 0.5);
  if (!far) return head;
  const double t = clamp_max(x, -k.tail);
  return -0.5 * t * t - log_(-t) - k.half_log_2pi + log_mills_series(t);
}

inline double log_G_at(const Constants& k, double s, double v, double delta, double log_alpha) {
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

inline bool routines_found() {
  return VMDLN_ && VMDEXP_ && VMDERFC_ && VMDSQRT_ && Sleef_log1pd4_u10avx2 && Sleef_expm1d4_u10avx2;
}

}  // namespace gaussian_math
