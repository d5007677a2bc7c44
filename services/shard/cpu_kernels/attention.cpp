// Attention of short rows (decodes, verified drafts) over the paged cache, each row's keys read in place from its
// blocks.
//
// One task per (token, KV head): the query heads sharing that KV head score every key the token sees (causal, the
// sliding window as the first visible position) in float32, with the scale and optional soft-cap; softmax in
// float32; the weighted sum of V accumulated in float32 and rounded once into the output. A token with many keys is
// attended in parts of PART_KEYS on any thread, merged after (flash-decoding's split), so that one long row keeps
// every core busy. A token's result depends on its own row only, never on how many tokens its row or the step has:
// a verified draft gets the values its decode would. No gather copy, no [rows, keys] score tensors, one parallel
// region per layer (two when a token has several parts).
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace switchyard_cpu;

// One (row, KV head) task: `rep` query heads (qf, float32) over the row's `L` keys from position `first`.
// Scores per key (its K row widened once, then a dot per head), softmax per head, then the V rows widened once into
// `vf` and summed per head with its D accumulators in registers. DT: the head dimension when fixed at compile time
// (0: `d` at run time, at most MAX_D).
constexpr int64_t MAX_D = 512;

// scores[h * L + j] = scale * q_h . k_j for the rep query heads and the L keys from `first`.
template <typename T, int64_t DT>
inline void score_keys(const T* kh, const int32_t* table, int64_t bs, int64_t first, int64_t L,
                       const float* __restrict qf, int64_t rep, int64_t D, float scale, float* __restrict scores) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && DT > 0 && DT % 32 == 0) {
    // bf16 keys straight into the dot-product instruction (pairs of products summed in float32, no widening pass):
    // q back to bf16 is exact, it was bf16
    constexpr int64_t C = DT / 32;
    std::vector<__m512bh> qv(rep * C);
    for (int64_t h = 0; h < rep; ++h) {
      for (int64_t c = 0; c < C; ++c) {
        const float* q = qf + h * DT + 32 * c;
        qv[h * C + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q));
      }
    }
    for (int64_t j = 0; j < L; ++j) {
      const int64_t pos = first + j;
      const T* kr = kh + (static_cast<int64_t>(table[pos / bs]) * bs + pos % bs) * DT;
      __m512bh k[C];
      for (int64_t c = 0; c < C; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kr + 32 * c);
      for (int64_t h = 0; h < rep; ++h) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < C; ++c) acc = _mm512_dpbf16_ps(acc, qv[h * C + c], k[c]);
        scores[h * L + j] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < L; ++j) {
    const int64_t pos = first + j;
    const T* kr = kh + (static_cast<int64_t>(table[pos / bs]) * bs + pos % bs) * D;
    float row[DT > 0 ? DT : MAX_D];
    for (int64_t i = 0; i < D; ++i) row[i] = widen(kr[i]);
    for (int64_t h = 0; h < rep; ++h) {
      const float* qh = qf + h * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < D; ++i) dot += qh[i] * row[i];
      scores[h * L + j] = dot * scale;
    }
  }
}

// One part of a (token, KV head): its `rep` query heads (qf, float32) over `L` keys from position `first`. Per head:
// the part's top score (top[h]), the sum of e^(score - top) (total[h]) and the V rows weighted by those, unnormalized
// (acc[h * D ...]); the V rows widened once into `vf`, each head's D accumulators in registers.
template <typename T, int64_t DT>
void attend_part(const T* kh, const T* vh, const int32_t* table, int64_t bs, int64_t first, int64_t L,
                 const float* __restrict qf, int64_t rep, int64_t d, float scale, float cap, float* __restrict scores,
                 float* __restrict vf, float* __restrict top, float* __restrict total, float* __restrict acc_out) {
  const int64_t D = DT > 0 ? DT : d;
  score_keys<T, DT>(kh, table, bs, first, L, qf, rep, D, scale, scores);
  for (int64_t h = 0; h < rep; ++h) {
    float* s = scores + h * L;
    if (cap > 0.f) {
      for (int64_t j = 0; j < L; ++j) s[j] = std::tanh(s[j] / cap) * cap;
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < L; ++j) m = std::max(m, s[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < L; ++j) {
      s[j] = exp_nonpositive(s[j] - m);
      sum += s[j];
    }
    top[h] = m;
    total[h] = sum;
  }
  for (int64_t j = 0; j < L; ++j) {
    const int64_t pos = first + j;
    const T* vr = vh + (static_cast<int64_t>(table[pos / bs]) * bs + pos % bs) * D;
    for (int64_t i = 0; i < D; ++i) vf[j * D + i] = widen(vr[i]);
  }
  for (int64_t h = 0; h < rep; ++h) {
    float acc[DT > 0 ? DT : MAX_D];
    for (int64_t i = 0; i < D; ++i) acc[i] = 0.f;
    const float* s = scores + h * L;
    for (int64_t j = 0; j < L; ++j) {
      const float p = s[j];
      const float* v = vf + j * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) acc[i] += p * v[i];
    }
    for (int64_t i = 0; i < D; ++i) acc_out[h * D + i] = acc[i];
  }
}

// out[h] = sum over parts of acc_p[h] e^(top_p[h] - top) / sum over parts of total_p[h] e^(top_p[h] - top), the
// parts in order (one part: acc / total, e^0 being exactly 1)
template <typename T>
void merge_parts(int64_t parts, int64_t rep, int64_t D, const float* top, const float* total, const float* acc,
                 T* out, int64_t out_head) {
  for (int64_t h = 0; h < rep; ++h) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, top[p * rep + h]);
    float sum = 0.f;
    float o[MAX_D];
    for (int64_t i = 0; i < D; ++i) o[i] = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
      const float w = exp_nonpositive(top[p * rep + h] - m);
      sum += total[p * rep + h] * w;
      const float* a = acc + (p * rep + h) * D;
      for (int64_t i = 0; i < D; ++i) o[i] += a[i] * w;
    }
    const float inv = 1.f / sum;
    T* dst = out + h * out_head;
    for (int64_t i = 0; i < D; ++i) store(dst + i, o[i] * inv);
  }
}

// Keys per part: a token with more keys is attended in parts that run on any thread and are merged after. The
// split depends on the token's own key count only, so its result does not depend on the step.
constexpr int64_t PART_KEYS = 512;

template <typename T, int64_t DT>
void attend_tokens(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& rows,
                   const at::Tensor& positions, const at::Tensor& tokens, bool write, at::Tensor& out, double scale,
                   double softcap, int64_t window) {
  const int64_t T_all = q.size(0), H = q.size(1), D = q.size(2), N = tokens.size(0);
  const int64_t KV = k_cache.size(0), BLOCKS = k_cache.size(1), BS = k_cache.size(2);
  const int64_t rep = H / KV;
  const T* qp = q.data_ptr<T>();
  const T* knp = k_new.data_ptr<T>();
  const T* vnp = v_new.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int32_t* table = tables.data_ptr<int32_t>();
  const int32_t* row_of = rows.data_ptr<int32_t>();
  const int32_t* pos_of = positions.data_ptr<int32_t>();
  const int32_t* token = tokens.data_ptr<int32_t>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  const int64_t k_tok = k_new.stride(0), k_head = k_new.stride(1);
  const int64_t v_tok = v_new.stride(0), v_head = v_new.stride(1);
  const int64_t table_row = tables.stride(0);
  const int64_t head_stride = BLOCKS * BS * D;  // one KV head's pages
  const auto put = [&](int64_t t, int64_t g) {  // token t's K/V of head g into its slot
    const T* ks = knp + t * k_tok + g * k_head;
    const T* vs = vnp + t * v_tok + g * v_head;
    std::copy(ks, ks + D, kc + g * head_stride + slot[t] * D);
    std::copy(vs, vs + D, vc + g * head_stride + slot[t] * D);
  };
  const auto keys_of = [&](int64_t t, int64_t& first) {  // causal: every key up to the token's own position
    const int64_t n = pos_of[t] + 1;
    first = window > 0 ? std::max<int64_t>(0, n - window) : 0;
    return n - first;
  };
  // a token alone in its row writes its K/V in the task of its last part (the only one that reads them); a row's
  // several tokens read each other's, so theirs go in first. Tasks: (token, KV head, part), parts of a token in a row
  std::vector<char> alone(N, 1);
  std::vector<int64_t> part0(N + 1, 0);  // the token's first part among all parts
  int64_t longest = 1;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = token[i];
    const int32_t r = row_of[t];
    alone[i] = !((t > 0 && row_of[t - 1] == r) || (t + 1 < T_all && row_of[t + 1] == r));
    if (write && !alone[i]) {
      for (int64_t g = 0; g < KV; ++g) put(t, g);
    }
    int64_t first;
    const int64_t L = keys_of(t, first);
    part0[i + 1] = part0[i] + (L + PART_KEYS - 1) / PART_KEYS;
    longest = std::max<int64_t>(longest, std::min<int64_t>(L, PART_KEYS));
  }
  const int64_t parts = part0[N];
  std::vector<int64_t> part_token(parts);
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t p = part0[i]; p < part0[i + 1]; ++p) part_token[p] = i;
  }
  const bool split = parts > N;  // some token has several parts: they meet in a second region
  std::vector<float> tops(split ? parts * KV * rep : 0), totals(tops.size()), accs(tops.size() * D);
  // a task is about 4 * rep * keys * D flops: chunks of at least ~64k of them per thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 4 * rep * longest * D));

  at::parallel_for(0, parts * KV, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rep * D), scores(rep * longest), vf(longest * D), top(rep), total(rep), acc(rep * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task / KV, g = task % KV, i = part_token[p];
      const int64_t t = token[i], nth = p - part0[i], last = part0[i + 1] - 1 - part0[i];
      if (write && alone[i] && nth == last) put(t, g);
      for (int64_t h = 0; h < rep; ++h) {
        const T* qh = qp + t * q_tok + (g * rep + h) * q_head;
        for (int64_t e = 0; e < D; ++e) qf[h * D + e] = widen(qh[e]);
      }
      int64_t first;
      const int64_t L = keys_of(t, first);
      const int64_t from = first + nth * PART_KEYS, count = std::min<int64_t>(PART_KEYS, first + L - from);
      const int64_t slot_of = task * rep;  // this (part, head)'s place among the partial results
      float* tp = split ? tops.data() + slot_of : top.data();
      float* sp = split ? totals.data() + slot_of : total.data();
      float* ap = split ? accs.data() + slot_of * D : acc.data();
      attend_part<T, DT>(kc + g * head_stride, vc + g * head_stride, table + row_of[t] * table_row, BS, from, count,
                         qf.data(), rep, D, static_cast<float>(scale), static_cast<float>(softcap), scores.data(),
                         vf.data(), tp, sp, ap);
      if (!split) merge_parts<T>(1, rep, D, tp, sp, ap, op + (t * H + g * rep) * D, D);
    }
  });
  if (split) {  // each (token, KV head): its parts, strided by KV among the partial results
    at::parallel_for(0, N * KV, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> top, total, acc;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / KV, g = task % KV, n = part0[i + 1] - part0[i];
        top.resize(n * rep), total.resize(n * rep), acc.resize(n * rep * D);
        for (int64_t p = 0; p < n; ++p) {
          const int64_t at = ((part0[i] + p) * KV + g) * rep;
          std::copy(tops.begin() + at, tops.begin() + at + rep, top.begin() + p * rep);
          std::copy(totals.begin() + at, totals.begin() + at + rep, total.begin() + p * rep);
          std::copy(accs.begin() + at * D, accs.begin() + (at + rep) * D, acc.begin() + p * rep * D);
        }
        merge_parts<T>(n, rep, D, top.data(), total.data(), acc.data(), op + (token[i] * H + g * rep) * D, D);
      }
    });
  }
}

// q, k_new, v_new: the step's [tokens, heads or kv_heads, D] (token and head strides free, D contiguous); k_cache,
// v_cache: [kv_heads, blocks, block_size, D] contiguous; slots [T] int64; tables [rows, max_blocks] int32; rows and
// positions [T] int32 (each token's row and position); tokens [N] int32, the tokens attended here; write: their K/V
// go into the pages first (else the caller wrote them); out [T, heads, D] contiguous, written at those tokens.
void attend_short_rows(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor k_cache,
                       at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& rows,
                       const at::Tensor& positions, const at::Tensor& tokens, bool write, at::Tensor out, double scale,
                       double softcap, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3, "q, k_new, v_new must be [tokens, heads, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "the pages must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && k_new.stride(2) == 1 && v_new.stride(2) == 1, "D must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_new.scalar_type() == k_cache.scalar_type() &&
                  v_new.scalar_type() == v_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "q, the new K/V, the pages and out must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && tables.scalar_type() == at::kInt && rows.scalar_type() == at::kInt &&
                  positions.scalar_type() == at::kInt && tokens.scalar_type() == at::kInt,
              "slots int64; tables, rows, positions, tokens int32");
  TORCH_CHECK(tables.stride(1) == 1 && rows.is_contiguous() && positions.is_contiguous() && tokens.is_contiguous() &&
                  slots.is_contiguous() && out.is_contiguous(),
              "tables, rows, positions, tokens, slots, out layout");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == k_cache.size(3), "heads and D must fit the pages");
  TORCH_CHECK(out.sizes() == q.sizes() && rows.size(0) == q.size(0) && positions.size(0) == q.size(0) &&
                  slots.size(0) == q.size(0),
              "out, rows, positions, slots: one per token of q");
  TORCH_CHECK(q.size(2) <= MAX_D, "head dimension over ", MAX_D);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attend_short_rows", [&] {
    switch (q.size(2)) {  // the common head dimensions with their loops sized at compile time
      case 64:
        return attend_tokens<scalar_t, 64>(q, k_new, v_new, k_cache, v_cache, slots, tables, rows, positions, tokens,
                                           write, out, scale, softcap, window);
      case 128:
        return attend_tokens<scalar_t, 128>(q, k_new, v_new, k_cache, v_cache, slots, tables, rows, positions,
                                            tokens, write, out, scale, softcap, window);
      case 256:
        return attend_tokens<scalar_t, 256>(q, k_new, v_new, k_cache, v_cache, slots, tables, rows, positions,
                                            tokens, write, out, scale, softcap, window);
      default:
        return attend_tokens<scalar_t, 0>(q, k_new, v_new, k_cache, v_cache, slots, tables, rows, positions, tokens,
                                          write, out, scale, softcap, window);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def(
      "attend_short_rows(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
      "Tensor tables, Tensor rows, Tensor positions, Tensor tokens, bool write, Tensor(c!) out, float scale, "
      "float softcap, int window) -> ()");
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("attend_short_rows", &attend_short_rows); }
