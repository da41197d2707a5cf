// A draft GPT's speculative round's bookkeeping on a CPU, one call each where every row of the batch takes part: the
// round's positions and uniforms, and its commit (the correction / bonus into the token buffer, both caches' lengths,
// the committed lengths). The values of specray/methods/discrete/loop.py's torch operations (about 15 of them a
// round, a few microseconds of dispatch each at batch 1): integer sums, a minimum, copies.
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <tuple>

// See kernels.h.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chain_plan(const at::Tensor& committed,
                                                                                  int64_t gamma,
                                                                                  const at::Tensor& slab) {
  if (!on_cpu({&committed}, at::kLong) || !on_cpu({&slab}, at::kDouble) || committed.dim() != 1 || slab.dim() != 3 ||
      slab.size(0) != committed.size(0) || slab.size(2) != 3 || gamma < 1) {
    return {};
  }
  const int64_t rows = committed.size(0);
  const auto n = committed.accessor<int64_t, 1>();
  for (int64_t b = 0; b < rows; ++b) {
    if (n[b] < 0 || n[b] + gamma > slab.size(1)) return {};  // the uniforms of positions n .. n + gamma - 1
  }
  const auto longs = committed.options();
  const auto doubles = slab.options();
  at::Tensor positions = at::empty({rows, gamma + 1}, longs), fed_positions = at::empty({rows, gamma + 1}, longs);
  at::Tensor u_draft = at::empty({rows, gamma}, doubles), u_accept = at::empty({rows, gamma}, doubles);
  at::Tensor u_residual = at::empty({rows}, doubles);
  int64_t* position = positions.data_ptr<int64_t>();
  int64_t* fed = fed_positions.data_ptr<int64_t>();
  double* draft = u_draft.data_ptr<double>();
  double* accept = u_accept.data_ptr<double>();
  double* residual = u_residual.data_ptr<double>();
  const auto u = slab.accessor<double, 3>();
  for (int64_t b = 0; b < rows; ++b) {
    // Draft i is image token n + i, fed at sequence position n + i; its keys are position n + i's.
    for (int64_t i = 0; i <= gamma; ++i) {
      position[b * (gamma + 1) + i] = n[b] + i;
      fed[b * (gamma + 1) + i] = n[b] + i - 1;
    }
    for (int64_t i = 0; i < gamma; ++i) {
      draft[b * gamma + i] = u[b][n[b] + i][0];
      accept[b * gamma + i] = u[b][n[b] + i][1];
    }
    residual[b] = u[b][n[b]][2];
  }
  return {positions, fed_positions, u_draft, u_accept, u_residual};
}

// See kernels.h. Every index is checked before anything is written.
bool chain_commit(at::Tensor& tokens, at::Tensor& committed, at::Tensor& target_lengths, at::Tensor& draft_lengths,
                  const at::Tensor& n_accepted, const at::Tensor& next_token, const at::Tensor& n_drafts) {
  if (!on_cpu({&tokens, &committed, &target_lengths, &draft_lengths, &n_accepted, &next_token, &n_drafts}, at::kLong) ||
      tokens.dim() != 2 || committed.dim() != 1 || target_lengths.dim() != 1 || draft_lengths.dim() != 1 ||
      n_accepted.dim() != 1 || next_token.dim() != 1 || n_drafts.dim() != 1) {
    return false;
  }
  const int64_t rows = committed.size(0), cache_rows = target_lengths.size(0);
  if (tokens.size(0) != rows || (cache_rows != rows && cache_rows != 2 * rows) ||
      draft_lengths.size(0) != cache_rows || n_accepted.size(0) != rows || next_token.size(0) != rows ||
      n_drafts.size(0) != rows || !target_lengths.is_contiguous() || !draft_lengths.is_contiguous()) {
    return false;
  }
  auto n = committed.accessor<int64_t, 1>();
  const auto accepted = n_accepted.accessor<int64_t, 1>();
  const auto drafted = n_drafts.accessor<int64_t, 1>();
  for (int64_t b = 0; b < rows; ++b) {
    if (n[b] < 0 || accepted[b] < 0 || n[b] + accepted[b] >= tokens.size(1)) return false;
  }
  auto buffer = tokens.accessor<int64_t, 2>();
  const auto next = next_token.accessor<int64_t, 1>();
  int64_t* target = target_lengths.data_ptr<int64_t>();
  int64_t* draft = draft_lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    // The accepted drafts are in place; the correction / bonus follows them. The target's cache holds committed K/V
    // at slots 0 .. n + n_accepted, the draft's up to its last fed draft.
    const int64_t last = n[b] + accepted[b];
    buffer[b][last] = next[b];
    const int64_t kept_draft = std::min(last + 1, n[b] + drafted[b]);
    for (int64_t row = b; row < cache_rows; row += rows) {  // the cond row, then the uncond row
      target[row] = last + 1;
      draft[row] = kept_draft;
    }
    n[b] = last + 1;
  }
  return true;
}
