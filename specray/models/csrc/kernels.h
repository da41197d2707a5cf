// specray's CPU kernels for the discrete models' decode steps and verify calls, the speculative rounds, the
// diffusion rounds' drafted states and the draws' hash, one extension
// (specray/models/cpu_kernels.py builds it; bindings.cpp exposes these to Python).
#pragma once
// Only the ATen headers the kernels use: torch/extension.h (all of torch and pybind11) costs ~30 s of
// compiling per file; bindings.cpp, the one file that needs pybind11, includes torch/python.h.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>

// Whether every tensor is on the CPU, and (with a type) of that scalar type: the kernels' argument checks.
inline bool on_cpu(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (!t->device().is_cpu()) return false;
  }
  return true;
}

inline bool on_cpu(std::initializer_list<const at::Tensor*> tensors, at::ScalarType type) {
  for (const at::Tensor* t : tensors) {
    if (!t->device().is_cpu() || t->scalar_type() != type) return false;
  }
  return true;
}

// Attention over a KV cache with the values of torch's CPU flash-attention kernel (decode_attention.cpp);
// an undefined tensor where the call is not one it serves (a block off the alignment the summation orders were
// read at, a bool mask, a span the softmax's lanes do not divide).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scale);
// Which BLAS orders decode_attention's one-query calls follow, process-wide: 0 MKL's AVX2 path's, 1 its AVX-512's.
void set_one_query_orders(int64_t orders);
int64_t get_one_query_orders();

// K or V of n consecutive positions per row copied into a head-major cache (cache_write.cpp); false, with
// nothing written, where the call is not one it serves.
bool write_blocks(at::Tensor& storage, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& starts);

// K or V slots moved within a head-major cache, every layer at once (cache_write.cpp): a tree round's accepted path
// to its sequence positions; false, with nothing moved, where the call is not one it serves.
bool move_slots(at::Tensor& storage, const at::Tensor& rows, const at::Tensor& source, const at::Tensor& dest);

// A discrete round's uniforms [r, k, S] float64 (chain_bookkeeping.cpp) of the samples idx [r] at positions [r, k]
// in round step, from the samples' stream hashes stream_hashes [B, S] (rng.stream_hash): stream s's
// rng.uniform_at(rng.extend_hash(hash, position, step)). Undefined where the call is not one it serves (a row or a
// position out of range).
at::Tensor round_uniforms(const at::Tensor& stream_hashes, const at::Tensor& idx, const at::Tensor& positions,
                          int64_t step);

// A draft GPT's speculative round where every row of the batch takes part (chain_bookkeeping.cpp), with the values
// of specray/methods/discrete/loop.py's torch operations: from the committed lengths n [B], the rows' hashes of the
// streams draft, accept, residual stream_hashes [B, 3] (rng.stream_hash), the round's index step and the token buffer
// tokens [B, T], positions n + i and fed positions n + i - 1 [B, gamma + 1], the uniforms u_draft and u_accept
// [B, gamma] (keyed by positions n .. n + gamma - 1 and step) and u_residual [B] (position n), float64; and, given
// tokens, the draft calls' inputs: the first call's positions n - 1, n [B, 2] and tokens (image tokens n - 2, n - 1;
// undefined unless every n >= 2), the later calls' positions n + i [B, 1] (i = 1 .. gamma - 1) and the draft uniforms
// by column [B, 1] (without tokens: undefined and empty). Undefined tensors where the call is not one it serves.
using ChainPlan = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                             std::vector<at::Tensor>, std::vector<at::Tensor>>;
ChainPlan chain_plan(const at::Tensor& committed, int64_t gamma, const at::Tensor& stream_hashes, int64_t step,
                     const std::optional<at::Tensor>& tokens);

// Its verify call's inputs: the drafts draft_columns (gamma of [B, 1], int64) and their laws (gamma of [B, V]) stacked
// to [B, gamma] and [B, gamma, V], the drafts written into tokens [B, T] at positions [B, gamma + 1]'s first gamma,
// and the tokens then at fed_positions [B, gamma + 1]. Undefined tensors, with nothing written, where the call is not
// one it serves.
std::tuple<at::Tensor, at::Tensor, at::Tensor> chain_verify_inputs(const std::vector<at::Tensor>& draft_columns,
                                                                   const std::vector<at::Tensor>& laws,
                                                                   at::Tensor& tokens, const at::Tensor& positions,
                                                                   const at::Tensor& fed_positions);

// Its commit: tokens [B, T] take next_token [B] at n + n_accepted; the target's cache lengths [B or 2B] (the uncond
// rows after) n + n_accepted + 1, the draft's min(that, n + n_drafts); committed [B] (n, in place) n + n_accepted + 1.
// False, with nothing written, where the call is not one it serves.
bool chain_commit(at::Tensor& tokens, at::Tensor& committed, at::Tensor& target_lengths, at::Tensor& draft_lengths,
                  const at::Tensor& n_accepted, const at::Tensor& next_token, const at::Tensor& n_drafts);

// specray.methods.common.RoundTally's prefix rounds folded into its counters (chain_bookkeeping.cpp), the integer sums
// of its torch operations: round k's rows rows[k] [r] (batch rows), the token index of each draft slot positions[k]
// [r, G], the drafted and accepted counts n_drafted[k], n_accepted[k] [r]. A row takes one round, n_drafted drafts,
// the slots s < n_accepted accepted (per_position's first min(G, gamma) columns), and its timelines count the slots
// s < n_drafted drafted and s < n_accepted accepted at their positions. False, with nothing written, where a call is not
// one it serves (a tensor not int64 on a CPU, shapes that disagree, a row or a position outside the counters).
bool fold_prefix_rounds(const std::vector<at::Tensor>& rows, const std::vector<at::Tensor>& positions,
                        const std::vector<at::Tensor>& n_drafted, const std::vector<at::Tensor>& n_accepted,
                        at::Tensor& rounds, at::Tensor& drafted, at::Tensor& accepted, at::Tensor& per_position,
                        at::Tensor& timeline_drafted, at::Tensor& timeline_accepted);

// A static tree round's slots, positions and masks (tree_bookkeeping.cpp), with the values of
// specray/methods/discrete/eagle_loop.py's torch operations, for cache rows with committed lengths n_rows [rows] on
// the tree of depths [N + 1] and ancestor mask tree_visible [N + 1, N + 1] (node v sees node j): slots n + v and
// positions n + depth(v) [rows, N + 1]; visible [rows, N + 1, span] (the committed slots and the node's root path)
// and head_visible (the same without slot 0); the catch-up's positions max(n - window + 1 + w, 1) [rows, window] and
// its mask (slots 1 .. position) [rows, window, span]. Undefined tensors where the call is not one it serves.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_masks(
    const at::Tensor& n_rows, const at::Tensor& depths, const at::Tensor& tree_visible, int64_t span, int64_t window);

// A static tree round's uniforms per node (tree_bookkeeping.cpp), float64, from the batch rows' hashes of the streams
// draft, accept, residual stream_hashes [B, 3] (rng.stream_hash), the round's index step, samples idx [r] with
// committed lengths n [r], each column's position offset and rank [N + 2] int64: draft [r, N + 2], element rank of
// the draft stream's draw keyed by position n + offset and step; accept [r, N + 1] (the same but the last column, the
// accept stream) and residual [r] (column 0, the residual stream). Undefined tensors where the call is not one it
// serves.
std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_uniforms(const at::Tensor& stream_hashes, int64_t step,
                                                             const at::Tensor& idx, const at::Tensor& n,
                                                             const at::Tensor& offset, const at::Tensor& rank);

// A static tree round's commit (tree_bookkeeping.cpp), with the writes of specray/methods/discrete/eagle_loop.py's
// _commit_tree_torch: for samples b < r with committed length n [b], accepted count n_accepted [b] (<= depth), the
// path's node ids path [r, depth], the correction / bonus next_token [r] and the drafted node_tokens [r, >= N + 1],
// and cache rows cache_rows [rows] (rows = r, or 2r with the uncond rows after): row_tokens [r, T] take the path's
// tokens and next_token, keys and values [L, R, H, S, d] (head-major, contiguous float32) the accepted nodes' K/V
// moved from slot n + path[t] to n + 1 + t, features [R, S', D] (contiguous float32) hidden [rows, N + 1, D]'s root
// at slot n and depth t's node at n + 1 + t. Returns n + n_accepted + 1 [r]; an undefined tensor, with nothing
// written, where the call is not one it serves.
at::Tensor tree_commit(at::Tensor& keys, at::Tensor& values, at::Tensor& features, at::Tensor& row_tokens,
                       const at::Tensor& cache_rows, const at::Tensor& n, const at::Tensor& n_accepted,
                       const at::Tensor& path, const at::Tensor& next_token, const at::Tensor& node_tokens,
                       const at::Tensor& hidden);

// A discrete GPT's layers over its CPU KV cache in one call (cached_layers.cpp): the ATen operations of
// discrete_ar.TransformerBlock in eager float32 inference, on h [r, n, D], the complex rotary factor rope
// [r, n, 1, hd / 2], the mask [r, 1, n, span] (additive or bool) and each layer's K and V cache [R, S, H, hd].
// weights: per layer attention_norm (none: an EAGLE head's layer without one), wqkv, wo, ffn_norm, w1, w3, w2. The
// K/V go to slots start .. start + n - 1 of every row (write_kind 0), to consecutive slots from write_slots [r] of
// rows write_rows [r] (1), or to [write_rows [r, 1], write_slots [r, n]] (2); attention reads the rows read_rows
// (none: all). norm_kernel, attention_kernel: whether rms_norm and decode_attention serve (the caller checked).
// Returns h after the layers.
at::Tensor cached_layers(at::Tensor h, const at::Tensor& rope, const at::Tensor& mask,
                         const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                         const std::vector<std::optional<at::Tensor>>& weights, int64_t n_head, double eps,
                         bool norm_kernel, bool attention_kernel, int64_t write_kind, int64_t start,
                         const std::optional<at::Tensor>& write_rows, const std::optional<at::Tensor>& write_slots,
                         const std::optional<at::Tensor>& read_rows);

// A discrete GPT's cached forward in one call (cached_layers.cpp), DiscreteGPT._cached_layers' operations: the
// image tokens inputs [r, n] embedded by embedding (none: inputs are the embedded h [r, n, D]), the complex rotary
// factors of the positions [r, n] read from rope_table [L, hd / 2, 2], the mask (mask_is_table: rows of the table
// [slots, span] at the positions, else the mask itself), the layers (cached_layers, its arguments), the cache
// lengths of the rows read_rows (none: all) set to their last position + 1, the final norm (norm_weight, norm_eps)
// and the output layer. Returns the logits [r, n, V]; with softmax, CfgSoftmax's probabilities of them instead (with
// cfg_scale, of the rows' first half guided by their second: [r / 2, n, V]).
at::Tensor cached_step(const at::Tensor& inputs, const std::optional<at::Tensor>& embedding,
                       const at::Tensor& positions, const at::Tensor& rope_table, const at::Tensor& mask,
                       bool mask_is_table, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                       const std::vector<std::optional<at::Tensor>>& weights, int64_t n_head, double eps,
                       bool norm_kernel, bool attention_kernel, int64_t write_kind, int64_t start,
                       const std::optional<at::Tensor>& write_rows, const std::optional<at::Tensor>& write_slots,
                       const std::optional<at::Tensor>& read_rows, at::Tensor lengths, const at::Tensor& norm_weight,
                       double norm_eps, const at::Tensor& output, bool softmax, std::optional<double> cfg_scale);

// DiscreteGPT.forward_tree and its output layer in one call (cached_layers.cpp): the image tokens inputs [r, n]
// embedded by embedding (none: inputs are the embedded h), the rotary factors of the positions, the additive mask
// of visible [r, n, S] (bool), the layers with the K/V written at [write_rows [r, 1], write_slots [r, n]] and the
// rows read_rows read, the final norm: returns (its hidden states [r, n, D], their logits [r, n, V] or, with
// softmax, their probabilities as cached_step's).
std::tuple<at::Tensor, at::Tensor> tree_step(
    const at::Tensor& inputs, const std::optional<at::Tensor>& embedding, const at::Tensor& positions,
    const at::Tensor& rope_table, const at::Tensor& visible, const std::vector<at::Tensor>& keys,
    const std::vector<at::Tensor>& values, const std::vector<std::optional<at::Tensor>>& weights, int64_t n_head,
    double eps, bool norm_kernel, const at::Tensor& write_rows, const at::Tensor& write_slots,
    const std::optional<at::Tensor>& read_rows, const at::Tensor& norm_weight, double norm_eps,
    const at::Tensor& output, bool softmax, std::optional<double> cfg_scale);

// EagleHead.forward_cached and head_logits in one call (cached_layers.cpp): fc([embed(tokens), features]), its
// layer with the bool mask visible [r, n, S] and the writes and reads of tree_step: returns (the predicted hidden
// states [r, n, D], their logits by the target's output layer [r, n, V] or, with softmax, their probabilities as
// cached_step's).
std::tuple<at::Tensor, at::Tensor> head_step(
    const at::Tensor& tokens, const at::Tensor& features, const at::Tensor& embedding, const at::Tensor& fc_weight,
    const std::optional<at::Tensor>& fc_bias, const at::Tensor& positions, const at::Tensor& rope_table,
    const at::Tensor& visible, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
    const std::vector<std::optional<at::Tensor>>& weights, int64_t n_head, double eps, bool norm_kernel,
    const at::Tensor& write_rows, const at::Tensor& write_slots, const std::optional<at::Tensor>& read_rows,
    const at::Tensor& output, bool softmax, std::optional<double> cfg_scale);

// RMSNorm of float32 rows, (x * rsqrt(sum(x * x) / D + eps)) * weight, with the values of torch's operations
// (rms_norm.cpp); an undefined tensor where the call is not one it serves.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// An inverse-CDF draw per row of probs [rows, V] (float32 or float64, unit stride along V) with float64 uniforms
// u [rows] or [rows, 1], with the values of specray.rng.sample_categorical (rounds.cpp); an undefined tensor
// where the call is not one it serves.
at::Tensor sample_categorical(const at::Tensor& probs, const at::Tensor& u);

// One round's accepted counts, next tokens and accepted mask, with the values of the torch operations of
// specray/methods/discrete/rules.py (rounds.cpp); undefined tensors where the call is not one it serves.
// The chain rules sd (no omegas), cool_sd and uniform_rsd (omegas: the round's float64 multipliers):
std::tuple<at::Tensor, at::Tensor, at::Tensor> chain_round(const at::Tensor& P, const at::Tensor& Q,
                                                           const at::Tensor& drafts, const at::Tensor& u_accept,
                                                           const at::Tensor& u_residual,
                                                           const std::optional<at::Tensor>& omega);

// Block verification:
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_round(const at::Tensor& P, const at::Tensor& Q,
                                                           const at::Tensor& drafts, const at::Tensor& u_accept,
                                                           const at::Tensor& u_residual);

// LANTERN / LANTERN++ with the G* residual (neighbours [V, >= k] int64, nearest first):
std::tuple<at::Tensor, at::Tensor, at::Tensor> lantern_round(const at::Tensor& P, const at::Tensor& Q,
                                                             const at::Tensor& drafts, const at::Tensor& u_accept,
                                                             const at::Tensor& u_residual,
                                                             const at::Tensor& neighbours, int64_t k,
                                                             bool lambda_mode, double lam, double delta,
                                                             bool forbid_zero_target_mass);

// A static draft tree's round (tree_rounds.cpp) with the values of tree_rules.verify_tree's torch operations:
// (n_accepted [rows], path [rows, depth], next_token [rows]); undefined tensors where the call is not one it serves.
// The tree as tree_rules.TreeIndex's child_nodes, child_exists, internal_of, depths and path_to. sd (no omegas),
// cool_sd and uniform_rsd (omegas: the float64 multiplier of each internal node's children):
std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_round(const at::Tensor& P, const at::Tensor& Q,
                                                          const at::Tensor& tokens, const at::Tensor& valid,
                                                          const at::Tensor& u_accept, const at::Tensor& u_residual,
                                                          const at::Tensor& child_nodes,
                                                          const at::Tensor& child_exists,
                                                          const at::Tensor& internal_of, const at::Tensor& depths,
                                                          const at::Tensor& path_to,
                                                          const std::optional<at::Tensor>& omega);

// LANTERN++ on a tree, with the G* residual (neighbours [V, >= k] int64, nearest first):
std::tuple<at::Tensor, at::Tensor, at::Tensor> lantern_tree_round(
    const at::Tensor& P, const at::Tensor& Q, const at::Tensor& tokens, const at::Tensor& valid,
    const at::Tensor& u_accept, const at::Tensor& u_residual, const at::Tensor& child_nodes,
    const at::Tensor& child_exists, const at::Tensor& internal_of, const at::Tensor& depths, const at::Tensor& path_to,
    const at::Tensor& neighbours, int64_t k, bool lambda_mode, double lam, double delta, bool forbid_zero_target_mass);

// One tree level's children, drawn without replacement from the level's laws q [rows, L, V] (tree_rounds.cpp), with
// the values of eagle_loop.draw_children_torch: node_tokens and node_valid [rows, columns] written in place at the
// columns kids [slots, L] (parents [L]: the level's nodes); false, with nothing written, where it does not serve.
bool draw_children(const at::Tensor& q, const at::Tensor& u, at::Tensor& node_tokens, at::Tensor& node_valid,
                   const at::Tensor& parents, const at::Tensor& kids);

// The states a diffusion round drafts with a fixed eps, Y [n, G + 1, ...] from y0 [n, ...] (float32 or float64),
// coef [3, n, G] (A, B, sigma), eps [n, ...] and xi [n, G, ...] (float64), all contiguous, with the values of
// torch's operations (gaussian_draft.cpp); false, with nothing written, where the call is not one it serves.
bool draft_affine(at::Tensor& Y, const at::Tensor& y0, const at::Tensor& coef, const at::Tensor& eps,
                  const at::Tensor& xi);

// One step of a round whose eps comes from a draft model: slot j + 1 of the slot-major states S [G + 1, n, ...]
// (float32 or float64) from slot j, the model's eps [n, ...] (the state's dtype or float64), coef [3, n, G] and
// xi [n, G, ...] (float64), all contiguous, with the values of torch's operations (gaussian_draft.cpp); false, with
// nothing written, where the call is not one it serves.
bool draft_step(at::Tensor& S, int64_t j, const at::Tensor& coef, const at::Tensor& eps, const at::Tensor& xi);

// SplitMix64's finaliser of every element of an int64 CPU tensor, a new contiguous tensor with the bits of
// specray/rng.py's _mix (splitmix.cpp); an undefined tensor where the call is not one it serves.
at::Tensor splitmix(const at::Tensor& keys);

// rng.uniform of one draw per key (seed, sample id, stream, position, step), the sample ids, positions and steps int64
// CPU tensors broadcast together, from the seed's hash (rng.py's _mix_int) and the stream's id: the finalisers'
// integer arithmetic, so rng.py's values by construction (splitmix.cpp); an undefined tensor where the call is not
// one it serves.
at::Tensor keyed_uniforms(const at::Tensor& sample_ids, const at::Tensor& positions, const at::Tensor& steps,
                          int64_t seed_hash, int64_t stream);

// A speculative diffusion round's draws (round_draws.cpp), with the values of specray/methods/diffusion/cpu_draws.py's
// torch operations: from the streams' hashes [streams, batch] (draft, accept[, residual, residual_noise]; int64) of
// the round's batch rows rows [n], its index and every slot's step steps [n, G], the keys [streams, n, G], the
// normals [1 or 2, n, G, *shape] (float64; streams draft[, residual_noise]) and 1 - the uniforms [1 or 2, n, G]
// (streams accept[, residual]). Undefined tensors where the call is not one it serves.
std::tuple<at::Tensor, at::Tensor, at::Tensor> round_draws(const at::Tensor& hashes, const at::Tensor& rows,
                                                           int64_t index, const at::Tensor& steps,
                                                           const std::vector<int64_t>& shape, bool residual_noise);

// A full round's log density ratios for an affine chain (round_ratios.cpp), with the values of
// specray/methods/diffusion/cpu_ratios.py's torch operations: from coef [3, n, G, 1...] (A, B, sigma; float64), the
// draft eps eps_draft [n, 1 or G, ...] (float64), the target eps eps_target [n, G, ...] (float32 or float64) and the
// draft noise xi [n, G, ...] (float64): Delta [n, G, ...], log rho and delta [n, G] (float64).
// Undefined tensors where the call is not one it serves.
std::tuple<at::Tensor, at::Tensor, at::Tensor> round_ratios(const at::Tensor& coef, const at::Tensor& eps_draft,
                                                            const at::Tensor& eps_target, const at::Tensor& xi);

// Draws s ~ psi_alpha(.; delta) of the residual sampler, one per element of the float64 vectors delta, log_alpha
// and u (delta nonzero), with the bits of specray/methods/diffusion/residual.py's one-row Newton solve; constants
// (log 1/2, sqrt 1/2, log(2 pi) / 2, the tail bound 30) as residual.py has them (residual_draw.cpp). An undefined
// tensor where the call is not one it serves, or torch was built without the routines its kernels use.
at::Tensor psi_draws(const at::Tensor& delta, const at::Tensor& log_alpha, const at::Tensor& u,
                     const at::Tensor& constants);

// The verdicts of a diffusion round's token and block verification: tau [n] (int64), the cut's log weight [n], the
// expected advance [n] and (block) h [n, G+1] from float64 log_rho, delta and eta [n, G] and int64 g [n]
// (0 <= g <= G), with the values of specray/methods/diffusion/rules.py's tensor paths (verdicts.cpp); constants as
// for psi_draws. Undefined tensors where the call is not one it serves, or torch was built without the routines
// its kernels use.
std::tuple<at::Tensor, at::Tensor, at::Tensor> token_verdict(const at::Tensor& log_rho, const at::Tensor& delta,
                                                             const at::Tensor& g, const at::Tensor& eta,
                                                             double delta_min);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_verdict(const at::Tensor& log_rho,
                                                                         const at::Tensor& delta, const at::Tensor& g,
                                                                         const at::Tensor& eta,
                                                                         const at::Tensor& constants, double delta_min);

// A diffusion round's resampled states: rows r of state x and target eps [r, ...] (float32 or float64), the steps'
// coef [3, r] (A, B, sigma), Delta and the residual's noise zeta [r, ...] and log_alpha, u [r] (float64), with the
// values of specray/methods/diffusion/loop.py's _mean (affine) and residual.py's sample_residual, in float64, shaped
// like x (residual_draw.cpp). An undefined tensor where the call is not one it serves.
at::Tensor residual_states(const at::Tensor& x, const at::Tensor& eps, const at::Tensor& coef, const at::Tensor& Delta,
                           const at::Tensor& log_alpha, const at::Tensor& u, const at::Tensor& zeta,
                           const at::Tensor& constants, double delta_min);

// The same rounds' states where a rejected draft is reflected instead (token verification's default): xi [r, ...]
// (float64) the rejected draft's noise, with the values of loop.py's _mean (affine) and residual.py's reflect.
at::Tensor reflected_states(const at::Tensor& x, const at::Tensor& eps, const at::Tensor& coef, const at::Tensor& Delta,
                            const at::Tensor& xi, double delta_min);

// A diffusion round's slots where every row drafts gamma steps (round_slots.cpp): from the rows' steps k [n] (int64)
// and the chain's tables [3, K] (A, B, sigma; float64), each slot's step k + j [n, gamma] and its coefficients
// [3, n, gamma], the values of specray/methods/diffusion/loop.py's _slots_from_host. Undefined tensors where a row
// has fewer than gamma steps left (or is done), or the call is not one it serves.
std::tuple<at::Tensor, at::Tensor> full_round_slots(const at::Tensor& k, int64_t gamma, const at::Tensor& tables);

// A full round's work after its verify call on an affine chain (round_commit.cpp): round_ratios, then token_verdict or
// block_verdict (block), then the cut rows' new states by residual_states (u [n, G] and zeta [n, G, ...] given, the
// residual sampler's draws; log alpha 0 where alpha_one) or reflected_states, from round_ratios' inputs, the coins eta
// [n, G], the drafted states Y [n, G + 1, ...] (E's dtype), the rows' steps kk and block lengths g [n] (int64, all G).
// Returns the new states [n, ...] (E's dtype), the Free drafter's eps (with_stale; else undefined), the next steps,
// tau and the expected advance, with the values of specray/methods/diffusion/loop.py's _commit_tensors; an empty list
// where the call is not one it serves.
std::vector<at::Tensor> round_commit(const at::Tensor& coef, const at::Tensor& eps_draft, const at::Tensor& E,
                                     const at::Tensor& xi, const at::Tensor& eta, const at::Tensor& Y,
                                     const at::Tensor& kk, const at::Tensor& g, bool block,
                                     const std::optional<at::Tensor>& u, const std::optional<at::Tensor>& zeta,
                                     bool alpha_one, bool with_stale, const at::Tensor& constants, double delta_min);
