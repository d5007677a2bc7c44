// The token choice over a batch's logits in half precision, each row's scores divided by its temperature on the
// way (x / t, as torch divides): `reduce_rows` gives per row the first argmax, the max and log Σ exp(score − max)
// (logsumexp − max) in one read of the logits; `draw_rows` draws sampled rows by inversion (the running sum of
// exp(score − max) against one uniform number per row, as services/shard/sampling/draws.py). No float32 copy of the
// scores is made: at a 262k vocabulary and 64 rows that copy, and each pass over it, goes to memory.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <vector>

namespace {

using namespace switchyard_cpu;

// Tokens per task of `reduce_rows`: a part of a row is read twice (max, then the sum) while it sits in L2, and a
// few rows still spread over every thread.
constexpr int64_t PART = 16384;
// Tokens whose weights are summed in float32 before the sum moves to float64 (exact enough at any vocabulary).
constexpr int64_t BLOCK = 256;

struct Part {
  float max;   // NaN where the part holds one
  int64_t at;  // first index of the max (or of the first NaN) within the row
  double sum;  // Σ exp(score − max) over the part
};

// the score of token i: the stored value widened, over the temperature where it is not 1
template <typename T, bool DIVIDE>
inline float score(const T* x, int64_t i, float t) {
  return DIVIDE ? widen(x[i]) / t : widen(x[i]);
}

// weight of token i: exp(score − max), 0 below e^-87 (so a −inf score is never drawn), the value that the sum and
// both of draw_row's passes see
template <typename T, bool DIVIDE>
inline float weight(const T* x, int64_t i, float t, float m) {
  const float d = score<T, DIVIDE>(x, i, t) - m;
  return d < -87.f ? 0.f : exp_nonpositive(d);
}

// the first NaN of the part, if it has one: torch's argmax and amax take NaN as the maximum
template <typename T, bool DIVIDE>
bool first_nan(const T* x, int64_t begin, int64_t end, float t, Part& p) {
  for (int64_t i = begin; i < end; ++i) {
    const float y = score<T, DIVIDE>(x, i, t);
    if (y != y) {
      p = Part{y, i, 0.0};
      return true;
    }
  }
  return false;
}

template <typename T, bool DIVIDE>
Part reduce_part(const T* x, int64_t begin, int64_t end, float t) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = begin; i < end; ++i) m = std::max(m, score<T, DIVIDE>(x, i, t));  // NaN skipped here
  Part p{m, begin, 0.0};
  if (std::isinf(m)) {  // all −inf (nothing drawable here) or a +inf: no sum, the first index by a scan
    if (first_nan<T, DIVIDE>(x, begin, end, t, p)) return p;
    for (int64_t i = begin; i < end; ++i) {
      if (score<T, DIVIDE>(x, i, t) == m) {
        p.at = i;
        break;
      }
    }
    return p;
  }
  // the sum, and the first index of the max on the way (a min-reduction, so the loop stays vectorized); a NaN
  // makes the sum NaN, and only then is the part scanned for it
  int32_t at = static_cast<int32_t>(end - begin);  // from the part's start: 32-bit lanes, twice as many
  for (int64_t b = begin; b < end; b += BLOCK) {
    const int64_t stop = std::min(b + BLOCK, end);
    float s = 0.f;
#pragma omp simd reduction(+ : s) reduction(min : at)
    for (int64_t i = b; i < stop; ++i) {
      const float d = score<T, DIVIDE>(x, i, t) - m;
      at = d == 0.f ? std::min(at, static_cast<int32_t>(i - begin)) : at;
      s += d < -87.f ? 0.f : exp_nonpositive(d);
    }
    p.sum += s;
  }
  p.at = begin + at;
  if (std::isnan(p.sum)) first_nan<T, DIVIDE>(x, begin, end, t, p);
  return p;
}

template <typename T>
void reduce_all(const at::Tensor& scores, const float* temps, int64_t* ids, float* maxes, float* spreads) {
  const int64_t rows = scores.size(0), vocab = scores.size(1), stride = scores.stride(0);
  const int64_t per_row = (vocab + PART - 1) / PART;
  const T* base = scores.data_ptr<T>();
  std::vector<Part> parts(rows * per_row);
  at::parallel_for(0, rows * per_row, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t r = task / per_row, begin = (task % per_row) * PART;
      const int64_t end = std::min(begin + PART, vocab);
      const T* x = base + r * stride;
      const float t = temps ? temps[r] : 1.f;
      parts[task] = t == 1.f ? reduce_part<T, false>(x, begin, end, t) : reduce_part<T, true>(x, begin, end, t);
    }
  });
  // per row, the parts merged in their order: the first part holding the max gives the first argmax
  for (int64_t r = 0; r < rows; ++r) {
    const Part* p = parts.data() + r * per_row;
    int64_t best = 0;
    for (int64_t k = 0; k < per_row; ++k) {
      if (std::isnan(p[k].max)) {
        best = k;
        break;
      }
      if (p[k].max > p[best].max) best = k;
    }
    ids[r] = p[best].at;
    maxes[r] = p[best].max;
    const float m = p[best].max;
    if (!std::isfinite(m)) {
      spreads[r] = std::numeric_limits<float>::quiet_NaN();  // as torch's softmax of such a row
      continue;
    }
    double total = 0.0;
    for (int64_t k = 0; k < per_row; ++k) {
      if (p[k].sum > 0.0) total += p[k].sum * std::exp(static_cast<double>(p[k].max) - m);
    }
    spreads[r] = static_cast<float>(std::log(total));
  }
}

// scores: [rows, vocab] (row stride free); temperatures: [rows] float32 or empty (all 1)
std::tuple<at::Tensor, at::Tensor, at::Tensor> reduce_rows(const at::Tensor& scores, const at::Tensor& temperatures) {
  TORCH_CHECK(scores.dim() == 2 && scores.stride(1) == 1, "scores must be [rows, vocab], vocab contiguous");
  const int64_t rows = scores.size(0);
  const bool divide = temperatures.numel() > 0;
  TORCH_CHECK(!divide || (temperatures.numel() == rows && temperatures.scalar_type() == at::kFloat &&
                          temperatures.is_contiguous()),
              "temperatures must be [rows] float32, or empty");
  auto ids = at::empty({rows}, scores.options().dtype(at::kLong));
  auto maxes = at::empty({rows}, scores.options().dtype(at::kFloat));
  auto spreads = at::empty({rows}, scores.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "reduce_rows", [&] {
    reduce_all<scalar_t>(scores, divide ? temperatures.data_ptr<float>() : nullptr, ids.data_ptr<int64_t>(),
                         maxes.data_ptr<float>(), spreads.data_ptr<float>());
  });
  return {ids, maxes, spreads};
}


// the token where u · Σ weights falls in the running sum (the first whose running sum exceeds it); a token of zero
// weight is never drawn
template <typename T, bool DIVIDE>
int64_t draw_row(const T* x, int64_t vocab, float t, float m, double u) {
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  std::vector<double> ends(blocks);
  double run = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * BLOCK, stop = std::min(begin + BLOCK, vocab);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = begin; i < stop; ++i) s += weight<T, DIVIDE>(x, i, t, m);
    run += s;
    ends[b] = run;
  }
  // below the total strictly (u · total may round up to it), so the block found has weight
  const double target = std::min(u * run, std::nextafter(run, 0.0));
  int64_t b = std::upper_bound(ends.begin(), ends.end(), target) - ends.begin();
  b = std::min(b, blocks - 1);
  double sum = b > 0 ? ends[b - 1] : 0.0;
  const int64_t begin = b * BLOCK, stop = std::min(begin + BLOCK, vocab);
  int64_t last = -1;
  for (int64_t i = begin; i < stop; ++i) {
    const float w = weight<T, DIVIDE>(x, i, t, m);
    if (w > 0.f) last = i;
    sum += w;
    if (sum > target && w > 0.f) return i;
  }
  // the target at the block's very end by rounding (the block's sum in another order): its last token of weight
  return last >= 0 ? last : begin;
}

// scores: [n, vocab]; rows: [k] long, the rows drawn; temperatures: [n] float32 or empty; maxes: [n] float32 (from
// reduce_rows); uniforms: [k] float64 in [0, 1). Returns [k] long.
at::Tensor draw_rows(const at::Tensor& scores, const at::Tensor& rows, const at::Tensor& temperatures,
                     const at::Tensor& maxes, const at::Tensor& uniforms) {
  TORCH_CHECK(scores.dim() == 2 && scores.stride(1) == 1, "scores must be [rows, vocab], vocab contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && uniforms.scalar_type() == at::kDouble &&
                  rows.numel() == uniforms.numel() && rows.is_contiguous() && uniforms.is_contiguous(),
              "rows must be long and uniforms float64, one per row");
  TORCH_CHECK(maxes.scalar_type() == at::kFloat && maxes.numel() == scores.size(0), "maxes must be [n] float32");
  const bool divide = temperatures.numel() > 0;
  TORCH_CHECK(!divide || (temperatures.numel() == scores.size(0) && temperatures.scalar_type() == at::kFloat),
              "temperatures must be [n] float32, or empty");
  const int64_t k = rows.numel(), vocab = scores.size(1), stride = scores.stride(0);
  auto out = at::empty({k}, rows.options());
  const int64_t* rp = rows.data_ptr<int64_t>();
  const double* up = uniforms.data_ptr<double>();
  const float* mp = maxes.data_ptr<float>();
  const float* tp = divide ? temperatures.data_ptr<float>() : nullptr;
  int64_t* op = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "draw_rows", [&] {
    const scalar_t* base = scores.data_ptr<scalar_t>();
    at::parallel_for(0, k, 1, [&](int64_t first, int64_t last) {
      for (int64_t j = first; j < last; ++j) {
        const int64_t r = rp[j];
        const float t = tp ? tp[r] : 1.f;
        const scalar_t* x = base + r * stride;
        op[j] = t == 1.f ? draw_row<scalar_t, false>(x, vocab, t, mp[r], up[j])
                         : draw_row<scalar_t, true>(x, vocab, t, mp[r], up[j]);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("reduce_rows(Tensor scores, Tensor temperatures) -> (Tensor, Tensor, Tensor)");
  m.def("draw_rows(Tensor scores, Tensor rows, Tensor temperatures, Tensor maxes, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) {
  m.impl("reduce_rows", &reduce_rows);
  m.impl("draw_rows", &draw_rows);
}
