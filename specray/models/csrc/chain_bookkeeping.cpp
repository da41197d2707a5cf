// A draft GPT's speculative round's bookkeeping on a CPU, one call each where every row of the batch takes part: the
// round's positions, uniforms and draft calls' inputs; the verify call's inputs; and its commit (the correction / bonus
// into the token buffer, both caches' lengths, the committed lengths); and, once a batch, its tally's prefix rounds
// folded into the tally's counters (specray/methods/common.py's RoundTally.flush). The values of
// specray/methods/discrete/loop.py's torch operations (about 25 of them a round, a few microseconds of dispatch each
// at batch 1): integer sums, a minimum, copies, and the uniforms' hash (splitmix.h: integer arithmetic and an exact
// conversion to a double).
#include "kernels.h"
#include "splitmix.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

// See kernels.h.
ChainPlan chain_plan(const at::Tensor& committed, int64_t gamma, const at::Tensor& stream_hashes, int64_t step,
                     const std::optional<at::Tensor>& tokens) {
  if (!on_cpu({&committed, &stream_hashes}, at::kLong) || committed.dim() != 1 || stream_hashes.dim() != 2 ||
      stream_hashes.size(0) != committed.size(0) || stream_hashes.size(1) != 3 || gamma < 1 ||
      (tokens && (!on_cpu({&*tokens}, at::kLong) || tokens->dim() != 2 || tokens->size(0) != committed.size(0)))) {
    return {};
  }
  const int64_t rows = committed.size(0);
  const auto n = committed.accessor<int64_t, 1>();
  for (int64_t b = 0; b < rows; ++b) {
    if (n[b] < 0) return {};
  }
  const auto longs = committed.options();
  const auto doubles = longs.dtype(at::kDouble);
  at::Tensor positions = at::empty({rows, gamma + 1}, longs), fed_positions = at::empty({rows, gamma + 1}, longs);
  at::Tensor u_draft = at::empty({rows, gamma}, doubles), u_accept = at::empty({rows, gamma}, doubles);
  at::Tensor u_residual = at::empty({rows}, doubles);
  int64_t* position = positions.data_ptr<int64_t>();
  int64_t* fed = fed_positions.data_ptr<int64_t>();
  double* draft = u_draft.data_ptr<double>();
  double* accept = u_accept.data_ptr<double>();
  double* residual = u_residual.data_ptr<double>();
  const auto h = stream_hashes.accessor<int64_t, 2>();
  for (int64_t b = 0; b < rows; ++b) {
    // Draft i is image token n + i, fed at sequence position n + i; its keys are position n + i's.
    for (int64_t i = 0; i <= gamma; ++i) {
      position[b * (gamma + 1) + i] = n[b] + i;
      fed[b * (gamma + 1) + i] = n[b] + i - 1;
    }
    for (int64_t i = 0; i < gamma; ++i) {
      draft[b * gamma + i] = splitmix64::uniform_at(static_cast<uint64_t>(h[b][0]), n[b] + i, step, 0);
      accept[b * gamma + i] = splitmix64::uniform_at(static_cast<uint64_t>(h[b][1]), n[b] + i, step, 0);
    }
    residual[b] = splitmix64::uniform_at(static_cast<uint64_t>(h[b][2]), n[b], step, 0);
  }
  if (!tokens) return {positions, fed_positions, u_draft, u_accept, u_residual, {}, {}, {}, {}};
  // The draft calls' inputs: step 0 catches up sequence positions n - 1, n, fed image tokens n - 2, n - 1 (from round
  // 1 on, where n >= 2: in round 0 the class label takes position 0, and first_fed stays undefined); step i >= 1 is
  // fed at position n + i. The later positions and the draft uniforms as [B, 1] columns, each a view of one buffer
  // (two allocations, not one copy each).
  at::Tensor first_fed;
  bool caught_up = true;
  for (int64_t b = 0; b < rows; ++b) caught_up = caught_up && n[b] >= 2 && n[b] - 1 < tokens->size(1);
  if (caught_up) {
    first_fed = at::empty({rows, 2}, longs);
    const auto buffer = tokens->accessor<int64_t, 2>();
    int64_t* out = first_fed.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
      out[2 * b] = buffer[b][n[b] - 2];
      out[2 * b + 1] = buffer[b][n[b] - 1];
    }
  }
  at::Tensor later = at::empty({gamma - 1, rows, 1}, longs), columns = at::empty({gamma, rows, 1}, doubles);
  int64_t* later_at = later.data_ptr<int64_t>();
  double* column_at = columns.data_ptr<double>();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t i = 1; i < gamma; ++i) later_at[(i - 1) * rows + b] = n[b] + i;
    for (int64_t i = 0; i < gamma; ++i) column_at[i * rows + b] = draft[b * gamma + i];
  }
  return {positions, fed_positions, u_draft, u_accept, u_residual, fed_positions.narrow(1, 0, 2), first_fed,
          later.unbind(0), columns.unbind(0)};
}

// See kernels.h.
at::Tensor round_uniforms(const at::Tensor& stream_hashes, const at::Tensor& idx, const at::Tensor& positions,
                          int64_t step) {
  if (!on_cpu({&stream_hashes, &idx, &positions}, at::kLong) || stream_hashes.dim() != 2 || idx.dim() != 1 ||
      positions.dim() != 2 || positions.size(0) != idx.size(0)) {
    return {};
  }
  const int64_t rows = idx.size(0), k = positions.size(1), streams = stream_hashes.size(1);
  const auto row = idx.accessor<int64_t, 1>();
  const auto position = positions.accessor<int64_t, 2>();
  for (int64_t b = 0; b < rows; ++b) {
    if (row[b] < 0 || row[b] >= stream_hashes.size(0)) return {};
    for (int64_t i = 0; i < k; ++i) {
      if (position[b][i] < 0) return {};
    }
  }
  const auto h = stream_hashes.accessor<int64_t, 2>();
  at::Tensor out = at::empty({rows, k, streams}, stream_hashes.options().dtype(at::kDouble));
  double* u = out.data_ptr<double>();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t s = 0; s < streams; ++s) {
        u[(b * k + i) * streams + s] =
            splitmix64::uniform_at(static_cast<uint64_t>(h[row[b]][s]), position[b][i], step, 0);
      }
    }
  }
  return out;
}

namespace {

// laws (gamma of [B, V], any strides) into out [B, gamma, V], contiguous.
template <typename T>
void stack_laws(const std::vector<at::Tensor>& laws, at::Tensor& out) {
  const int64_t gamma = out.size(1), rows = out.size(0), width = out.size(2);
  T* to = out.data_ptr<T>();
  for (int64_t i = 0; i < gamma; ++i) {
    const auto law = laws[i].accessor<T, 2>();
    for (int64_t b = 0; b < rows; ++b) {
      for (int64_t v = 0; v < width; ++v) to[(b * gamma + i) * width + v] = law[b][v];
    }
  }
}

}  // namespace

// See kernels.h. Every index is checked before anything is written.
std::tuple<at::Tensor, at::Tensor, at::Tensor> chain_verify_inputs(const std::vector<at::Tensor>& draft_columns,
                                                                   const std::vector<at::Tensor>& laws,
                                                                   at::Tensor& tokens, const at::Tensor& positions,
                                                                   const at::Tensor& fed_positions) {
  const int64_t gamma = static_cast<int64_t>(draft_columns.size());
  if (gamma < 1 || laws.size() != draft_columns.size() || !on_cpu({&tokens, &positions, &fed_positions}, at::kLong) ||
      tokens.dim() != 2 || positions.dim() != 2 || positions.size(1) != gamma + 1 ||
      fed_positions.sizes() != positions.sizes() || positions.size(0) != tokens.size(0)) {
    return {};
  }
  const int64_t rows = tokens.size(0), width = tokens.size(1);
  const at::ScalarType law_type = laws[0].scalar_type();
  if (law_type != at::kFloat && law_type != at::kDouble) return {};
  for (int64_t i = 0; i < gamma; ++i) {
    const at::Tensor& column = draft_columns[i];
    const at::Tensor& law = laws[i];
    if (!on_cpu({&column}, at::kLong) || column.dim() != 2 || column.size(0) != rows || column.size(1) != 1 ||
        !on_cpu({&law}, law_type) || law.dim() != 2 || law.sizes() != laws[0].sizes() ||
        law.size(0) != rows) {
      return {};
    }
  }
  const auto to = positions.accessor<int64_t, 2>();
  const auto from = fed_positions.accessor<int64_t, 2>();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t i = 0; i <= gamma; ++i) {
      if ((i < gamma && (to[b][i] < 0 || to[b][i] >= width)) || from[b][i] < 0 || from[b][i] >= width) return {};
    }
  }
  // torch.cat of the drafts, torch.stack of the laws, scatter_ of the drafts into the buffer, then its gather.
  const int64_t width_v = laws[0].size(1);
  at::Tensor drafts = at::empty({rows, gamma}, tokens.options()), fed = at::empty({rows, gamma + 1}, tokens.options());
  at::Tensor stacked = at::empty({rows, gamma, width_v}, laws[0].options());
  if (stacked.scalar_type() == at::kFloat) {
    stack_laws<float>(laws, stacked);
  } else {
    stack_laws<double>(laws, stacked);
  }
  auto buffer = tokens.accessor<int64_t, 2>();
  int64_t* drafted = drafts.data_ptr<int64_t>();
  int64_t* fed_at = fed.data_ptr<int64_t>();
  for (int64_t i = 0; i < gamma; ++i) {
    const auto column = draft_columns[i].accessor<int64_t, 2>();
    for (int64_t b = 0; b < rows; ++b) drafted[b * gamma + i] = column[b][0];
  }
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t i = 0; i < gamma; ++i) buffer[b][to[b][i]] = drafted[b * gamma + i];
    for (int64_t i = 0; i <= gamma; ++i) fed_at[b * (gamma + 1) + i] = buffer[b][from[b][i]];
  }
  return {drafts, stacked, fed};
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

// See kernels.h.
bool fold_prefix_rounds(const std::vector<at::Tensor>& rows, const std::vector<at::Tensor>& positions,
                        const std::vector<at::Tensor>& n_drafted, const std::vector<at::Tensor>& n_accepted,
                        at::Tensor& rounds, at::Tensor& drafted, at::Tensor& accepted, at::Tensor& per_position,
                        at::Tensor& timeline_drafted, at::Tensor& timeline_accepted) {
  const size_t kept = rows.size();
  if (positions.size() != kept || n_drafted.size() != kept || n_accepted.size() != kept ||
      !on_cpu({&rounds, &drafted, &accepted, &per_position, &timeline_drafted, &timeline_accepted}, at::kLong) ||
      rounds.dim() != 1 || drafted.dim() != 1 || accepted.dim() != 1 || per_position.dim() != 2 ||
      timeline_drafted.dim() != 2 || timeline_accepted.dim() != 2) {
    return false;
  }
  const int64_t batch = rounds.size(0), width = timeline_drafted.size(1);
  if (drafted.size(0) != batch || accepted.size(0) != batch || per_position.size(0) != batch ||
      timeline_drafted.size(0) != batch || timeline_accepted.sizes() != timeline_drafted.sizes()) {
    return false;
  }
  // Every round checked before any is folded: nothing is written unless every one is served.
  for (size_t k = 0; k < kept; ++k) {
    const at::Tensor &r = rows[k], &p = positions[k], &d = n_drafted[k], &a = n_accepted[k];
    if (!on_cpu({&r, &p, &d, &a}, at::kLong) || r.dim() != 1 || p.dim() != 2 || d.dim() != 1 || a.dim() != 1 ||
        p.size(0) != r.size(0) || d.size(0) != r.size(0) || a.size(0) != r.size(0)) {
      return false;
    }
    const auto row = r.accessor<int64_t, 1>();
    const auto position = p.accessor<int64_t, 2>();
    for (int64_t i = 0; i < r.size(0); ++i) {
      if (row[i] < 0 || row[i] >= batch) return false;
      for (int64_t s = 0; s < p.size(1); ++s) {
        if (position[i][s] < 0 || position[i][s] >= width) return false;
      }
    }
  }
  auto round_count = rounds.accessor<int64_t, 1>();
  auto drafted_count = drafted.accessor<int64_t, 1>();
  auto accepted_count = accepted.accessor<int64_t, 1>();
  auto per_slot = per_position.accessor<int64_t, 2>();
  auto drafted_at = timeline_drafted.accessor<int64_t, 2>();
  auto accepted_at = timeline_accepted.accessor<int64_t, 2>();
  const int64_t counted_slots = per_position.size(1);
  for (size_t k = 0; k < kept; ++k) {
    const auto row = rows[k].accessor<int64_t, 1>();
    const auto position = positions[k].accessor<int64_t, 2>();
    const auto n_d = n_drafted[k].accessor<int64_t, 1>();
    const auto n_a = n_accepted[k].accessor<int64_t, 1>();
    const int64_t slots = positions[k].size(1);
    for (int64_t i = 0; i < rows[k].size(0); ++i) {
      const int64_t b = row[i];
      round_count[b] += 1;
      drafted_count[b] += n_d[i];
      for (int64_t s = 0; s < slots; ++s) {
        const int64_t was_drafted = s < n_d[i], was_accepted = s < n_a[i];
        accepted_count[b] += was_accepted;
        if (s < counted_slots) per_slot[b][s] += was_accepted;
        drafted_at[b][position[i][s]] += was_drafted;
        accepted_at[b][position[i][s]] += was_accepted;
      }
    }
  }
  return true;
}
