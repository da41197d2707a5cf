// specray's CPU kernels for the discrete models' decode steps and verify calls, one extension
// (specray/models/cpu_kernels.py builds it; bindings.cpp exposes these to Python).
#pragma once
#include <torch/extension.h>

// Attention over a KV cache with the values of torch's CPU flash-attention kernel (decode_attention.cpp);
// an undefined tensor where a block is off the alignment the summation orders were read at.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scale);

// K or V of n consecutive positions per row copied into a head-major cache (cache_write.cpp); false, with
// nothing written, where the call is not one it serves.
bool write_blocks(at::Tensor& storage, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& starts);

// RMSNorm of float32 rows, (x * rsqrt(sum(x * x) / D + eps)) * weight, with the values of torch's operations
// (rms_norm.cpp); an undefined tensor where the call is not one it serves.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
