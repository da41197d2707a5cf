// SplitMix64's finaliser, the hash of every specray draw (specray/rng.py's _mix): unsigned 64-bit arithmetic wraps as
// torch's int64 operations do, and the shifts are rng.py's logical ones, so the bits are the same. Shared by
// splitmix.cpp (the hash of a tensor of keys) and round_draws.cpp (a diffusion round's draws).
#pragma once

#include <cstdint>

namespace splitmix64 {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline uint64_t mix(uint64_t z) {
  z += kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace splitmix64
