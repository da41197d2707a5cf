// Attention of a decode step or a verify call over a CPU KV cache (float32, heads of 16, AVX2): the values
// of torch's CPU flash-attention kernel, which F.scaled_dot_product_attention runs there, to the bit, without
// its two BLAS calls per (row, head), which cost most of its time at these sizes.
//
// For n queries and a key block of S slots, that kernel computes:
//   qk[i][j] = dot(k[j], q[i])                 -- sgemm('T', 'N', S, n, 16) into a 64-byte-aligned buffer
//   qk[i][j] = qk[i][j] * scale + mask[i][j]
//   m = max_j qk[i][j]; e[j] = exp_u20(qk[i][j] - m)   -- 8- or 16-lane running sums of e, then the lanes' tree
//   dst[i][d] = sum_j v[j][d] * e[i][j]         -- sgemm('N', 'N', 16, n, S), dst 8 bytes past a 16-byte boundary
//   out[i][d] = dst[i][d] * (1 / sum_j e[i][j])
// The two products' summation orders below were read off the BLAS this torch build ships (MKL 2024.2, one
// thread) for those shapes and alignments, on its AVX2 path (an AMD EPYC) and on its AVX-512 path (an Intel
// Xeon): at one query each path its own order (set_one_query_orders picks one for the process); at 4 to 9
// queries, on both, one running fused multiply-add. The softmax sums in the lanes of torch's own build for the
// CPU (8 with AVX2, 16 with AVX-512). Other BLAS builds, CPUs or thread counts sum otherwise (2 and 3 queries
// do, too), which is why specray/models/decode_attention.py compares this kernel with torch's for every query
// count and span it serves, at the process's thread count, before using it. Built with -ffp-contract=off: only
// the fused multiply-adds written here may fuse.
#include "kernels.h"
#include "transpose8.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <limits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kHead = 16;

// qk[j] = dot(k[j], q) for 8 keys at once (k rows of 16 floats, consecutive), in MKL's AVX2 path's order:
// ((a + b) + c) with a = x0 + x1 + x2 + x3 + x4 + x8 + x12, b = x6 + x10 + x14,
// c = (x5 + x9 + x13) + (x7 + x11 + x15), x_d = k[j][d] * q[d], each chain added left to right.
// x[d] = element d of 8 consecutive keys (rows of 16 floats): their transpose.
inline void keys8(const float* k, __m256 x[kHead]) {
  for (int r = 0; r < 8; ++r) {
    x[r] = _mm256_loadu_ps(k + r * kHead);
    x[r + 8] = _mm256_loadu_ps(k + r * kHead + 8);
  }
  transpose8(x);
  transpose8(x + 8);
}

inline __m256 dots8(const float* k, const __m256 q[kHead]) {
  __m256 x[kHead];
  keys8(k, x);
  for (int d = 0; d < kHead; ++d) x[d] = _mm256_mul_ps(x[d], q[d]);
  __m256 a = _mm256_add_ps(x[0], x[1]);
  a = _mm256_add_ps(a, x[2]);
  a = _mm256_add_ps(a, x[3]);
  a = _mm256_add_ps(a, x[4]);
  a = _mm256_add_ps(a, x[8]);
  a = _mm256_add_ps(a, x[12]);
  __m256 b = _mm256_add_ps(_mm256_add_ps(x[6], x[10]), x[14]);
  __m256 c1 = _mm256_add_ps(_mm256_add_ps(x[5], x[9]), x[13]);
  __m256 c2 = _mm256_add_ps(_mm256_add_ps(x[7], x[11]), x[15]);
  return _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c1, c2));
}

// dst[d] = sum_j v[j][d] * e[j] in MKL's AVX2 path's order: for d >= 2 one running sum over j; for d = 0 and 1
// (before its output reaches a 16-byte boundary) per 8 slots: four terms into the running sum, then the
// next four summed on their own and added. One pass, so the independent chains of additions overlap.
inline void weighted_sum(const float* v, const float* e, int64_t slots, float* dst) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  float run0 = 0.f, run1 = 0.f;
  for (int64_t c = 0; c < slots; c += 8) {
    const float* vc = v + c * kHead;
    const float* ec = e + c;
    for (int j = 0; j < 8; ++j) {
      const __m256 w = _mm256_set1_ps(ec[j]);
      acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(_mm256_loadu_ps(vc + j * kHead), w));
      acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(_mm256_loadu_ps(vc + j * kHead + 8), w));
    }
    float side0 = vc[4 * kHead] * ec[4], side1 = vc[4 * kHead + 1] * ec[4];
    for (int j = 5; j < 8; ++j) {
      side0 = side0 + vc[j * kHead] * ec[j];
      side1 = side1 + vc[j * kHead + 1] * ec[j];
    }
    for (int j = 0; j < 4; ++j) {
      run0 = run0 + vc[j * kHead] * ec[j];
      run1 = run1 + vc[j * kHead + 1] * ec[j];
    }
    run0 = run0 + side0;
    run1 = run1 + side1;
  }
  _mm256_storeu_ps(dst, acc0);
  _mm256_storeu_ps(dst + 8, acc1);
  dst[0] = run0;
  dst[1] = run1;
}

// The same two products as MKL's AVX-512 path sums them for one query (read off this torch build on an Intel Xeon,
// family 6 model 207): each score ((a + b) + (c + d)) over rounded products, but x1 fused into x0 (an FMA), with
// a = ((x0 + x1) + x9) + (x5 + x13),
// b = (x3 + x11) + (x7 + x15), c = (x2 + x10) + (x6 + x14), d = (x4 + x12) + x8; the weighted sum, for every
// output element alike, one running sum r from 0 over each 8 slots j, x_j = v[j][d] * e[j]: x6 and x4 fused into
// r in turn, then r + (x5 fused into x7), then r + ((x0 fused into x2) + (x1 fused into x3)).
inline __m256 dots8_wide(const float* k, const __m256 q[kHead]) {
  __m256 x[kHead];
  keys8(k, x);
  const __m256 first = _mm256_fmadd_ps(x[1], q[1], _mm256_mul_ps(x[0], q[0]));  // x1 fused into x0
  for (int d = 2; d < kHead; ++d) x[d] = _mm256_mul_ps(x[d], q[d]);
  const __m256 a = _mm256_add_ps(_mm256_add_ps(first, x[9]), _mm256_add_ps(x[5], x[13]));
  const __m256 b = _mm256_add_ps(_mm256_add_ps(x[3], x[11]), _mm256_add_ps(x[7], x[15]));
  const __m256 c = _mm256_add_ps(_mm256_add_ps(x[2], x[10]), _mm256_add_ps(x[6], x[14]));
  const __m256 d = _mm256_add_ps(_mm256_add_ps(x[4], x[12]), x[8]);
  return _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
}

inline void weighted_sum_wide(const float* v, const float* e, int64_t slots, float* dst) {
  __m256 run[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t c = 0; c < slots; c += 8) {
    const float* vc = v + c * kHead;
    const float* ec = e + c;
    for (int half = 0; half < 2; ++half) {  // output elements 0-7, then 8-15
      auto value = [&](int j) { return _mm256_loadu_ps(vc + j * kHead + 8 * half); };
      auto weight = [&](int j) { return _mm256_set1_ps(ec[j]); };
      auto product = [&](int j) { return _mm256_mul_ps(value(j), weight(j)); };
      __m256 r = _mm256_fmadd_ps(value(6), weight(6), run[half]);
      r = _mm256_fmadd_ps(value(4), weight(4), r);
      r = _mm256_add_ps(r, _mm256_fmadd_ps(value(5), weight(5), product(7)));
      const __m256 low = _mm256_add_ps(_mm256_fmadd_ps(value(0), weight(0), product(2)),
                                       _mm256_fmadd_ps(value(1), weight(1), product(3)));
      run[half] = _mm256_add_ps(r, low);
    }
  }
  _mm256_storeu_ps(dst, run[0]);
  _mm256_storeu_ps(dst + 8, run[1]);
}

// Several queries (what the BLAS does for 4 to 9 of them): qk[i][j] and dst[i][d] are each one running
// fused multiply-add over the summed index in order, starting from the first rounded product.
inline __m256 fused_dots8(const __m256 x[kHead], const float* q) {
  __m256 acc = _mm256_mul_ps(x[0], _mm256_set1_ps(q[0]));
  for (int d = 1; d < kHead; ++d) acc = _mm256_fmadd_ps(x[d], _mm256_set1_ps(q[d]), acc);
  return acc;
}

// dst[i] for every query at once: the queries' chains are independent, so their additions overlap.
inline void fused_weighted_sums(const float* v, const float* e, int64_t queries, int64_t slots, float* dst) {
  __m256 acc[2 * 9];
  for (int64_t i = 0; i < 2 * queries; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < slots; ++j) {
    const __m256 lo = _mm256_loadu_ps(v + j * kHead), hi = _mm256_loadu_ps(v + j * kHead + 8);
    for (int64_t i = 0; i < queries; ++i) {
      const __m256 w = _mm256_set1_ps(e[i * slots + j]);
      acc[2 * i] = _mm256_fmadd_ps(lo, w, acc[2 * i]);
      acc[2 * i + 1] = _mm256_fmadd_ps(hi, w, acc[2 * i + 1]);
    }
  }
  for (int64_t i = 0; i < 2 * queries; ++i) _mm256_storeu_ps(dst + i * 8, acc[i]);
}

// The kernel's softmax steps on one row of scores in place: exp_u20(s - max) with running sums in the lanes
// of torch's vectors, then the lanes' reduction; returns the sum, or 0 when every slot is masked (the row's
// output is 0). torch's AVX2 kernels sum in 8 lanes; its AVX-512 kernels in 16 (slots a multiple of 16), here
// as two vectors of 8, reduced as its AVX-512 reduction does: lane i with lane i + 8, then with the lanes 4, 2
// and 1 apart. exp_u20 gives the same bits either way (the same operations; AVX-512 takes its floor by a
// rounding conversion, the same value).
inline float exp_row(float* e, int64_t slots, bool sixteen_lanes) {
  const float top = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, e, slots);
  if (top == -std::numeric_limits<float>::infinity()) return 0.f;
  const Vec vmax(top);
  if (!sixteen_lanes) {
    Vec lanes(0.f);
    for (int64_t j = 0; j < slots; j += Vec::size()) {
      Vec x = (Vec::loadu(e + j) - vmax).exp_u20();
      lanes += x;
      x.store(e + j);
    }
    return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, lanes);
  }
  Vec low(0.f), high(0.f);
  for (int64_t j = 0; j < slots; j += 16) {
    Vec x = (Vec::loadu(e + j) - vmax).exp_u20();
    Vec y = (Vec::loadu(e + j + 8) - vmax).exp_u20();
    low += x;
    high += y;
    x.store(e + j);
    y.store(e + j + 8);
  }
  // lane i + lane i + 8, then ATen's 8-lane reduction: lanes 4, 2 and 1 apart
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, low + high);
}

// Whether torch's CPU kernels run in their AVX-512 build in this process (its dispatch, ATEN_CPU_CAPABILITY
// included), so that its flash-attention kernel sums its softmax in 16 lanes.
bool torch_sums_in_sixteen_lanes() {
  static const bool sixteen = at::get_cpu_capability() == "AVX512";
  return sixteen;
}

// Requests the S x 16 floats at p (S cache lines) ahead of their use.
inline void prefetch_block(const float* p, int64_t slots) {
  for (int64_t j = 0; j < slots; ++j) _mm_prefetch(reinterpret_cast<const char*>(p + j * kHead), _MM_HINT_T0);
}

bool aligned64(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 64 == 0; }

// The BLAS orders one-query calls follow: 0 those of MKL's AVX2 path, 1 those of its AVX-512 path. MKL picks its
// path by the CPU, so specray/models/decode_attention.py sets the one that gave torch's values in this process.
std::atomic<int64_t> one_query_orders{0};

}  // namespace

void set_one_query_orders(int64_t orders) {
  TORCH_CHECK(orders == 0 || orders == 1, "set_one_query_orders: 0 (MKL's AVX2 orders) or 1 (its AVX-512 orders)");
  one_query_orders.store(orders);
}

int64_t get_one_query_orders() { return one_query_orders.load(); }

// q [B, H, n, 16] with n = 1 or 4..9 (the BLAS's paths measured); k, v [B, H, S, 16], each head's S x 16
// block contiguous; mask additive, 0 or -inf, [B or 1, 1, n, S]. Returns [B, H, n, 16] laid out as torch's
// kernel lays out its output, or an undefined tensor (None in Python) when some (row, head) block of q, k or
// v does not start 64-byte aligned, as torch's allocations and the model's head-major caches do (the orders
// above were read at that alignment), when the mask is not float32 (a bool mask), or when torch sums in 16 lanes
// and S is not a multiple of 16.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  if (mask.scalar_type() != at::kFloat) return at::Tensor();  // a bool mask: torch's kernel, as given
  TORCH_CHECK(q.dim() == 4 && q.size(3) == kHead, "decode_attention: q must be [B, H, n, 16]");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), S = k.size(2);
  TORCH_CHECK(n == 1 || (n >= 4 && n <= 9), "decode_attention: 1 or 4 to 9 queries per row");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == H && k.size(3) == kHead && S % 8 == 0 && S > 0,
              "decode_attention: k and v must be [B, H, S, 16] with S a multiple of 8");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == kHead && v.stride(3) == 1 && v.stride(2) == kHead && q.stride(3) == 1,
              "decode_attention: each head's keys and values must be contiguous");
  TORCH_CHECK(mask.dim() == 4 && (mask.size(0) == B || mask.size(0) == 1) && mask.size(1) == 1 && mask.size(2) == n &&
              mask.size(3) == S && mask.stride(3) == 1, "decode_attention: mask must be [B or 1, 1, n, S]");
  const bool sixteen_lanes = torch_sums_in_sixteen_lanes();
  const bool wide_blas = one_query_orders.load() == 1;
  if (sixteen_lanes && S % 16 != 0) return at::Tensor();  // torch sums a partial vector's slots apart
  for (const at::Tensor* t : {&q, &k, &v}) {  // another alignment may take another BLAS path: not served
    if (!aligned64(t->data_ptr()) || t->stride(0) % kHead != 0 || t->stride(1) % kHead != 0) return at::Tensor();
  }
  auto out = at::empty({B, n, H, kHead}, q.options()).transpose(1, 2);
  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  const float* md = mask.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t mask_row = mask.size(0) == 1 ? 0 : mask.stride(0), mask_query = mask.stride(2);
  const int64_t q_query = q.stride(2), out_query = out.stride(2);
  const __m256 scale_v = _mm256_set1_ps(static_cast<float>(scale));
  at::parallel_for(0, B * H, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(n * S);
    float dst[9 * kHead];
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* qp = qd + b * q.stride(0) + h * q.stride(1);
      const float* kp = kd + b * k.stride(0) + h * k.stride(1);
      const float* vp = vd + b * v.stride(0) + h * v.stride(1);
      const float* mp = md + b * mask_row;
      float* op = od + b * out.stride(0) + h * out.stride(1);
      if (bh + 1 < end) {  // the next head's keys and values: the caches are far larger than the CPU's caches
        const int64_t nb = (bh + 1) / H, nh = (bh + 1) % H;
        prefetch_block(kd + nb * k.stride(0) + nh * k.stride(1), S);
        prefetch_block(vd + nb * v.stride(0) + nh * v.stride(1), S);
      }
      // Scores, scaled and masked as the kernel does (mul, then add).
      if (n == 1) {
        __m256 qv[kHead];
        for (int d = 0; d < kHead; ++d) qv[d] = _mm256_set1_ps(qp[d]);
        for (int64_t j = 0; j < S; j += 8) {
          const __m256 dots = wide_blas ? dots8_wide(kp + j * kHead, qv) : dots8(kp + j * kHead, qv);
          const __m256 s = _mm256_mul_ps(dots, scale_v);
          _mm256_storeu_ps(scores.data() + j, _mm256_add_ps(s, _mm256_loadu_ps(mp + j)));
        }
      } else {
        for (int64_t j = 0; j < S; j += 8) {
          __m256 x[kHead];
          keys8(kp + j * kHead, x);
          for (int64_t i = 0; i < n; ++i) {
            const __m256 s = _mm256_mul_ps(fused_dots8(x, qp + i * q_query), scale_v);
            _mm256_storeu_ps(scores.data() + i * S + j, _mm256_add_ps(s, _mm256_loadu_ps(mp + i * mask_query + j)));
          }
        }
      }
      float totals[9];
      for (int64_t i = 0; i < n; ++i) totals[i] = exp_row(scores.data() + i * S, S, sixteen_lanes);
      if (n == 1 && wide_blas) {
        weighted_sum_wide(vp, scores.data(), S, dst);
      } else if (n == 1) {
        weighted_sum(vp, scores.data(), S, dst);
      } else {
        fused_weighted_sums(vp, scores.data(), n, S, dst);
      }
      for (int64_t i = 0; i < n; ++i) {
        float* oi = op + i * out_query;
        if (totals[i] == 0.f) {  // every slot masked: the kernel's zeros
          for (int d = 0; d < kHead; ++d) oi[d] = 0.f;
          continue;
        }
        const float reciprocal = 1 / totals[i];
        at::vec::map<float>([reciprocal](Vec x) { return x * Vec(reciprocal); }, oi, dst + i * kHead, kHead);
      }
    }
  });
  return out;
}
