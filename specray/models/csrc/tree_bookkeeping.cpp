// A static tree round's bookkeeping on a CPU, one call each: the round's slots, positions and attention masks, its
// uniforms per node, and its commit (the accepted path's tokens and the correction / bonus into the rows' token
// buffer, the target's K/V of the path moved to its sequence positions, the root's and the path's hidden states
// kept, the new committed lengths). The values of specray/methods/discrete/eagle_loop.py's torch operations (about
// 60 of them a round, ~0.2 ms at batch 1): integer sums, comparisons and copies, and the uniforms' hash (splitmix.h:
// integer arithmetic and an exact conversion to a double), so the same values.
#include "kernels.h"
#include "splitmix.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>

// See kernels.h.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_masks(
    const at::Tensor& n_rows, const at::Tensor& depths, const at::Tensor& tree_visible, int64_t span, int64_t window) {
  if (!on_cpu({&n_rows, &depths}, at::kLong) || !on_cpu({&tree_visible}, at::kBool) || n_rows.dim() != 1 ||
      depths.dim() != 1 || tree_visible.dim() != 2 ||
      tree_visible.size(0) != depths.size(0) || tree_visible.size(1) != depths.size(0) || window < 1) {
    return {};
  }
  const int64_t rows = n_rows.size(0), nodes = depths.size(0);
  const auto n = n_rows.accessor<int64_t, 1>();
  for (int64_t i = 0; i < rows; ++i) {
    if (n[i] < 0 || n[i] + nodes > span) return {};  // every node's slot n + v within the span
  }
  const auto longs = n_rows.options();
  const auto bools = longs.dtype(at::kBool);
  at::Tensor slots = at::empty({rows, nodes}, longs), positions = at::empty({rows, nodes}, longs);
  at::Tensor visible = at::empty({rows, nodes, span}, bools), head_visible = at::empty({rows, nodes, span}, bools);
  at::Tensor catch_positions = at::empty({rows, window}, longs);
  at::Tensor catch_visible = at::empty({rows, window, span}, bools);
  const auto depth = depths.accessor<int64_t, 1>();
  const auto seen = tree_visible.accessor<bool, 2>();
  int64_t* slot = slots.data_ptr<int64_t>();
  int64_t* position = positions.data_ptr<int64_t>();
  bool* mask = visible.data_ptr<bool>();
  bool* head_mask = head_visible.data_ptr<bool>();
  int64_t* catch_position = catch_positions.data_ptr<int64_t>();
  bool* catch_mask = catch_visible.data_ptr<bool>();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t v = 0; v < nodes; ++v) {
      // Node v (slot n + v, position n + depth(v)) sees the committed slots 0 .. n - 1 and its own root path.
      slot[i * nodes + v] = n[i] + v;
      position[i * nodes + v] = n[i] + depth[v];
      bool* row = mask + (i * nodes + v) * span;
      for (int64_t s = 0; s < span; ++s) {
        const int64_t j = s - n[i];
        row[s] = j < 0 || (j < nodes && seen[v][j]);
      }
      bool* head_row = head_mask + (i * nodes + v) * span;
      std::memcpy(head_row, row, span * sizeof(bool));
      head_row[0] = false;  // the head has no position 0
    }
    for (int64_t w = 0; w < window; ++w) {
      // The catch-up's positions n - window + 1 .. n, clamped at 1; each sees slots 1 .. its position.
      const int64_t at = std::max<int64_t>(n[i] - window + 1 + w, 1);
      catch_position[i * window + w] = at;
      bool* row = catch_mask + (i * window + w) * span;
      for (int64_t s = 0; s < span; ++s) row[s] = s >= 1 && s <= at;
    }
  }
  return {slots, positions, visible, head_visible, catch_positions, catch_visible};
}

// See kernels.h.
std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_uniforms(const at::Tensor& stream_hashes, int64_t step,
                                                             const at::Tensor& idx, const at::Tensor& n,
                                                             const at::Tensor& offset, const at::Tensor& rank) {
  if (!on_cpu({&stream_hashes, &idx, &n, &offset, &rank}, at::kLong) || stream_hashes.dim() != 2 ||
      stream_hashes.size(1) != 3 || idx.dim() != 1 || n.sizes() != idx.sizes() || offset.dim() != 1 ||
      rank.sizes() != offset.sizes() || offset.size(0) < 2) {
    return {};
  }
  const int64_t r = idx.size(0), columns = offset.size(0);
  const auto row = idx.accessor<int64_t, 1>();
  const auto length = n.accessor<int64_t, 1>();
  const auto shift = offset.accessor<int64_t, 1>();
  const auto place = rank.accessor<int64_t, 1>();
  for (int64_t v = 0; v < columns; ++v) {
    if (shift[v] < 0 || place[v] < 0) return {};
  }
  for (int64_t b = 0; b < r; ++b) {
    if (row[b] < 0 || row[b] >= stream_hashes.size(0) || length[b] < 0) return {};
  }
  const auto h = stream_hashes.accessor<int64_t, 2>();
  const auto doubles = stream_hashes.options().dtype(at::kDouble);
  at::Tensor draft = at::empty({r, columns}, doubles), accept = at::empty({r, columns - 1}, doubles);
  at::Tensor residual = at::empty({r}, doubles);
  double* d = draft.data_ptr<double>();
  double* a = accept.data_ptr<double>();
  double* res = residual.data_ptr<double>();
  for (int64_t b = 0; b < r; ++b) {
    // Node v's keys: position n + offset[v], the round, index rank[v]; the streams draft, accept, residual.
    const auto stream = h[row[b]];
    for (int64_t v = 0; v < columns; ++v) {
      const int64_t position = length[b] + shift[v];
      d[b * columns + v] = splitmix64::uniform_at(static_cast<uint64_t>(stream[0]), position, step, place[v]);
      if (v + 1 < columns) {
        a[b * (columns - 1) + v] = splitmix64::uniform_at(static_cast<uint64_t>(stream[1]), position, step, place[v]);
      }
      if (v == 0) res[b] = splitmix64::uniform_at(static_cast<uint64_t>(stream[2]), position, step, place[v]);
    }
  }
  return {draft, accept, residual};
}

// See kernels.h. Every index is checked before anything is written.
at::Tensor tree_commit(at::Tensor& keys, at::Tensor& values, at::Tensor& features, at::Tensor& row_tokens,
                       const at::Tensor& cache_rows, const at::Tensor& n, const at::Tensor& n_accepted,
                       const at::Tensor& path, const at::Tensor& next_token, const at::Tensor& node_tokens,
                       const at::Tensor& hidden) {
  if (!on_cpu({&keys, &values, &features, &hidden}, at::kFloat) ||
      !on_cpu({&row_tokens, &cache_rows, &n, &n_accepted, &path, &next_token, &node_tokens}, at::kLong)) {
    return {};
  }
  if (keys.dim() != 5 || values.sizes() != keys.sizes() || !keys.is_contiguous() || !values.is_contiguous() ||
      features.dim() != 3 || !features.is_contiguous() || row_tokens.dim() != 2 || cache_rows.dim() != 1 ||
      n.dim() != 1 || n_accepted.dim() != 1 || path.dim() != 2 || next_token.dim() != 1 || node_tokens.dim() != 2 ||
      hidden.dim() != 3 || hidden.stride(2) != 1) {
    return {};
  }
  const int64_t r = n.size(0), rows = cache_rows.size(0), depth = path.size(1), nodes = hidden.size(1);
  const int64_t D = hidden.size(2), R = keys.size(1), S = keys.size(3), T = row_tokens.size(1);
  if (r < 1 || (rows != r && rows != 2 * r) || hidden.size(0) != rows || n_accepted.size(0) != r ||
      path.size(0) != r || next_token.size(0) != r || node_tokens.size(0) != r || node_tokens.size(1) < nodes ||
      row_tokens.size(0) != r || features.size(2) != D || depth < 1) {
    return {};
  }
  const auto cache_row = cache_rows.accessor<int64_t, 1>();
  const auto length = n.accessor<int64_t, 1>();
  const auto accepted = n_accepted.accessor<int64_t, 1>();
  const auto node = path.accessor<int64_t, 2>();
  for (int64_t i = 0; i < rows; ++i) {
    if (cache_row[i] < 0 || cache_row[i] >= R || cache_row[i] >= features.size(0)) return {};
  }
  for (int64_t b = 0; b < r; ++b) {
    // Slots n .. n + depth (the root's and the path's destinations) and the nodes' slots n + v inside the cache and
    // the features; token positions n .. n + depth inside the buffer.
    const int64_t last_slot = length[b] + std::max(depth, nodes - 1);
    if (length[b] < 0 || last_slot >= S || last_slot >= features.size(1) || length[b] + depth >= T ||
        accepted[b] < 0 || accepted[b] > depth) {
      return {};
    }
    for (int64_t t = 0; t < depth; ++t) {
      if (node[b][t] < 0 || node[b][t] >= nodes) return {};
    }
  }

  // K/V, first (move_slots writes nothing where it refuses): accepted depth t's node slot n + path[t] moves to slot
  // n + 1 + t in every layer and head; a rejected depth moves onto itself.
  at::Tensor source = at::empty({rows, depth}, n.options()), dest = at::empty({rows, depth}, n.options());
  int64_t* from_slot = source.data_ptr<int64_t>();
  int64_t* to_slot = dest.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t b = i % r;
    for (int64_t t = 0; t < depth; ++t) {
      to_slot[i * depth + t] = length[b] + 1 + t;
      from_slot[i * depth + t] = t < accepted[b] ? length[b] + node[b][t] : length[b] + 1 + t;
    }
  }
  if (!move_slots(keys, cache_rows, source, dest)) return {};
  TORCH_INTERNAL_ASSERT(move_slots(values, cache_rows, source, dest), "values laid out unlike keys");

  // Tokens: accepted depth t to image token n + t; a rejected depth's token to the scratch token n + depth (the last
  // one written stays, as torch's scatter leaves it); the correction / bonus at n + n_accepted.
  auto tokens = row_tokens.accessor<int64_t, 2>();
  const auto drafted = node_tokens.accessor<int64_t, 2>();
  const auto next = next_token.accessor<int64_t, 1>();
  at::Tensor committed = at::empty({r}, n.options());
  auto new_length = committed.accessor<int64_t, 1>();
  for (int64_t b = 0; b < r; ++b) {
    for (int64_t t = 0; t < depth; ++t) {
      tokens[b][t < accepted[b] ? length[b] + t : length[b] + depth] = drafted[b][node[b][t]];
    }
    tokens[b][length[b] + accepted[b]] = next[b];
    new_length[b] = length[b] + accepted[b] + 1;
  }

  // Hidden states: the root's at slot n; depth t's node's (accepted or not) at n + 1 + t.
  float* kept = features.data_ptr<float>();
  const float* out = hidden.data_ptr<float>();
  const int64_t slot_stride = features.size(1) * D;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t b = i % r;
    float* row = kept + cache_row[i] * slot_stride;
    const float* from = out + i * hidden.stride(0);
    std::memcpy(row + length[b] * D, from, D * sizeof(float));
    for (int64_t t = 0; t < depth; ++t) {
      std::memcpy(row + (length[b] + 1 + t) * D, from + node[b][t] * hidden.stride(1), D * sizeof(float));
    }
  }
  return committed;
}
