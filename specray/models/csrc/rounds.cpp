// A speculative round's decision (the chain rules sd, cool_sd and uniform_rsd; block verification; LANTERN++
// with its G* residual) and the inverse-CDF draw, on a CPU in one call each, with the values of the torch
// operations of specray/methods/discrete/rules.py, lantern.py and specray/rng.py. A round there is ~35 operations
// of a few microseconds of dispatch each, most of its time at batch 1; the laws are 17 wide for the digits GPTs.
//
// Every step rounds once whatever the order, but the float64 sums that normalise P, Q and the next token's law
// (and block's residual masses): those follow torch's (round_math.h).
// specray/methods/discrete/cpu_rounds.py compares each kernel with torch's operations before using it.
#include "kernels.h"
#include "round_math.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

using namespace round_math;

namespace {

// What every round kernel takes: P [rows, gamma + 1, V] and Q [rows, gamma, V] float32 contiguous with regular rows
// that have mass, drafts [rows, gamma] int64 within V, u_accept [rows, gamma] and u_residual [rows] float64, all on
// the CPU, 4 <= V < 256.
bool serves(const at::Tensor& P, const at::Tensor& Q, const at::Tensor& drafts, const at::Tensor& u_accept,
            const at::Tensor& u_residual) {
  if (P.dim() != 3 || Q.dim() != 3 || drafts.dim() != 2 || u_accept.dim() != 2 || u_residual.dim() != 1) return false;
  const int64_t rows = P.size(0), gamma = Q.size(1), n = P.size(2);
  const bool cpu = P.device().is_cpu() && Q.device().is_cpu() && drafts.device().is_cpu() &&
                   u_accept.device().is_cpu() && u_residual.device().is_cpu();
  const bool types = P.scalar_type() == at::kFloat && Q.scalar_type() == at::kFloat &&
                     drafts.scalar_type() == at::kLong && u_accept.scalar_type() == at::kDouble &&
                     u_residual.scalar_type() == at::kDouble;
  const bool shapes = P.size(1) == gamma + 1 && Q.size(0) == rows && Q.size(2) == n && drafts.size(0) == rows &&
                      drafts.size(1) == gamma && u_accept.size(0) == rows && u_accept.size(1) == gamma &&
                      u_residual.size(0) == rows && gamma >= 1 && n >= kMinWidth && n < kMaxWidth;
  if (!cpu || !types || !shapes || !P.is_contiguous() || !Q.is_contiguous()) return false;
  const auto d = drafts.accessor<int64_t, 2>();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t i = 0; i < gamma; ++i) {
      if (d[b][i] < 0 || d[b][i] >= n) return false;  // torch's indexing raises: let it
    }
  }
  return regular_rows(P) && regular_rows(Q);
}

// The token after `accepted` drafts: drawn from `law` (the residual) unless it has no mass or every draft was
// accepted, then from p (the target's law there, normalised); either normalised by its torch sum first.
int64_t next_token(const double* p, const double* law, bool use_p, int64_t n, double u) {
  const double* chosen = use_p ? p : law;
  double normal[kMaxWidth];
  const double total = torch_sum(chosen, n);
  for (int64_t k = 0; k < n; ++k) normal[k] = chosen[k] / total;
  return draw(normal, n, u);
}

struct Outputs {
  at::Tensor n_accepted, next_token, accepted_mask;
  Outputs(int64_t rows, int64_t gamma, const at::TensorOptions& longs)
      : n_accepted(at::empty({rows}, longs)), next_token(at::empty({rows}, longs)),
        accepted_mask(at::empty({rows, gamma}, longs.dtype(at::kBool))) {}
  void set(int64_t b, int64_t gamma, int64_t accepted, int64_t token) {
    n_accepted.data_ptr<int64_t>()[b] = accepted;
    next_token.data_ptr<int64_t>()[b] = token;
    bool* mask = accepted_mask.data_ptr<bool>() + b * gamma;
    for (int64_t i = 0; i < gamma; ++i) mask[i] = i < accepted;
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> tuple() const {
    return std::make_tuple(n_accepted, next_token, accepted_mask);
  }
};

using RoundOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
const RoundOutputs kNotServed{at::Tensor(), at::Tensor(), at::Tensor()};

// A chain round (rules.py's chain rules, LANTERN with its G* residual) given the relaxed target mass
// relax(p, x, i) of token x under the normalised law p at draft position i: position i passes iff
// u < min(1, relax(P_i, d_i, i) / Q_i(d_i)), stopping at the first that does not; the next token is drawn from the
// residual [p - min(q, relax(p, x, j))]_+ at the rejected position j, or from P_{gamma+1} after gamma passes.
template <typename Relax>
RoundOutputs decide_chain(const at::Tensor& P, const at::Tensor& Q, const at::Tensor& drafts,
                          const at::Tensor& u_accept, const at::Tensor& u_residual, const Relax& relax) {
  const int64_t rows = P.size(0), gamma = Q.size(1), n = P.size(2);
  Outputs out(rows, gamma, drafts.options());
  const auto d = drafts.accessor<int64_t, 2>();
  const auto ua = u_accept.accessor<double, 2>();
  const auto ur = u_residual.accessor<double, 1>();
  double p[kMaxWidth], q[kMaxWidth], law[kMaxWidth];
  for (int64_t b = 0; b < rows; ++b) {
    const float* pb = P.data_ptr<float>() + b * (gamma + 1) * n;
    const float* qb = Q.data_ptr<float>() + b * gamma * n;
    int64_t accepted = 0;
    for (; accepted < gamma; ++accepted) {
      const int64_t token = d[b][accepted];
      normalised(pb + accepted * n, n, p);
      normalised(qb + accepted * n, n, q);
      if (!(ua[b][accepted] < pass_probability(relax(p, token, accepted), q[token]))) break;
    }
    normalised(pb + accepted * n, n, p);
    bool mass = false;
    if (accepted < gamma) {
      normalised(qb + accepted * n, n, q);
      for (int64_t x = 0; x < n; ++x) {
        const double cut = relax(p, x, accepted);
        law[x] = p[x] - (cut < q[x] ? cut : q[x]);
      }
      mass = clamp_positive(law, n);
    }
    out.set(b, gamma, accepted, next_token(p, law, !mass, n, ur[b]));
  }
  return out.tuple();
}

}  // namespace

at::Tensor sample_categorical(const at::Tensor& probs, const at::Tensor& u) {
  if (probs.dim() != 2 || u.dim() < 1 || u.dim() > 2) return at::Tensor();
  const bool floating = probs.scalar_type() == at::kFloat || probs.scalar_type() == at::kDouble;
  const bool one_per_row = (u.dim() == 1 || u.size(1) == 1) && u.size(0) == probs.size(0);
  if (!probs.device().is_cpu() || !floating || probs.stride(1) != 1 || !u.device().is_cpu() ||
      u.scalar_type() != at::kDouble || !one_per_row || probs.size(1) < 1 || probs.size(1) > kMaxWidth) {
    return at::Tensor();
  }
  const int64_t rows = probs.size(0), n = probs.size(1), row_stride = probs.stride(0), u_stride = u.stride(0);
  at::Tensor out = at::empty(u.sizes(), probs.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  const double* us = u.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r) {
    if (probs.scalar_type() == at::kFloat) {
      const float* law = probs.data_ptr<float>() + r * row_stride;
      if (!regular(law, n)) return at::Tensor();
      dst[r] = draw(law, n, us[r * u_stride]);
    } else {
      const double* law = probs.data_ptr<double>() + r * row_stride;
      if (!regular(law, n)) return at::Tensor();
      dst[r] = draw(law, n, us[r * u_stride]);
    }
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> chain_round(const at::Tensor& P, const at::Tensor& Q,
                                                           const at::Tensor& drafts, const at::Tensor& u_accept,
                                                           const at::Tensor& u_residual,
                                                           const std::optional<at::Tensor>& omega) {
  const at::Tensor omegas = omega.has_value() ? *omega : at::Tensor();
  if (!serves(P, Q, drafts, u_accept, u_residual)) return kNotServed;
  if (omegas.defined() && !(omegas.device().is_cpu() && omegas.scalar_type() == at::kDouble && omegas.dim() == 1 &&
                            omegas.size(0) == Q.size(1) && omegas.is_contiguous() &&
                            regular(omegas.data_ptr<double>(), omegas.size(0)))) {
    return kNotServed;  // an infinite multiplier times a zero mass is NaN, which torch's operations carry
  }
  // sd: P(x) itself (its residual [p - q]_+ is [p - min(q, p)]_+ bit for bit); cool_sd, uniform_rsd: w_i P(x).
  const double* w = omegas.defined() ? omegas.data_ptr<double>() : nullptr;
  return decide_chain(P, Q, drafts, u_accept, u_residual,
                      [w](const double* p, int64_t x, int64_t i) { return w ? w[i] * p[x] : p[x]; });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_round(const at::Tensor& P, const at::Tensor& Q,
                                                           const at::Tensor& drafts, const at::Tensor& u_accept,
                                                           const at::Tensor& u_residual) {
  if (!serves(P, Q, drafts, u_accept, u_residual)) return kNotServed;
  const int64_t rows = P.size(0), gamma = Q.size(1), n = P.size(2);
  Outputs out(rows, gamma, drafts.options());
  const auto d = drafts.accessor<int64_t, 2>();
  const auto ua = u_accept.accessor<double, 2>();
  const auto ur = u_residual.accessor<double, 1>();
  std::vector<double> p((gamma + 1) * n), q(gamma * n), weights(gamma + 1);
  double law[kMaxWidth];
  for (int64_t b = 0; b < rows; ++b) {
    const float* pb = P.data_ptr<float>() + b * (gamma + 1) * n;
    const float* qb = Q.data_ptr<float>() + b * gamma * n;
    for (int64_t i = 0; i <= gamma; ++i) normalised(pb + i * n, n, p.data() + i * n);
    for (int64_t i = 0; i < gamma; ++i) normalised(qb + i * n, n, q.data() + i * n);
    // Weights w_0 = 1, w_i = min(1, (w_{i-1} P_i(d_i)) / Q_i(d_i)) (rules.block_weights).
    weights[0] = 1.0;
    for (int64_t i = 0; i < gamma; ++i) {
      weights[i + 1] = pass_probability(weights[i] * p[i * n + d[b][i]], q[i * n + d[b][i]]);
    }
    // Stop probabilities h_i = Z_i / (Z_i + 1 - w_i) (1 where that is not positive), h_gamma = w_gamma; tau is
    // the last position that passes (rules.block_stop_probs, decide_accepted).
    int64_t accepted = 0;
    for (int64_t i = 1; i <= gamma; ++i) {
      double stop = weights[gamma];
      if (i < gamma) {
        for (int64_t k = 0; k < n; ++k) law[k] = weights[i] * p[i * n + k] - q[i * n + k];
        clamp_positive(law, n);
        const double z = torch_sum(law, n);
        const double denominator = z + 1.0 - weights[i];
        const double ratio = denominator > 0.0 ? z / denominator : 1.0;
        stop = ratio < 0.0 ? 0.0 : (ratio > 1.0 ? 1.0 : ratio);
      }
      if (ua[b][i - 1] < stop) accepted = i;
    }
    // The residual [w_tau p - q]_+ at tau, or the bonus P_{gamma+1}.
    const double* pt = p.data() + accepted * n;
    const double* qt = q.data() + (accepted < gamma ? accepted : gamma - 1) * n;
    for (int64_t k = 0; k < n; ++k) law[k] = weights[accepted] * pt[k] - qt[k];
    const bool mass = clamp_positive(law, n);
    out.set(b, gamma, accepted, next_token(pt, law, !mass || accepted == gamma, n, ur[b]));
  }
  return out.tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lantern_round(const at::Tensor& P, const at::Tensor& Q,
                                                             const at::Tensor& drafts, const at::Tensor& u_accept,
                                                             const at::Tensor& u_residual,
                                                             const at::Tensor& neighbours, int64_t k,
                                                             bool lambda_mode, double lam, double delta,
                                                             bool forbid_zero_target_mass) {
  if (!serves(P, Q, drafts, u_accept, u_residual)) return kNotServed;
  const int64_t n = P.size(2);
  if (k < 0 || (k > 0 && (!neighbours.device().is_cpu() || neighbours.scalar_type() != at::kLong ||
                          neighbours.dim() != 2 || neighbours.size(0) != n || neighbours.size(1) < k ||
                          !neighbours.is_contiguous()))) {
    return kNotServed;
  }
  if (k > 0) {
    const int64_t* ids = neighbours.data_ptr<int64_t>();
    for (int64_t e = 0; e < neighbours.numel(); ++e) {
      if (ids[e] < 0 || ids[e] >= n) return kNotServed;
    }
  }
  const Relaxation relaxed{k > 0 ? neighbours.data_ptr<int64_t>() : nullptr, k > 0 ? neighbours.size(1) : 0, k,
                           lambda_mode, forbid_zero_target_mass, lam - 1.0, delta};
  return decide_chain(P, Q, drafts, u_accept, u_residual,
                      [&relaxed](const double* p, int64_t x, int64_t) { return relaxed(p, x); });
}
