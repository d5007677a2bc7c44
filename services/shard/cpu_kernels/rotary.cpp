// The rotary embedding in place on q or k (or both side by side), after Gemma-3's per-head RMSNorm where given.
//
// rotary_(x, cos, sin, weight, eps): x [tokens, heads, D] (token and head strides free, D contiguous) becomes
// x * cos + roll(x, D / 2) * sin, where sin carries rotate_half's sign (the decoder walk's tables), each product
// and the sum rounded to x's dtype as the torch ops round. With `weight` ([heads, D] float32: Gemma-3's 1 + w per
// head row, or [D] for every head) each head is first RMS-normed in float32, times the weight, rounded.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using namespace switchyard_cpu;

// o = v * cos + roll(v, D / 2) * sin, each product and the sum rounded to T (separate buffers: the loops vectorize)
template <typename T>
inline void rotate_head(const float* __restrict v, const float* __restrict cf, const float* __restrict sf,
                        float* __restrict o, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) o[i] = round_to(v[i] * cf[i], T()) + round_to(v[i + half] * sf[i], T());
  for (int64_t i = half; i < D; ++i) o[i] = round_to(v[i] * cf[i], T()) + round_to(v[i - half] * sf[i], T());
}

template <typename T>
void rotate_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const float* weight, int64_t w_head,
                 float eps) {
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t x_tok = x.stride(0), x_head = x.stride(1), c_tok = cos.stride(0), s_tok = sin.stride(0);
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / (heads * D)), [&](int64_t begin, int64_t end) {
    std::vector<float> buffers(4 * D);
    float* __restrict v = buffers.data();
    float* __restrict o = v + D;
    float* __restrict cf = o + D;
    float* __restrict sf = cf + D;
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * c_tok;
      const T* s = sp + t * s_tok;
      for (int64_t i = 0; i < D; ++i) {  // the token's tables, widened once for all its heads
        cf[i] = widen(c[i]);
        sf[i] = widen(s[i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* row = xp + t * x_tok + h * x_head;
        for (int64_t i = 0; i < D; ++i) v[i] = widen(row[i]);
        if (weight != nullptr) {
          const float r = inv_rms(v, D, eps);
          const float* w = weight + h * w_head;
          for (int64_t i = 0; i < D; ++i) v[i] = round_to(v[i] * r * w[i], T());
        }
        rotate_head<T>(v, cf, sf, o, D);
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) store(row + i, o[i]);
      }
    }
  });
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& weight,
             double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [tokens, heads, D], D contiguous");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == x.size(0) && cos.size(1) == 1 && cos.size(2) == x.size(2) &&
                  cos.stride(2) == 1 && sin.sizes() == cos.sizes() && sin.stride(2) == 1,
              "cos and sin must be [tokens, 1, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "cos, sin: x's dtype");
  if (weight) {
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->is_contiguous() &&
                    (weight->numel() == x.size(1) * x.size(2) || weight->numel() == x.size(2)),
                "weight: [heads, D] or [D] float32");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    rotate_rows<scalar_t>(x, cos, sin, weight ? weight->data_ptr<float>() : nullptr,
                          weight && weight->numel() == x.size(2) ? 0 : x.size(2), static_cast<float>(eps));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor? weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("rotary_", &rotary_); }
