// SplitMix64's finaliser on every element of an int64 tensor (specray/rng.py's _mix, the hash of every draw) in one
// call: eleven torch operations there, each a pass over the keys and a few microseconds of dispatch. The finaliser
// (splitmix.h) gives rng.py's bits; rng.py compares the kernel with its torch operations before using it.
#include "kernels.h"
#include "splitmix.h"

#include <ATen/Parallel.h>

#include <cstdint>

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
