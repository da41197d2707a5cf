// SplitMix64's finaliser on every element of an int64 tensor (specray/rng.py's _mix, the hash of every draw) in one
// call: eleven torch operations there, each a pass over the keys and a few microseconds of dispatch. The finaliser
// (splitmix.h) gives rng.py's bits; rng.py compares the kernel with its torch operations before using it.
// keyed_uniforms: rng.uniform's one draw per key, every key field mixed in by one call, where rng.py makes five
// finaliser calls and eight torch operations, each a pass over the keys.
#include "kernels.h"
#include "splitmix.h"

#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

at::Tensor splitmix(const at::Tensor& keys) {
  if (!keys.device().is_cpu() || keys.scalar_type() != at::kLong) return at::Tensor();
  const at::Tensor in = keys.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options());
  const auto* src = reinterpret_cast<const uint64_t*>(in.data_ptr<int64_t>());
  auto* dst = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  at::parallel_for(0, in.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = splitmix64::mix(src[i]);
  });
  return out;
}

at::Tensor keyed_uniforms(const at::Tensor& sample_ids, const at::Tensor& positions, const at::Tensor& steps,
                          int64_t seed_hash, int64_t stream) {
  if (!on_cpu({&sample_ids, &positions, &steps}, at::kLong)) return at::Tensor();
  std::vector<int64_t> shape;
  try {  // the key fields broadcast together; where they do not, the caller's torch operations say so
    shape = at::infer_size(at::infer_size(sample_ids.sizes(), positions.sizes()), steps.sizes());
  } catch (const std::exception&) {
    return at::Tensor();
  }
  const at::Tensor ids = sample_ids.expand(shape).contiguous(), pos = positions.expand(shape).contiguous(),
                   step = steps.expand(shape).contiguous();
  at::Tensor out = at::empty(shape, sample_ids.options().dtype(at::kDouble));
  const auto* id = reinterpret_cast<const uint64_t*>(ids.data_ptr<int64_t>());
  const int64_t* position = pos.data_ptr<int64_t>();
  const int64_t* round = step.data_ptr<int64_t>();
  double* u = out.data_ptr<double>();
  const uint64_t seeded = static_cast<uint64_t>(seed_hash), named = static_cast<uint64_t>(stream);
  at::parallel_for(0, out.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      // rng.stream_hash (the seed's hash with the sample id, then the stream), then the position, the step and
      // element 0's index.
      const uint64_t stream_hash = splitmix64::mix(splitmix64::mix(seeded ^ id[i]) ^ named);
      u[i] = splitmix64::uniform_at(stream_hash, position[i], round[i], 0);
    }
  });
  return out;
}
