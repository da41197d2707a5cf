// A speculative diffusion round's draws on a CPU in one call (specray/methods/diffusion/cpu_draws.py): its streams'
// keys at the round and every slot's step, the draft noise xi (and the residual sampler's noise zeta where the round
// draws it) by Box-Muller, and the uniforms eta (and the residual sampler's u) as 1 - u. There they are some 30
// torch operations, a few microseconds of dispatch each at batch 1. The hash and a uniform's integer-to-double
// steps are exact, every * and - rounds once as in the Python path (built with -ffp-contract=off: nothing fuses),
// and log, sqrt and cos are torch's own operations on tensors of the Python path's shapes, so the values are torch's
// by construction; cpu_draws.py still compares the kernel with the Python path before using it.
#include "kernels.h"
#include "splitmix.h"

#include <ATen/ops/cos.h>
#include <ATen/ops/log.h>
#include <ATen/ops/sqrt.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using splitmix64::kGolden;
using splitmix64::mix;
using splitmix64::to_uniform;

constexpr double kTwoPi = 2.0 * 3.141592653589793;  // Python's 2.0 * math.pi, an exact doubling

}  // namespace

// See kernels.h.
std::tuple<at::Tensor, at::Tensor, at::Tensor> round_draws(const at::Tensor& hashes, const at::Tensor& rows,
                                                           int64_t index, const at::Tensor& steps,
                                                           const std::vector<int64_t>& shape, bool residual_noise) {
  if (!on_cpu({&hashes, &rows, &steps}, at::kLong) || hashes.dim() != 2 || rows.dim() != 1 || steps.dim() != 2 ||
      steps.size(0) != rows.size(0) || (hashes.size(0) != 2 && hashes.size(0) != 4) ||
      (residual_noise && hashes.size(0) != 4)) {
    return {};
  }
  const int64_t streams = hashes.size(0), batch = hashes.size(1), n = rows.size(0), G = steps.size(1);
  int64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0) return {};
    elements *= d;
  }
  const at::Tensor keys = hashes.contiguous(), row_of = rows.contiguous(), step_of = steps.contiguous();
  const auto* h = reinterpret_cast<const uint64_t*>(keys.data_ptr<int64_t>());
  const int64_t* row = row_of.data_ptr<int64_t>();
  const auto* step = reinterpret_cast<const uint64_t*>(step_of.data_ptr<int64_t>());
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] < 0 || row[i] >= batch) return {};
  }

  // rng.extend_hash(hashes[:, rows, None], index, steps): [streams, n, G]
  at::Tensor draws = at::empty({streams, n, G}, keys.options());
  auto* key = reinterpret_cast<uint64_t*>(draws.data_ptr<int64_t>());
  for (int64_t s = 0; s < streams; ++s) {
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t at_round = mix(h[s * batch + row[i]] ^ static_cast<uint64_t>(index));
      for (int64_t j = 0; j < G; ++j) key[(s * n + i) * G + j] = mix(at_round ^ step[i * G + j]);
    }
  }

  // rng.normal_at(draws[0::3] or draws[:1], shape): element e of a key takes the uniforms of indices 2e and 2e + 1
  const std::vector<int64_t> normal_streams = residual_noise ? std::vector<int64_t>{0, 3} : std::vector<int64_t>{0};
  std::vector<int64_t> normal_shape{static_cast<int64_t>(normal_streams.size()), n, G};
  normal_shape.insert(normal_shape.end(), shape.begin(), shape.end());
  const auto doubles = keys.options().dtype(at::kDouble);
  at::Tensor radius = at::empty(normal_shape, doubles), angle = at::empty(normal_shape, doubles);
  double* r = radius.data_ptr<double>();
  double* a = angle.data_ptr<double>();
  int64_t out = 0;
  for (int64_t s : normal_streams) {
    for (int64_t k = 0; k < n * G; ++k) {
      const uint64_t base = key[s * n * G + k];
      for (int64_t e = 0; e < elements; ++e, ++out) {
        r[out] = 1.0 - to_uniform(mix(base ^ (static_cast<uint64_t>(2 * e) * kGolden)));
        a[out] = kTwoPi * to_uniform(mix(base ^ (static_cast<uint64_t>(2 * e + 1) * kGolden)));
      }
    }
  }
  at::log_(radius);  // sqrt(-2 log(1 - u0)) cos(2 pi u1), torch's log, sqrt and cos
  for (int64_t i = 0; i < out; ++i) r[i] = -2.0 * r[i];
  at::sqrt_(radius);
  at::cos_(angle);
  for (int64_t i = 0; i < out; ++i) r[i] = r[i] * a[i];

  // 1 - rng.uniform_at(draws[1:3])
  const int64_t uniform_streams = streams == 4 ? 2 : 1;
  at::Tensor uniforms = at::empty({uniform_streams, n, G}, doubles);
  double* u = uniforms.data_ptr<double>();
  for (int64_t k = 0; k < uniform_streams * n * G; ++k) u[k] = 1.0 - to_uniform(mix(key[n * G + k]));
  return {draws, radius, uniforms};
}
