// The Python bindings of specray's CPU kernels (declared in kernels.h).
#include <torch/python.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "attention over a CPU KV cache with torch's values (heads of 16)");
  m.def("set_one_query_orders", &set_one_query_orders, "the BLAS orders of decode_attention's one-query calls "
        "(0: MKL's AVX2 path, 1: its AVX-512 path)");
  m.def("get_one_query_orders", &get_one_query_orders, "the orders set_one_query_orders set last (0 at first)");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows with the values of torch's operations");
  m.def("sample_categorical", &sample_categorical, "inverse-CDF draws with the values of specray.rng");
  m.def("chain_round", &chain_round, "a chain rule's round (sd, cool_sd, uniform_rsd) with torch's values",
        py::arg("P"), py::arg("Q"), py::arg("drafts"), py::arg("u_accept"), py::arg("u_residual"),
        py::arg("omegas") = py::none());
  m.def("block_round", &block_round, "block verification's round with the values of torch's operations");
  m.def("lantern_round", &lantern_round, "LANTERN's round (G* residual) with the values of torch's operations");
  m.def("tree_round", &tree_round, "a static tree's round (sd, cool_sd, uniform_rsd) with torch's values",
        py::arg("P"), py::arg("Q"), py::arg("tokens"), py::arg("valid"), py::arg("u_accept"), py::arg("u_residual"),
        py::arg("child_nodes"), py::arg("child_exists"), py::arg("internal_of"), py::arg("depths"),
        py::arg("path_to"), py::arg("omegas") = py::none());
  m.def("lantern_tree_round", &lantern_tree_round, "LANTERN++'s tree round (G* residual) with torch's values");
  m.def("draw_children", &draw_children, "a tree level's children draws with the values of torch's operations");
  m.def("cached_layers", &cached_layers, "a discrete GPT's layers over its CPU KV cache with the values of torch's "
        "operations");
  m.def("cached_step", &cached_step, "a discrete GPT's cached forward from its inputs to its logits with the values "
        "of torch's operations");
  m.def("tree_step", &tree_step, "a discrete GPT's tree call and its logits with the values of torch's operations");
  m.def("head_step", &head_step, "an EAGLE head's cached call and its logits with the values of torch's operations");
  m.def("write_blocks", &write_blocks, "K/V of consecutive positions per row into a head-major CPU cache");
  m.def("move_slots", &move_slots, "K/V slots moved within a head-major CPU cache, every layer at once");
  m.def("chain_plan", &chain_plan, "a draft GPT's round's positions, uniforms and draft calls' inputs, every row "
        "taking part");
  m.def("round_uniforms", &round_uniforms, "a discrete round's uniforms at its rows' positions, from their stream "
        "hashes");
  m.def("chain_verify_inputs", &chain_verify_inputs, "a draft GPT's round's verify call's inputs, every row taking "
        "part");
  m.def("chain_commit", &chain_commit, "a draft GPT's round's commit: the next token, the caches' lengths");
  m.def("fold_prefix_rounds", &fold_prefix_rounds, "a round tally's prefix rounds folded into its counters");
  m.def("tree_masks", &tree_masks, "a static tree round's slots, positions and attention masks");
  m.def("tree_uniforms", &tree_uniforms, "a static tree round's uniforms per node");
  m.def("tree_commit", &tree_commit, "a static tree round's commit: tokens, the path's K/V and hidden states");
  m.def("splitmix", &splitmix, "SplitMix64's finaliser of int64 keys with the bits of specray.rng");
  m.def("keyed_uniforms", &keyed_uniforms, "specray.rng.uniform's one draw per key, every key field in one call");
  m.def("draft_affine", &draft_affine, "a diffusion round's drafted states with a fixed eps, torch's values");
  m.def("draft_step", &draft_step, "a diffusion round's drafted state from a draft model's eps, torch's values");
  m.def("round_draws", &round_draws, "a diffusion round's keys, normals and uniforms with the values of torch's "
        "operations");
  m.def("round_ratios", &round_ratios, "a diffusion round's Delta and log ratios with the values of torch's "
        "operations");
  m.def("psi_draws", &psi_draws, "the residual sampler's 1-D draws with the bits of its one-row Newton solve");
  m.def("residual_states", &residual_states, "a diffusion round's resampled states with the values of torch's operations");
  m.def("reflected_states", &reflected_states, "a diffusion round's reflected states with the values of torch's operations");
  m.def("token_verdict", &token_verdict, "a diffusion round's token verification with the values of torch's operations");
  m.def("block_verdict", &block_verdict, "a diffusion round's block verification with the values of torch's operations");
  m.def("full_round_slots", &full_round_slots, "a diffusion round's slot steps and coefficients, every row drafting "
        "gamma steps");
  m.def("round_commit", &round_commit, "a diffusion round's ratios, verdict, new states and next steps in one call");
}
