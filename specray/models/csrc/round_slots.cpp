// A speculative diffusion round's slots on a CPU in one call, where every row of the batch drafts gamma steps
// (specray/methods/diffusion/cpu_slots.py): each slot's step k + j and its coefficients (A, B, sigma) at that step.
// In Python that is the loop's host work between two rounds (the rows still active, their steps, the block lengths,
// the steps and the gather of the coefficients): a dozen numpy calls, each paying for the code before it in the loop.
// Integer additions and copies of the tables' doubles, so the values are numpy's by construction; cpu_slots.py still
// compares the kernel with the loop's numpy path before using it.
#include "kernels.h"

#include <cstdint>
#include <tuple>

// See kernels.h.
std::tuple<at::Tensor, at::Tensor> full_round_slots(const at::Tensor& k, int64_t gamma, const at::Tensor& tables) {
  if (!on_cpu({&k}, at::kLong) || !on_cpu({&tables}, at::kDouble) || k.dim() != 1 || !k.is_contiguous() ||
      tables.dim() != 2 || tables.size(0) != 3 || !tables.is_contiguous() || gamma < 1) {
    return {};
  }
  const int64_t n = k.size(0), K = tables.size(1);
  const int64_t* step = k.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (step[i] < 0 || step[i] > K - gamma) return {};  // a row done, or with fewer than gamma steps left
  }
  at::Tensor steps = at::empty({n, gamma}, k.options());
  at::Tensor coef = at::empty({3, n, gamma}, tables.options());
  int64_t* out = steps.data_ptr<int64_t>();
  double* c = coef.data_ptr<double>();
  const double* table = tables.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < gamma; ++j) {
      const int64_t s = step[i] + j;
      out[i * gamma + j] = s;
      for (int64_t t = 0; t < 3; ++t) c[(t * n + i) * gamma + j] = table[t * K + s];
    }
  }
  return {steps, coef};
}
