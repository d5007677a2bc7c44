// The gated activation of the MLP: act(gate) * up in one pass, act SiLU (Llama, Qwen, Mistral) or GELU with the
// tanh approximation (Gemma). act(gate) is rounded to the dtype before the product, as the torch ops round.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace {

using namespace switchyard_cpu;

// x * sigmoid(x), from t = e^-|x| <= 1 (never overflows)
inline float silu(float x) {
  const float t = exp_nonpositive(-std::fabs(x));
  return x * (x >= 0.f ? 1.f : t) / (1.f + t);
}

// 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3); tanh(u) = sign(u) (1 - e) / (1 + e), e = e^-2|u|
inline float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float e = exp_nonpositive(-2.f * std::fabs(u));
  const float th = std::copysign((1.f - e) / (1.f + e), u);
  return 0.5f * x * (1.f + th);
}

template <typename T, bool GELU>
void gate_rows(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t rows = gate.size(0), n = gate.size(1);
  const T* gp = gate.data_ptr<T>();
  const T* upp = up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t g_row = gate.stride(0), u_row = up.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(n);
    float* a = buffer.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * g_row;
      const T* u = upp + r * u_row;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float x = widen(g[i]);
        a[i] = GELU ? gelu_tanh(x) : silu(x);
      }
      round_row<T>(a, n);
      for (int64_t i = 0; i < n; ++i) a[i] *= widen(u[i]);
      store_row(op + r * n, a, n);
    }
  });
}

// gate, up: [rows, n] (row strides free: the two halves of one product); act 0 SiLU, 1 GELU (tanh)
at::Tensor gated(const at::Tensor& gate, const at::Tensor& up, int64_t act) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "gate and up must be [rows, n], n contiguous");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type(), "gate and up must share a dtype");
  TORCH_CHECK(act == 0 || act == 1, "act: 0 SiLU, 1 GELU (tanh)");
  auto out = at::empty(gate.sizes(), gate.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "gated", [&] {
    if (act == 1) {
      gate_rows<scalar_t, true>(gate, up, out);
    } else {
      gate_rows<scalar_t, false>(gate, up, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) { m.def("gated(Tensor gate, Tensor up, int act) -> Tensor"); }

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("gated", &gated); }
