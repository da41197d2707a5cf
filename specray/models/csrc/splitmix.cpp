// SplitMix64's finaliser on every element of an int64 tensor (specray/rng.py's _mix, the hash of every draw) in one
// call: eleven torch operations there, each a pass over the keys and a few microseconds of dispatch. Unsigned
// 64-bit arithmetic wraps as torch's int64 operations do and the shifts are rng.py's logical ones, so the bits are
// the same; rng.py compares the kernel with its torch operations before using it.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cstdint>

at::Tensor splitmix(const at::Tensor& keys) {
  if (!keys.device().is_cpu() || keys.scalar_type() != at::kLong) return at::Tensor();
  const at::Tensor in = keys.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options());
  const auto* src = reinterpret_cast<const uint64_t*>(in.data_ptr<int64_t>());
  auto* dst = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  at::parallel_for(0, in.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint64_t z = src[i] + 0x9E3779B97F4A7C15ULL;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      dst[i] = z ^ (z >> 31);
    }
  });
  return out;
}
