// A discrete GPT's transformer layers over its KV cache on a CPU, in one call from Python: the ATen operations that
// discrete_ar.TransformerBlock runs in eager float32 inference, in the same order on the same arguments, so every
// value is the one the Python layers give. At batch 1 most of a layer's time is the dispatch of its ~33 operations,
// and about half of that is Python's (argument parsing, tensor wrapping, the modules' attribute lookups); here
// each operation costs only ATen's own dispatch. specray/models/discrete_ar.py (fused_layers) decides where this
// serves and passes in what the Python layers would choose per call: the rotary factor, the mask, how the K/V are
// written and read, and whether the norm and attention kernels serve.
#include "kernels.h"

#include <ATen/ops/_unsafe_view.h>
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/index_put.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/view_as_complex.h>
#include <ATen/ops/view_as_real.h>
#include <ATen/ops/where.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

// cpu_norm.torch_rms_norm's operations: the count and eps enter as 0-dim float32 tensors, as there.
at::Tensor torch_rms_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& count,
                          const at::Tensor& eps) {
  at::Tensor scale = at::sum(x.mul(x), {-1}, /*keepdim=*/true).div_(count).add_(eps).rsqrt_();
  return x.mul(scale).mul_(weight);
}

// at::linear(x, weight) without a bias as it runs on a CPU: matmul of x and weight.t(), x's leading dimensions
// folded into the rows of one mm. The same mm on the same arguments, so the same values, in four dispatched
// operations where linear makes nine (a batch-1 step of the digits draft makes six products, the target 61).
at::Tensor project(const at::Tensor& x, const at::Tensor& weight) {
  if (!weight.is_contiguous() || weight.dim() != 2 || x.dim() < 2) {
    return at::linear(x, weight);
  }
  const int64_t in = weight.size(1), out = weight.size(0);
  at::Tensor transposed = weight.as_strided({in, out}, {1, in}, weight.storage_offset());  // weight.t()
  if (x.dim() == 2) {
    return at::mm(x, transposed);
  }
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = out;
  // matmul's fold, x.reshape(-1, in): a view of a contiguous x (one operation where reshape dispatches two).
  at::Tensor rows = x.is_contiguous() ? x.view({-1, in}) : x.reshape({-1, in});
  return at::_unsafe_view(at::mm(rows, transposed), sizes);
}

// cache[rows, slots] = x, torch's indexed write (index_put_ without accumulation).
void write_at(at::Tensor& cache, const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& x) {
  c10::List<std::optional<at::Tensor>> index;
  index.push_back(rows);
  index.push_back(slots);
  cache.index_put_(index, x);
}

struct Norm {
  bool kernel;  // the kernel serves this width (cpu_norm.kernel checked it)
  double eps;
  at::Tensor count, eps_tensor;

  // The norm of rows of `width` floats: the count and eps as the 0-dim float32 tensors torch_rms_norm takes.
  static Norm of(bool kernel, double eps, int64_t width) {
    return {kernel, eps, at::scalar_tensor(static_cast<double>(width), at::kFloat), at::scalar_tensor(eps, at::kFloat)};
  }

  at::Tensor operator()(const at::Tensor& x, const at::Tensor& weight) const {
    if (kernel && x.is_contiguous()) {
      at::Tensor out = rms_norm(x, weight, eps);
      if (out.defined()) return out;
    }
    return torch_rms_norm(x, weight, count, eps_tensor);
  }
};

}  // namespace

at::Tensor cached_layers(at::Tensor h, const at::Tensor& rope, const at::Tensor& mask,
                         const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                         const std::vector<std::optional<at::Tensor>>& weights, int64_t n_head, double eps,
                         bool norm_kernel, bool attention_kernel, int64_t write_kind, int64_t start,
                         const std::optional<at::Tensor>& write_rows, const std::optional<at::Tensor>& write_slots,
                         const std::optional<at::Tensor>& read_rows) {
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(values.size() == keys.size() && weights.size() == static_cast<size_t>(7 * layers),
              "cached_layers: 7 weights and one K and one V cache per layer");
  const int64_t r = h.size(0), n = h.size(1), d = h.size(2), head_dim = d / n_head;
  const Norm norm = Norm::of(norm_kernel, eps, d);
  const int64_t span = mask.size(-1);
  const double scale = std::pow(static_cast<double>(head_dim), -0.5);
  for (int64_t i = 0; i < layers; ++i) {
    // attention_norm (none: an EAGLE head's layer without one), wqkv, wo, ffn_norm, w1, w3, w2
    const std::optional<at::Tensor>* w = &weights[7 * i];
    at::Tensor k_cache = keys[i], v_cache = values[i];
    // Attention.forward: q and k rotated in one pass, as one complex product per pair (apply_rotary_complex).
    at::Tensor qkv = project(w[0] ? norm(h, *w[0]) : h, *w[1]);  // [r, n, 3d], contiguous
    // qkv[..., :2d] as [r, n, 2 n_head, head_dim / 2, 2] and qkv[..., 2d:] as [r, n, n_head, head_dim]: the views
    // slice, view and unflatten make, each in one operation.
    TORCH_CHECK(qkv.is_contiguous(), "cached_layers: the qkv projection is contiguous");
    const int64_t row = 3 * d, offset = qkv.storage_offset();
    at::Tensor pairs = qkv.as_strided({r, n, 2 * n_head, head_dim / 2, 2}, {n * row, row, head_dim, 2, 1}, offset);
    at::Tensor qk = at::view_as_real(at::view_as_complex(pairs).mul(rope)).flatten(-2);
    at::Tensor q = qk.slice(2, 0, n_head), k = qk.slice(2, n_head);
    at::Tensor v = qkv.as_strided({r, n, n_head, head_dim}, {n * row, row, head_dim, 1}, offset + 2 * d);
    if (write_kind == 0) {  // every row at slots start .. start + n - 1
      k_cache.slice(1, start, start + n).copy_(k);
      v_cache.slice(1, start, start + n).copy_(v);
    } else if (write_kind == 1) {  // BlockWrite: consecutive slots per row, from write_slots [r]
      for (auto [cache, x] : {std::pair{&k_cache, &k}, std::pair{&v_cache, &v}}) {
        at::Tensor storage = cache->transpose(1, 2);
        if (!storage.is_contiguous() || !write_blocks(storage, *x, *write_rows, *write_slots)) {
          at::Tensor slots = write_slots->unsqueeze(1).add(at::arange(n, write_slots->options()));
          write_at(*cache, write_rows->unsqueeze(1), slots, *x);
        }
      }
    } else {  // cache[write_rows [r, 1], write_slots [r, n]] = x
      write_at(k_cache, *write_rows, *write_slots, k);
      write_at(v_cache, *write_rows, *write_slots, v);
    }
    if (span < k_cache.size(1)) {
      k_cache = k_cache.slice(1, 0, span);
      v_cache = v_cache.slice(1, 0, span);
    }
    if (read_rows) {  // discrete_ar.gather_rows
      k_cache = k_cache.transpose(1, 2).index_select(0, *read_rows).transpose(1, 2);
      v_cache = v_cache.transpose(1, 2).index_select(0, *read_rows).transpose(1, 2);
    }
    at::Tensor qt = q.transpose(1, 2), kt = k_cache.transpose(1, 2), vt = v_cache.transpose(1, 2);
    at::Tensor out;
    if (attention_kernel) out = decode_attention(qt, kt, vt, mask, scale);
    if (!out.defined()) out = at::scaled_dot_product_attention(qt, kt, vt, mask);
    h = h.add(project(out.transpose(1, 2).reshape({r, n, -1}), *w[2]));
    // FeedForward.forward, in place as there without autograd.
    at::Tensor x = norm(h, *w[3]);
    at::Tensor gate = project(x, *w[4]), up = project(x, *w[5]);
    at::silu_(gate).mul_(up);
    h = h.add(project(gate, *w[6]));
  }
  return h;
}

namespace {

// table[index] for an integer index tensor: the rows of the table (dim 0) at each index, [*index, *row]. The copy
// of the same rows that at::embedding and at::index make, without their own dispatch around index_select.
at::Tensor rows_at(const at::Tensor& table, const at::Tensor& index) {
  std::vector<int64_t> sizes(index.sizes().begin(), index.sizes().end());
  sizes.insert(sizes.end(), table.sizes().begin() + 1, table.sizes().end());
  return table.index_select(0, index.reshape({-1})).view(sizes);
}

// DiscreteGPT._embed_image: the image tokens' rows of the embedding (a token past the vocabulary reads its last).
at::Tensor embed_image(const at::Tensor& tokens, const at::Tensor& embedding) {
  return rows_at(embedding, tokens.clamp(0, embedding.size(0) - 1));
}

// rotary_at: the table's rows at the positions (its last row past its end), as complex factors [r, n, 1, hd / 2].
at::Tensor rotary_rows(const at::Tensor& positions, const at::Tensor& table) {
  return at::view_as_complex(rows_at(table, positions.clamp(0, table.size(0) - 1))).unsqueeze(2);
}

// CfgSoftmax (with softmax; else the logits themselves): softmax(uncond + s * (cond - uncond)) of the rows' two
// halves with cfg_scale s, else of every row.
at::Tensor probabilities(at::Tensor logits, bool softmax, std::optional<double> cfg_scale) {
  if (!softmax) {
    return logits;
  }
  if (cfg_scale) {
    int64_t r = logits.size(0) / 2;
    at::Tensor cond = logits.narrow(0, 0, r), uncond = logits.narrow(0, r, r);
    logits = uncond.add(cond.sub(uncond).mul(*cfg_scale));
  }
  return at::softmax(logits, -1, at::kFloat);
}

// RMSNorm.forward in CPU inference (cpu_norm.rms_norm) over rows of h.
at::Tensor final_norm(const at::Tensor& h, const at::Tensor& weight, double eps, bool kernel) {
  return Norm::of(kernel, eps, h.size(-1))(h, weight);
}

}  // namespace

at::Tensor cached_step(const at::Tensor& inputs, const std::optional<at::Tensor>& embedding,
                       const at::Tensor& positions, const at::Tensor& rope_table, const at::Tensor& mask,
                       bool mask_is_table, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                       const std::vector<std::optional<at::Tensor>>& weights, int64_t n_head, double eps,
                       bool norm_kernel, bool attention_kernel, int64_t write_kind, int64_t start,
                       const std::optional<at::Tensor>& write_rows, const std::optional<at::Tensor>& write_slots,
                       const std::optional<at::Tensor>& read_rows, at::Tensor lengths, const at::Tensor& norm_weight,
                       double norm_eps, const at::Tensor& output, bool softmax, std::optional<double> cfg_scale) {
  at::Tensor h = embedding ? embed_image(inputs, *embedding) : inputs;
  // causal_mask: the rows of its table at the positions, [r, 1, n, span].
  at::Tensor attend = mask_is_table ? rows_at(mask, positions).unsqueeze(1) : mask;
  h = cached_layers(h, rotary_rows(positions, rope_table), attend, keys, values, weights, n_head, eps, norm_kernel,
                    attention_kernel, write_kind, start, write_rows, write_slots, read_rows);
  // The rows' cache lengths: their last position + 1.
  at::Tensor next = positions.select(1, -1).add(1);
  if (read_rows) {
    c10::List<std::optional<at::Tensor>> at_rows;
    at_rows.push_back(*read_rows);
    lengths.index_put_(at_rows, next);
  } else {
    lengths.copy_(next);
  }
  return probabilities(project(final_norm(h, norm_weight, norm_eps, norm_kernel), output), softmax, cfg_scale);
}

std::tuple<at::Tensor, at::Tensor> tree_step(
    const at::Tensor& inputs, const std::optional<at::Tensor>& embedding, const at::Tensor& positions,
    const at::Tensor& rope_table, const at::Tensor& visible, const std::vector<at::Tensor>& keys,
    const std::vector<at::Tensor>& values, const std::vector<std::optional<at::Tensor>>& weights, int64_t n_head,
    double eps, bool norm_kernel, const at::Tensor& write_rows, const at::Tensor& write_slots,
    const std::optional<at::Tensor>& read_rows, const at::Tensor& norm_weight, double norm_eps,
    const at::Tensor& output, bool softmax, std::optional<double> cfg_scale) {
  at::Tensor h = embedding ? embed_image(inputs, *embedding) : inputs;
  // additive_mask: 0 where a query may attend, -inf elsewhere, float32 (torch.where's dtype for two floats).
  at::Tensor mask = at::where(visible.unsqueeze(1), 0.0, -std::numeric_limits<double>::infinity());
  h = cached_layers(h, rotary_rows(positions, rope_table), mask, keys, values, weights, n_head, eps, norm_kernel,
                    /*attention_kernel=*/false, /*write_kind=*/2, 0, write_rows, write_slots, read_rows);
  at::Tensor hidden = final_norm(h, norm_weight, norm_eps, norm_kernel);
  return {hidden, probabilities(project(hidden, output), softmax, cfg_scale)};
}

std::tuple<at::Tensor, at::Tensor> head_step(
    const at::Tensor& tokens, const at::Tensor& features, const at::Tensor& embedding, const at::Tensor& fc_weight,
    const std::optional<at::Tensor>& fc_bias, const at::Tensor& positions, const at::Tensor& rope_table,
    const at::Tensor& visible, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
    const std::vector<std::optional<at::Tensor>>& weights, int64_t n_head, double eps, bool norm_kernel,
    const at::Tensor& write_rows, const at::Tensor& write_slots, const std::optional<at::Tensor>& read_rows,
    const at::Tensor& output, bool softmax, std::optional<double> cfg_scale) {
  // EagleHead._input: fc([embed(tokens), features]).
  at::Tensor h = at::linear(at::cat({embed_image(tokens, embedding), features}, -1), fc_weight, fc_bias);
  at::Tensor predicted = cached_layers(h, rotary_rows(positions, rope_table), visible.unsqueeze(1), keys, values,
                                       weights, n_head, eps, norm_kernel, /*attention_kernel=*/false,
                                       /*write_kind=*/2, 0, write_rows, write_slots, read_rows);
  return {predicted, probabilities(project(predicted, output), softmax, cfg_scale)};
}
