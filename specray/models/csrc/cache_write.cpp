// A verify call's K/V written into a head-major CPU cache: for every (row, head), n consecutive slots are
// n * head_dim contiguous floats, so a loop of row copies replaces the indexed write torch would run over
// them (2.5-2.8x cheaper at 256 rows x 5 tokens). A copy: the same values land in the same slots.
#include "kernels.h"

#include <cstring>

// On the CPU: storage [R, H, S, d] contiguous float32; x [r, n, H, d] float32 with d contiguous; rows, starts [r] int64:
// storage[rows[i], h, starts[i] + t] = x[i, t, h] for every i, t, h. Returns false, writing nothing, on any
// other layout or an index out of range (the caller's indexed write then runs, and refuses the latter).
bool write_blocks(at::Tensor& storage, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& starts) {
  if (!storage.device().is_cpu() || !x.device().is_cpu() || !rows.device().is_cpu() || !starts.device().is_cpu() ||
      storage.scalar_type() != at::kFloat || x.scalar_type() != at::kFloat || rows.scalar_type() != at::kLong ||
      starts.scalar_type() != at::kLong || storage.dim() != 4 || x.dim() != 4 || !storage.is_contiguous() ||
      rows.dim() != 1 || starts.dim() != 1 || !rows.is_contiguous() || !starts.is_contiguous()) {
    return false;
  }
  const int64_t R = storage.size(0), H = storage.size(1), S = storage.size(2), d = storage.size(3);
  const int64_t r = x.size(0), n = x.size(1);
  if (x.size(2) != H || x.size(3) != d || x.stride(3) != 1 || rows.size(0) != r || starts.size(0) != r) return false;
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  for (int64_t i = 0; i < r; ++i) {
    if (row[i] < 0 || row[i] >= R || start[i] < 0 || start[i] + n > S) return false;
  }
  float* cache = storage.data_ptr<float>();
  const float* src = x.data_ptr<float>();
  const int64_t row_stride = x.stride(0), token_stride = x.stride(1), head_stride = x.stride(2);
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      float* block = cache + ((row[i] * H + h) * S + start[i]) * d;
      const float* from = src + i * row_stride + h * head_stride;
      for (int64_t t = 0; t < n; ++t) std::memcpy(block + t * d, from + t * token_stride, d * sizeof(float));
    }
  }
  return true;
}
