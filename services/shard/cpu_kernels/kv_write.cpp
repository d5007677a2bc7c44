// The step's new K/V into the paged cache, at each token's slot: one copy of a head's D values per (token, KV head),
// the tokens split over the threads. The same writes as `index_copy_` along the slot dimension, without its
// per-element indexing (a long prefill writes ~1 MB of K/V a layer).
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace {

// k_flat, v_flat [kv_heads, slots, D] (the pages viewed flat); slots [T] int64; key, value [T, kv_heads, D]. Strides
// are free but for D's.
void write_kv(const at::Tensor& k_flat, const at::Tensor& v_flat, const at::Tensor& slots, const at::Tensor& key,
              const at::Tensor& value) {
  TORCH_CHECK(k_flat.dim() == 3 && v_flat.sizes() == k_flat.sizes(), "k_flat, v_flat: [kv_heads, slots, D]");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key, value: [T, kv_heads, D]");
  const int64_t T = key.size(0), H = key.size(1), D = key.size(2), n = k_flat.size(1);
  TORCH_CHECK(k_flat.size(0) == H && k_flat.size(2) == D, "key and value must have the pages' heads and D");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous(),
              "slots: [T] int64, contiguous");
  const auto dtype = k_flat.scalar_type();
  TORCH_CHECK(v_flat.scalar_type() == dtype && key.scalar_type() == dtype && value.scalar_type() == dtype,
              "key, value and the pages must share a dtype");
  TORCH_CHECK(k_flat.stride(2) == 1 && v_flat.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "D must be contiguous");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < n, "slot ", slot[t], " is outside the pages' ", n, " slots");
  }
  const int64_t size = key.element_size(), bytes = D * size;
  char* kf = static_cast<char*>(k_flat.data_ptr());
  char* vf = static_cast<char*>(v_flat.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(kf + (h * k_flat.stride(0) + slot[t] * k_flat.stride(1)) * size,
                    kp + (t * key.stride(0) + h * key.stride(1)) * size, bytes);
        std::memcpy(vf + (h * v_flat.stride(0) + slot[t] * v_flat.stride(1)) * size,
                    vp + (t * value.stride(0) + h * value.stride(1)) * size, bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("write_kv(Tensor(a!) k_flat, Tensor(b!) v_flat, Tensor slots, Tensor key, Tensor value) -> ()");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("write_kv", &write_kv); }
