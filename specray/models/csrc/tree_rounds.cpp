// A static draft tree's round decision and one tree level's children draws, on a CPU in one call each, with the
// values of the torch operations of specray/methods/discrete/tree_rules.py (verify_tree: recursive rejection
// without replacement, depth by depth, for sd, cool_sd, uniform_rsd and LANTERN with its G* residual) and of
// eagle_loop.draw_children_torch (children without replacement from the drafter's law). torch's decision scores
// every child of every internal node as if reached (about 60 operations a round) and a level's draws take about
// 8 operations per child slot, most of a tree round's time outside the model calls at batch 1; here a row walks
// its one path. specray/methods/discrete/cpu_tree_rounds.py compares each kernel with torch's operations before
// using it.
#include "kernels.h"
#include "round_math.h"

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

using namespace round_math;

namespace {

bool all_within(const at::Tensor& ids, int64_t low, int64_t high) {
  const at::Tensor flat = ids.contiguous();
  const int64_t* x = flat.data_ptr<int64_t>();
  for (int64_t e = 0; e < flat.numel(); ++e) {
    if (x[e] < low || x[e] >= high) return false;
  }
  return true;
}

// The tree as tree_rules.TreeIndex holds it: child_nodes / child_exists [I, C] (children in drafting order),
// internal_of [N + 1] (-1 for a leaf), depths [N + 1], path_to [N + 1, depth].
struct Tree {
  const at::Tensor &child_nodes, &child_exists, &internal_of, &depths, &path_to;
};

// What the tree round takes: P [rows, N + 1, V] and Q [rows, I, V] float32 contiguous with regular rows that have
// mass, 4 <= V < 256; tokens [rows, N + 1] int64 within V, valid [rows, N + 1] bool, u_accept [rows, N + 1] not
// negative and u_residual [rows] float64; the tree's tables consistent with those sizes; all on the CPU. (torch
// passes a child whose pass probability is 0, absent or not drafted, at a negative uniform; the walk skips them.)
bool serves_tree(const at::Tensor& P, const at::Tensor& Q, const at::Tensor& tokens, const at::Tensor& valid,
                 const at::Tensor& u_accept, const at::Tensor& u_residual, const Tree& tree) {
  if (P.dim() != 3 || Q.dim() != 3 || tokens.dim() != 2 || valid.dim() != 2 || u_accept.dim() != 2 ||
      u_residual.dim() != 1 || tree.child_nodes.dim() != 2 || tree.child_exists.dim() != 2 ||
      tree.internal_of.dim() != 1 || tree.depths.dim() != 1 || tree.path_to.dim() != 2) {
    return false;
  }
  if (!on_cpu({&P, &Q, &tokens, &valid, &u_accept, &u_residual, &tree.child_nodes, &tree.child_exists,
            &tree.internal_of, &tree.depths, &tree.path_to})) {
    return false;
  }
  const int64_t rows = P.size(0), nodes = P.size(1), n = P.size(2), internal = Q.size(1);
  const bool types = P.scalar_type() == at::kFloat && Q.scalar_type() == at::kFloat &&
                     tokens.scalar_type() == at::kLong && valid.scalar_type() == at::kBool &&
                     u_accept.scalar_type() == at::kDouble && u_residual.scalar_type() == at::kDouble &&
                     tree.child_nodes.scalar_type() == at::kLong && tree.child_exists.scalar_type() == at::kBool &&
                     tree.internal_of.scalar_type() == at::kLong && tree.depths.scalar_type() == at::kLong &&
                     tree.path_to.scalar_type() == at::kLong;
  if (!types) return false;
  const bool shapes = Q.size(0) == rows && Q.size(2) == n && tokens.size(0) == rows && tokens.size(1) == nodes &&
                      valid.size(0) == rows && valid.size(1) == nodes && u_accept.size(0) == rows &&
                      u_accept.size(1) == nodes && u_residual.size(0) == rows && internal >= 1 &&
                      tree.child_nodes.size(0) == internal && tree.child_exists.sizes() == tree.child_nodes.sizes() &&
                      tree.internal_of.size(0) == nodes && tree.depths.size(0) == nodes &&
                      tree.path_to.size(0) == nodes && n >= kMinWidth && n < kMaxWidth;
  if (!shapes || !P.is_contiguous() || !Q.is_contiguous()) return false;
  // torch's indexing raises on ids out of range: let it.
  if (!all_within(tokens, 0, n) || !all_within(tree.child_nodes, 0, nodes) ||
      !all_within(tree.internal_of, -1, internal) || !all_within(tree.path_to, 0, nodes)) {
    return false;
  }
  const auto ua = u_accept.accessor<double, 2>();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t v = 0; v < nodes; ++v) {
      if (ua[b][v] < 0.0) return false;
    }
  }
  return regular_rows(P) && regular_rows(Q);
}

using TreeOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // n_accepted [rows], path [rows, depth], next
const TreeOutputs kNotServed{at::Tensor(), at::Tensor(), at::Tensor()};

// The walk of tree_rules._verify_tree_impl given the relaxed target mass relax(p, x, i) of token x under the
// current law p at internal node i: at each internal node its children are tried in order, child c (drafted,
// and q without the earlier children still has mass) passing iff u < min(1, relax(p, c) / q_c(c)) with q_c that
// law normalised; a pass descends to c, a failure sets p to its residual [p - min(q_c, relax(p, .))]_+ normalised
// (p kept where it has no mass). The next token is drawn from p where the walk stops: the updated law after every
// child failed, or P itself at a leaf (the bonus).
template <typename Relax>
TreeOutputs decide_tree(const at::Tensor& P, const at::Tensor& Q, const at::Tensor& tokens, const at::Tensor& valid,
                        const at::Tensor& u_accept, const at::Tensor& u_residual, const Tree& tree,
                        const Relax& relax) {
  const int64_t rows = P.size(0), nodes = P.size(1), n = P.size(2), internal = Q.size(1);
  const int64_t children = tree.child_nodes.size(1), depth = tree.path_to.size(1);
  const auto options = tokens.options();
  at::Tensor n_accepted = at::empty({rows}, options), path = at::empty({rows, depth}, options),
             next_token = at::empty({rows}, options);
  const auto tok = tokens.accessor<int64_t, 2>();
  const auto drafted = valid.accessor<bool, 2>();
  const auto ua = u_accept.accessor<double, 2>();
  const auto ur = u_residual.accessor<double, 1>();
  const auto kids = tree.child_nodes.accessor<int64_t, 2>();
  const auto exists = tree.child_exists.accessor<bool, 2>();
  const auto internal_of = tree.internal_of.accessor<int64_t, 1>();
  const auto depths = tree.depths.accessor<int64_t, 1>();
  const auto path_to = tree.path_to.accessor<int64_t, 2>();
  double p[kMaxWidth], q_left[kMaxWidth], q_c[kMaxWidth], residual[kMaxWidth];
  for (int64_t b = 0; b < rows; ++b) {
    const float* pb = P.data_ptr<float>() + b * nodes * n;
    const float* qb = Q.data_ptr<float>() + b * internal * n;
    int64_t node = 0;
    for (;;) {
      normalised(pb + node * n, n, p);
      const int64_t i = internal_of[node];
      if (i < 0) break;  // a leaf: every drafted depth passed
      normalised(qb + i * n, n, q_left);
      int64_t passed = -1;
      for (int64_t c = 0; c < children && passed < 0; ++c) {
        const int64_t child = kids[i][c], token = tok[b][child];
        const double q_mass = torch_sum(q_left, n);
        if (!(exists[i][c] && drafted[b][child] && q_mass > 0.0)) continue;
        for (int64_t x = 0; x < n; ++x) q_c[x] = q_left[x] / q_mass;
        if (ua[b][child] < pass_probability(relax(p, token, i), q_c[token])) {
          passed = child;
          break;
        }
        for (int64_t x = 0; x < n; ++x) {
          const double cut = relax(p, x, i);
          residual[x] = p[x] - (cut < q_c[x] ? cut : q_c[x]);
        }
        if (clamp_positive(residual, n)) {
          const double mass = torch_sum(residual, n);
          for (int64_t x = 0; x < n; ++x) p[x] = residual[x] / mass;
        }
        q_left[token] = 0.0;
      }
      if (passed < 0) break;  // every child failed (or none was drafted): the correction from p
      if (depths[passed] <= depths[node]) return kNotServed;  // tables that are not a tree: torch's walk stops
      node = passed;
    }
    n_accepted.data_ptr<int64_t>()[b] = depths[node];
    int64_t* path_row = path.data_ptr<int64_t>() + b * depth;
    for (int64_t t = 0; t < depth; ++t) path_row[t] = path_to[node][t];
    next_token.data_ptr<int64_t>()[b] = draw(p, n, ur[b]);
  }
  return std::make_tuple(n_accepted, path, next_token);
}

}  // namespace

TreeOutputs tree_round(const at::Tensor& P, const at::Tensor& Q, const at::Tensor& tokens, const at::Tensor& valid,
                       const at::Tensor& u_accept, const at::Tensor& u_residual, const at::Tensor& child_nodes,
                       const at::Tensor& child_exists, const at::Tensor& internal_of, const at::Tensor& depths,
                       const at::Tensor& path_to, const std::optional<at::Tensor>& omega) {
  const Tree tree{child_nodes, child_exists, internal_of, depths, path_to};
  if (!serves_tree(P, Q, tokens, valid, u_accept, u_residual, tree)) return kNotServed;
  const at::Tensor omegas = omega.has_value() ? *omega : at::Tensor();
  if (omegas.defined() && !(omegas.device().is_cpu() && omegas.scalar_type() == at::kDouble && omegas.dim() == 1 &&
                            omegas.size(0) == Q.size(1) && omegas.is_contiguous() &&
                            regular(omegas.data_ptr<double>(), omegas.size(0)))) {
    return kNotServed;  // an infinite multiplier times a zero mass is NaN, which torch's operations carry
  }
  // sd: p(x) itself ([p - q]_+ is [p - min(q, p)]_+ bit for bit); cool_sd, uniform_rsd: w_i p(x), w of the node.
  const double* w = omegas.defined() ? omegas.data_ptr<double>() : nullptr;
  return decide_tree(P, Q, tokens, valid, u_accept, u_residual, tree,
                     [w](const double* p, int64_t x, int64_t i) { return w ? w[i] * p[x] : p[x]; });
}

TreeOutputs lantern_tree_round(const at::Tensor& P, const at::Tensor& Q, const at::Tensor& tokens,
                               const at::Tensor& valid, const at::Tensor& u_accept, const at::Tensor& u_residual,
                               const at::Tensor& child_nodes, const at::Tensor& child_exists,
                               const at::Tensor& internal_of, const at::Tensor& depths, const at::Tensor& path_to,
                               const at::Tensor& neighbours, int64_t k, bool lambda_mode, double lam, double delta,
                               bool forbid_zero_target_mass) {
  const Tree tree{child_nodes, child_exists, internal_of, depths, path_to};
  if (!serves_tree(P, Q, tokens, valid, u_accept, u_residual, tree)) return kNotServed;
  const int64_t n = P.size(2);
  if (k < 0 || (k > 0 && (!neighbours.device().is_cpu() || neighbours.scalar_type() != at::kLong ||
                          neighbours.dim() != 2 || neighbours.size(0) != n || neighbours.size(1) < k ||
                          !neighbours.is_contiguous() || !all_within(neighbours, 0, n)))) {
    return kNotServed;
  }
  const Relaxation relaxed{k > 0 ? neighbours.data_ptr<int64_t>() : nullptr, k > 0 ? neighbours.size(1) : 0, k,
                           lambda_mode, forbid_zero_target_mass, lam - 1.0, delta};
  return decide_tree(P, Q, tokens, valid, u_accept, u_residual, tree,
                     [&relaxed](const double* p, int64_t x, int64_t) { return relaxed(p, x); });
}

bool draw_children(const at::Tensor& q, const at::Tensor& u, at::Tensor& node_tokens, at::Tensor& node_valid,
                   const at::Tensor& parents, const at::Tensor& kids) {
  if (q.dim() != 3 || u.dim() != 2 || node_tokens.dim() != 2 || node_valid.dim() != 2 || parents.dim() != 1 ||
      kids.dim() != 2 || !on_cpu({&q, &u, &node_tokens, &node_valid, &parents, &kids})) {
    return false;
  }
  const bool floating = q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble;
  if (!floating || u.scalar_type() != at::kDouble || node_tokens.scalar_type() != at::kLong ||
      node_valid.scalar_type() != at::kBool || parents.scalar_type() != at::kLong || kids.scalar_type() != at::kLong) {
    return false;
  }
  const int64_t rows = q.size(0), level = q.size(1), n = q.size(2), columns = node_tokens.size(1);
  const bool shapes = u.size(0) == rows && u.size(1) == columns && node_tokens.size(0) == rows &&
                      node_valid.size(0) == rows && node_valid.size(1) == columns && parents.size(0) == level &&
                      kids.size(1) == level && q.stride(2) == 1 && n >= 1 && n <= kMaxWidth;
  if (!shapes || !all_within(parents, 0, columns) || !all_within(kids, 0, columns)) return false;
  const at::Tensor q64 = q.to(at::kDouble);  // q.to(float64), as torch's draws start; rows stay strided like q's
  const auto laws = q64.accessor<double, 3>();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t l = 0; l < level; ++l) {
      if (!regular(&laws[b][l][0], n)) return false;  // before any write: torch's operations then do it all
    }
  }
  const auto uniforms = u.accessor<double, 2>();
  auto tokens = node_tokens.accessor<int64_t, 2>();
  auto drawn = node_valid.accessor<bool, 2>();
  const auto parent = parents.accessor<int64_t, 1>();
  const auto kid = kids.accessor<int64_t, 2>();
  std::vector<double> left(level * n);
  std::vector<bool> parent_valid(level);
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t l = 0; l < level; ++l) {
      parent_valid[l] = drawn[b][parent[l]];  // read before the level's writes, as torch's index_select is
      for (int64_t x = 0; x < n; ++x) left[l * n + x] = laws[b][l][x];
    }
    // Slot by slot, as torch's loop: an absent child's writes land in the spare column, which nothing reads.
    for (int64_t s = 0; s < kids.size(0); ++s) {
      for (int64_t l = 0; l < level; ++l) {
        double* law = left.data() + l * n;
        const int64_t child = kid[s][l];
        double mass = 0.0;
        for (int64_t x = 0; x < n; ++x) mass += law[x];  // the running sum's last entry: cdf[-1]
        const int64_t token = draw(law, n, uniforms[b][child]);
        const bool taken = mass > 0.0 && parent_valid[l];
        tokens[b][child] = taken ? token : 0;
        drawn[b][child] = taken;
        law[token] = 0.0;
      }
    }
  }
  return true;
}
