// Attention of one long prefill row in bf16 on AMX: flash attention (an online softmax over blocks of keys), both
// products by oneDNN's brgemm ukernel (at::native::cpublas, the AMX tiles), the heads that share a KV head folded
// into one block of queries so that each packed key block serves all of them. Every query block reads only the
// key blocks its queries can see (causal, and a sliding window where given), and of those only the slices of
// COLUMNS keys some query sees, so a windowed layer costs its window, not its prefix. Scores, the softmax and the
// output's sums stay float32; the probabilities enter the second product in bf16, as PyTorch's flash kernel rounds
// them, and a row's sum adds those same bf16 probabilities.
//
// flash_attention(q [heads, n_q, D], k [kv_heads, n_k, D], v, out [n_q, heads, D], q_pos, k_pos, window, scale):
// query i sits at position q_pos + i and key j at k_pos + j; a query sees the keys at or before it, and with a
// window w > 0 only those less than w before it (transformers' sliding window). Strides are free but for D's.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <initializer_list>
#include <limits>
#include <vector>

// The kernel is built where the compiler targets AVX-512 (BW, DQ) with bf16 conversions (every CPU with AMX has
// them); elsewhere the op says so and `flash_attention_ready` is false.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
#define SWITCHYARD_FLASH 1
#include <immintrin.h>
#else
#define SWITCHYARD_FLASH 0
#endif

namespace {

using namespace switchyard_cpu;
using bf16 = c10::BFloat16;

constexpr int64_t QUERIES = 64;  // queries of one head in a block; a block's rows are QUERIES x the heads of a KV head
constexpr int64_t KEYS = 256;    // keys in a block: a multiple of COLUMNS; past 256 a row's scores leave the registers
constexpr int64_t COLUMNS = 64;  // the widest B of one brgemm call here (oneDNN's ukernel's packing limit): slices

// V's columns per slice: COLUMNS, or 32 where D is an odd multiple of 32
inline int64_t slice_width(int64_t D) { return D % COLUMNS == 0 ? COLUMNS : 32; }

#if SWITCHYARD_FLASH
// Each KV head's keys as the first product's B (Kᵀ [D, KEYS] a block, in slices of COLUMNS keys) and its values as
// the second's (V [KEYS, D], in slices of `slice_width` columns), written straight into the VNNI layout brgemm reads
// for bf16 (cpublas::pack's): B [K, N] with leading dimension N as [K / 2][N][2], the two rows of a K pair side by
// side. For Kᵀ a VNNI pair is two neighbouring dimensions of one key, a 32-bit word of K's row, so a slice is K's
// words transposed (gathered 16 keys at a time); for V it is the same column of two neighbouring keys, so a slice
// interleaves V's rows in pairs. Keys past n_k are zero (their columns are always masked).
void pack_blocks(const at::Tensor& k, const at::Tensor& v, int64_t blocks, bf16* k_packed, bf16* v_packed) {
  const int64_t kv_heads = k.size(0), n_k = k.size(1), D = k.size(2), wide = slice_width(D), words = D / 2;
  const bf16* kp = k.data_ptr<bf16>();
  const bf16* vp = v.data_ptr<bf16>();
  const int64_t k_row = k.stride(1), v_row = v.stride(1);
  TORCH_CHECK(16 * k_row * 2 <= std::numeric_limits<int32_t>::max(), "K's rows are too far apart to gather");
  // byte offsets of 16 keys' rows, for the gather; VNNI index vectors that interleave two rows' halves
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int32_t>(k_row * 2)));
  alignas(64) int16_t low[32], high[32];
  for (int i = 0; i < 16; ++i) {
    low[2 * i] = i, low[2 * i + 1] = 32 + i;
    high[2 * i] = 16 + i, high[2 * i + 1] = 48 + i;
  }
  const __m512i to_low = _mm512_load_si512(low), to_high = _mm512_load_si512(high);
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, j0 = item % blocks * KEYS, keys = std::min(KEYS, n_k - j0);
      const bf16* kh = kp + h * k.stride(0) + j0 * k_row;
      const bf16* vh = vp + h * v.stride(0) + j0 * v_row;
      // Kᵀ: word w of key j goes to [w][j] of its slice
      uint32_t* kd = reinterpret_cast<uint32_t*>(k_packed + item * D * KEYS);
      for (int64_t j = 0; j < KEYS; j += 16) {
        const int64_t here = std::clamp<int64_t>(keys - j, 0, 16);  // real keys among these 16
        const __mmask16 real = static_cast<__mmask16>((1u << here) - 1u);
        uint32_t* slice = kd + j / COLUMNS * words * COLUMNS + j % COLUMNS;
        const bf16* rows = kh + std::min(j, keys) * k_row;
        for (int64_t w = 0; w < words; ++w) {
          const __m512i got = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, lanes, rows + 2 * w, 1);
          _mm512_storeu_si512(slice + w * COLUMNS, got);
        }
      }
      // V: keys 2p and 2p + 1 side by side, column by column
      bf16* vd = v_packed + item * KEYS * D;
      for (int64_t j = 0; j < KEYS; j += 2) {
        for (int64_t c = 0; c < D; c += 32) {
          const __m512i a = j < keys ? _mm512_loadu_si512(vh + j * v_row + c) : _mm512_setzero_si512();
          const __m512i b = j + 1 < keys ? _mm512_loadu_si512(vh + (j + 1) * v_row + c) : _mm512_setzero_si512();
          bf16* dst = vd + c / wide * wide * KEYS + j * wide + c % wide * 2;
          _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, to_low, b));
          _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, to_high, b));
        }
      }
    }
  });
}

// How far a block's scores may rise above a row's running maximum before the maximum moves, in base 2: up to 2^8,
// probabilities and sums stay well inside float and bf16, and a row rescales its accumulator only when its scores
// grow by more than that, not at every new maximum.
constexpr float SLACK = 8.f;

// 2^y, y <= SLACK, 16 lanes: y = n + f with n = floor(y) and f in [0, 1) (one vreduceps), 2^f by a cubic fitted
// to it over that range (relative error 7.5e-5, against bf16's rounding of 3.9e-3: the probabilities are bf16),
// times 2^n by scalef, which takes the floor of y itself. A far negative y gives 0.
inline __m512 exp2_16(__m512 y) {
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(7.802419e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.22606722f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69583374f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999252f));
  return _mm512_scalef_ps(p, y);
}

// The lanes of the 16 columns from c that a row sees, its visible columns being [lo, hi)
inline __mmask16 seen(int64_t c, int64_t lo, int64_t hi) {
  const int64_t from = std::clamp<int64_t>(lo - c, 0, 16), to = std::clamp<int64_t>(hi - c, 0, 16);
  return static_cast<__mmask16>(((1u << to) - 1u) & ~((1u << from) - 1u));
}

// One row of a block's scores through the online softmax, in base 2, over the block's computed columns [from, to)
// (multiples of 16; the others are neither scored nor read): its visible columns [lo, hi) times `scale`
// (the attention's scale times log2 e), the row's reference maximum `top` (in those units; it moves only past
// SLACK) and sum `total` updated, its probabilities into `p` (bf16, zero where hidden) and its output accumulator
// `acc` (D floats) rescaled when `top` moves.
inline void online_softmax(const float* s, int64_t from, int64_t to, int64_t lo, int64_t hi, float scale, float& top,
                           float& total, bf16* p, float* acc, int64_t D) {
  if (hi <= lo) {  // nothing visible: no probability, the running state as it was
    std::memset(p + from, 0, (to - from) * sizeof(bf16));
    return;
  }
  const int64_t v0 = from / 16, v1 = to / 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const bool whole = lo <= from && hi >= to;
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
  // One pass, two vectors at a time, against the reference `ref`: the exponentials, converted to 32 bf16 at once
  // and summed as they are (by a dot product with ones, so the sum is of the probabilities the second product
  // reads), and the block's own maximum on the way, returned in `scale`'s units
  __m512 sum;
  auto pass = [&](float ref) {
    const __m512 by = _mm512_set1_ps(scale), shift = _mm512_set1_ps(-ref);
    __m512 most = _mm512_set1_ps(neg_inf);
    sum = _mm512_setzero_ps();
    for (int64_t v = v0; v < v1; v += 2) {
      const __m512 x0 = _mm512_loadu_ps(s + v * 16), x1 = _mm512_loadu_ps(s + v * 16 + 16);
      __m512 e0 = exp2_16(_mm512_fmadd_ps(x0, by, shift)), e1 = exp2_16(_mm512_fmadd_ps(x1, by, shift));
      if (whole) {
        most = _mm512_max_ps(most, _mm512_max_ps(x0, x1));
      } else {
        const __mmask16 seen0 = seen(v * 16, lo, hi), seen1 = seen(v * 16 + 16, lo, hi);
        most = _mm512_mask_max_ps(most, seen0, most, x0);
        most = _mm512_mask_max_ps(most, seen1, most, x1);
        e0 = _mm512_maskz_mov_ps(seen0, e0);
        e1 = _mm512_maskz_mov_ps(seen1, e1);
      }
      const __m512bh pair = _mm512_cvtne2ps_pbh(e1, e0);
      sum = _mm512_dpbf16_ps(sum, pair, ones);
      _mm512_storeu_si512(p + v * 16, (__m512i)pair);
    }
    return _mm512_reduce_max_ps(most) * scale;
  };
  float now = top;
  if (now == neg_inf) {  // the row's first visible block: its own maximum first, the reference from then on
    __m512 most = _mm512_set1_ps(neg_inf);
    for (int64_t v = v0; v < v1; ++v) {
      most = _mm512_mask_max_ps(most, whole ? 0xffff : seen(v * 16, lo, hi), most, _mm512_loadu_ps(s + v * 16));
    }
    now = _mm512_reduce_max_ps(most) * scale;
  }
  const float block_top = pass(now);
  if (block_top > now + SLACK) {  // the scores passed the reference by more than the slack: it moves, and the pass
    now = block_top;              // is redone against it
    pass(now);
  }
  // before its first visible key a row's accumulator and sum are still zero: nothing to rescale
  const float rescale = top == neg_inf || top == now ? 1.f : std::exp2(top - now);
  top = now;
  total = total * rescale + _mm512_reduce_add_ps(sum);
  if (rescale != 1.f) {
    const __m512 r = _mm512_set1_ps(rescale);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), r));
  }
}

// A worker's arrays in one allocation, each on its own cache lines and each one line further from a 4 KiB boundary
// than the last: the block loop streams through scores, probabilities and the accumulator at once, and arrays that
// start at the same offset in a page compete for the same L1 sets (where the heap put separate vectors, the kernel
// ran ~6 % slower on 64-wide heads).
class Scratch {
 public:
  explicit Scratch(std::initializer_list<int64_t> bytes) {
    int64_t offset = 0;
    for (const int64_t b : bytes) {
      offset = (offset + 4095) / 4096 * 4096 + 64 * (1 + static_cast<int64_t>(starts_.size()));
      starts_.push_back(offset);
      offset += b;
    }
    memory_ = at::empty({offset + 64}, at::kByte);
  }
  template <typename T>
  T* array(int i) const {
    return reinterpret_cast<T*>(memory_.data_ptr<uint8_t>() + starts_[i]);
  }

 private:
  std::vector<int64_t> starts_;
  at::Tensor memory_;
};

// Work items: (KV head, query block), ordered so that a contiguous share of them holds cheap and costly blocks
// alike (a causal row's later blocks see more keys): the blocks of each KV head go first, last, second, ...
inline int64_t zigzag(int64_t t, int64_t n) { return t % 2 == 0 ? t / 2 : n - 1 - t / 2; }

void flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, int64_t q_pos,
                     int64_t k_pos, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "q, k, v, out: 3-d");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "flash_attention is bf16");
  const int64_t heads = q.size(0), n_q = q.size(1), D = q.size(2), kv_heads = k.size(0), n_k = k.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && v.sizes() == k.sizes() && k.size(2) == D, "k, v: [kv_heads, n_k, D]");
  TORCH_CHECK(out.size(0) == n_q && out.size(1) == heads && out.size(2) == D, "out: [n_q, heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1, "D contiguous");
  TORCH_CHECK(D % 32 == 0, "head_dim must be a multiple of 32");
  TORCH_CHECK(k_pos <= q_pos && q_pos + n_q <= k_pos + n_k, "the keys must run from k_pos past the last query");
  const int64_t wide = slice_width(D), n_rep = heads / kv_heads, blocks = (n_k + KEYS - 1) / KEYS, q_blocks = (n_q + QUERIES - 1) / QUERIES;
  auto k_packed = at::empty({kv_heads * blocks * D * KEYS}, q.options());
  auto v_packed = at::empty({kv_heads * blocks * KEYS * D}, q.options());
  pack_blocks(k, v, blocks, k_packed.data_ptr<bf16>(), v_packed.data_ptr<bf16>());
  const bf16* qp = q.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float fscale = static_cast<float>(scale * 1.4426950408889634), neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t rows_max = n_rep * QUERIES;

  at::parallel_for(0, kv_heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch({rows_max * D * 2, rows_max * KEYS * 2, rows_max * KEYS * 4, rows_max * D * 4});
    bf16* q_rows = scratch.array<bf16>(0);
    bf16* probs = scratch.array<bf16>(1);
    float* scores = scratch.array<float>(2);
    float* acc = scratch.array<float>(3);
    std::vector<float> top(rows_max), total(rows_max);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / q_blocks, qb = zigzag(item % q_blocks, q_blocks);
      const int64_t i0 = qb * QUERIES, queries = std::min(QUERIES, n_q - i0), rows = n_rep * queries;
      // row r: query head h * n_rep + r / queries, query i0 + r % queries
      for (int64_t r = 0; r < rows; ++r) {
        const bf16* src = qp + (h * n_rep + r / queries) * q.stride(0) + (i0 + r % queries) * q.stride(1);
        std::memcpy(q_rows + r * D, src, D * sizeof(bf16));
      }
      std::fill(top.begin(), top.begin() + rows, neg_inf);
      std::fill(total.begin(), total.begin() + rows, 0.f);
      const int64_t first_pos = q_pos + i0, last_pos = first_pos + queries - 1;
      const int64_t j_lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1 - k_pos) : 0;
      const int64_t j_hi = std::min(n_k, last_pos - k_pos + 1);
      for (int64_t b = j_lo / KEYS; b * KEYS < j_hi; ++b) {
        const int64_t j0 = b * KEYS, packed = h * blocks + b;
        const bf16* kb = k_packed.data_ptr<bf16>() + packed * D * KEYS;
        // the block's columns some row of the block sees, in whole slices: the rest is neither scored nor summed
        const int64_t from = std::max<int64_t>(0, j_lo - j0) / COLUMNS * COLUMNS;
        const int64_t to = (std::min(KEYS, j_hi - j0) + COLUMNS - 1) / COLUMNS * COLUMNS;
        for (int64_t c = from; c < to; c += COLUMNS) {
          at::native::cpublas::brgemm(rows, COLUMNS, D, D, COLUMNS, KEYS, false, q_rows, kb + c * D,
                                      scores + c);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t pos = first_pos + r % queries;
          // the row's visible columns of the block: one interval
          const int64_t lo = std::max<int64_t>(0, window > 0 ? pos - window + 1 - k_pos - j0 : 0);
          const int64_t hi = std::min({KEYS, pos - k_pos - j0 + 1, n_k - j0});
          online_softmax(scores + r * KEYS, from, to, lo, hi, fscale, top[r], total[r], probs + r * KEYS,
                         acc + r * D, D);
        }
        const bf16* vb = v_packed.data_ptr<bf16>() + packed * KEYS * D;
        for (int64_t c = 0; c < D; c += wide) {
          // the first block sets the accumulator (a row that sees none of it gets zeros), later ones add to it
          at::native::cpublas::brgemm(rows, wide, to - from, KEYS, wide, D, b > j_lo / KEYS, probs + from,
                                      vb + c * KEYS + from * wide, acc + c);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        bf16* dst = op + (i0 + r % queries) * out.stride(0) + (h * n_rep + r / queries) * out.stride(1);
        const float* a = acc + r * D;
        const float inv = 1.f / total[r];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) store(dst + d, a[d] * inv);
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

#else
void flash_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                     int64_t, double) {
  TORCH_CHECK(false, "flash_attention needs AVX-512 with bf16 (this build's CPU has none)");
}
#endif

// Whether brgemm runs bf16 here (oneDNN's ukernel on a CPU with AMX): where it does not, the tiled path keeps SDPA.
bool flash_attention_ready() { return SWITCHYARD_FLASH && at::native::cpublas::could_pack(at::kBFloat16); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def(
      "flash_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int q_pos, int k_pos, int window, float scale) "
      "-> ()");
  m.def("flash_attention_ready() -> bool", &flash_attention_ready);
}

TORCH_LIBRARY_IMPL(switchyard_cpu, CPU, m) { m.impl("flash_attention", &flash_attention); }
