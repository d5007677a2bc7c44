// The residual add and the RMSNorm after it, in one pass over each row.
//
// add_rms_norm(h, y, weight, eps, gemma, y_weight, y_eps): h += y (y first normed by y_weight where given: Gemma's
// post-attention and post-feed-forward norms), in place and rounded to h's dtype as torch's add_ rounds; returns
// RMSNorm(h) in h's dtype. Llama's norm rounds the normalized value to the dtype and then multiplies by the weight
// in the dtype; Gemma's (weight: its float32 1 + w) multiplies in float32 and rounds once. `y` undefined: no add
// (the first layer's norm of the embeddings).
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using namespace switchyard_cpu;

// out = norm(x) by `weight` (T for Llama, float32 for Gemma)
template <typename T, typename W>
void norm_row(const float* x, int64_t n, const W* weight, float eps, bool gemma, T* out) {
  const float r = inv_rms(x, n, eps);
  if (gemma) {
    for (int64_t i = 0; i < n; ++i) store(out + i, x[i] * r * widen(weight[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) store(out + i, round_to(x[i] * r, T()) * widen(weight[i]));
  }
}

template <typename T, typename W>
void add_norm_rows(at::Tensor& h, const std::optional<at::Tensor>& y, const at::Tensor& weight, float eps, bool gemma,
                   const std::optional<at::Tensor>& y_weight, float y_eps, at::Tensor& out) {
  const int64_t rows = h.size(0), n = h.size(1);
  T* hp = h.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* yp = y ? y->data_ptr<T>() : nullptr;
  const int64_t y_row = y ? y->stride(0) : 0;
  const W* w = weight.data_ptr<W>();
  const float* yw = y_weight ? y_weight->data_ptr<float>() : nullptr;
  // rows of a few thousand values: one thread unless the step is large (a parallel region costs more than a row)
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t begin, int64_t end) {
    std::vector<float> x(n), yn(n);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = hp + r * n;
      for (int64_t i = 0; i < n; ++i) x[i] = widen(hr[i]);
      if (yp != nullptr) {
        const T* yr = yp + r * y_row;
        if (yw != nullptr) {  // y's own norm first, rounded as a tensor of its dtype
          for (int64_t i = 0; i < n; ++i) yn[i] = widen(yr[i]);
          const float ry = inv_rms(yn.data(), n, y_eps);
          for (int64_t i = 0; i < n; ++i) yn[i] = yn[i] * ry * yw[i];
          round_row<T>(yn.data(), n);
        } else {
          for (int64_t i = 0; i < n; ++i) yn[i] = widen(yr[i]);
        }
        for (int64_t i = 0; i < n; ++i) {
          x[i] = round_to(x[i] + yn[i], T());
          store(hr + i, x[i]);
        }
      }
      norm_row<T, W>(x.data(), n, w, eps, gemma, op + r * n);
    }
  });
}

// h [rows, n] contiguous, updated in place when y is given; y [rows, n] (row stride free); weight [n] (h's dtype,
// or float32 for Gemma); y_weight [n] float32 or none
at::Tensor add_rms_norm(at::Tensor h, const std::optional<at::Tensor>& y, const at::Tensor& weight, double eps,
                        bool gemma, const std::optional<at::Tensor>& y_weight, double y_eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [rows, n]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h.size(1) && weight.is_contiguous(), "weight must be [n]");
  TORCH_CHECK(gemma ? weight.scalar_type() == at::kFloat : weight.scalar_type() == h.scalar_type(),
              "the weight's dtype: float32 for Gemma's norm, else h's");
  if (y) {
    TORCH_CHECK(y->dim() == 2 && y->sizes() == h.sizes() && y->stride(1) == 1 && y->scalar_type() == h.scalar_type(),
                "y must be h's shape and dtype");
  }
  if (y_weight) {
    TORCH_CHECK(y && y_weight->scalar_type() == at::kFloat && y_weight->numel() == h.size(1) &&
                    y_weight->is_contiguous(),
                "y_weight: [n] float32, with y");
  }
  auto out = at::empty_like(h);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    if (gemma) {
      add_norm_rows<scalar_t, float>(h, y, weight, eps, true, y_weight, y_eps, out);
    } else {
      add_norm_rows<scalar_t, scalar_t>(h, y, weight, eps, false, y_weight, y_eps, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def(
      "add_rms_norm(Tensor(a!) h, Tensor? y, Tensor weight, float eps, bool gemma, Tensor? y_weight, float y_eps) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("add_rms_norm", &add_rms_norm); }
