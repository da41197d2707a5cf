// SplitMix64's finaliser, the hash of every specray draw (specray/rng.py's _mix): unsigned 64-bit arithmetic wraps as
// torch's int64 operations do, and the shifts are rng.py's logical ones, so the bits are the same. Shared by
// splitmix.cpp (the hash of a tensor of keys), round_draws.cpp (a diffusion round's draws) and the discrete rounds'
// bookkeeping (chain_bookkeeping.cpp, tree_bookkeeping.cpp: a round's uniforms at its own keys).
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

// rng.py's _to_uniform: the top 53 bits (exact as a double) times 2^-53 (exact).
inline double to_uniform(uint64_t bits) {
  return static_cast<double>(static_cast<int64_t>(bits >> 11)) * (1.0 / 9007199254740992.0);
}

// rng.uniform_at(rng.extend_hash(stream_hash, position, step), shape)'s element `index` (0 for a draw without a
// shape): the key's position and step mixed in, then the element's index times the golden ratio.
inline double uniform_at(uint64_t stream_hash, int64_t position, int64_t step, int64_t index) {
  const uint64_t key = mix(mix(stream_hash ^ static_cast<uint64_t>(position)) ^ static_cast<uint64_t>(step));
  return to_uniform(mix(key ^ static_cast<uint64_t>(index) * kGolden));
}

}  // namespace splitmix64
