// Stage 2 (Hybrid Sparse Attention) for one decode token per row, on CPU.
//
// The same math as rocketkv_vllm/ops/pytorch.py (its test oracle) in one pass per
// (row, KV head): fold the newest key into its KT page, choose top-r
// channels, score every page of the row's view by its min/max bound, take
// the top pages by the token-count weighted, SparQ-tempered softmax
// averaged over the query group, then attend exactly over those pages'
// tokens. PyTorch needs ~40 small operators for this; here it is one call.
// The (row, KV head) items run on torch's intra-op threads (at::parallel_for,
// the threads vLLM's CPU worker pins), not on an OpenMP runtime of our own,
// which would fight that one.
//
// The KV cache is vLLM CPU_ATTN's: each head's block holds block_size K
// rows then block_size V rows of d elements, K packed per `layout`:
//   0 "head_rows": K[s][c] at s*d + c,     V at bs*d + s*d + c
//   1 "cpu_vec":   K[s][c] at c*bs + s,     V as head_rows (vec / vec16 kernels)
//   2 "cpu_amx":   K at (s/16)*16*d + (c/2)*32 + (s%16)*2 + c%2,
//                  V at bs*d + (c/16)*16*bs + (s/2)*32 + (c%16)*2 + s%2
// Any head size d in layouts 0 and 1 (CPU_ATTN's vec / vec16 kernels serve
// 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512); layout 2 (AMX) for d
// and block_size divisible by 32, as CPU_ATTN chooses it.
// The view of a compressed row is [0, num_compact) then [tail_start,
// seq_len), cut into pages of page_size tokens (see rocketkv_vllm/layout.py).
// KT rows are [min | max] in the cache dtype, or (uint8 kt_cache) the fp8
// rows of rocketkv_vllm/algorithm/kt_fp8.py: 2d e4m3 codes, rounded outward,
// and a power-of-two fp32 scale.
// An fp8 KV cache (vLLM's kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2) is uint8
// in the same layouts, one byte per element: each a code of value / scale
// with the layer's k or v scale (rocketkv_vllm/fp8_kv.py); its KT rows are
// always the fp8 rows.
// Optional attention sinks (gpt-oss): one fp32 logit per query head, compared
// with the scaled logits, that joins the exact attention's softmax
// denominator and has no value (rocketkv_vllm/algorithm/sinks.py).
// Optional selection store (rocketkv_vllm/ops/base.py, Stage2.decode): int32
// [S, Hkv, W] view page indices; a row with a slot either writes the pages it
// chose there or (reuse) attends the ones stored instead of choosing. A (row,
// KV head) whose n stored entries do not fit the store or are not all pages of
// its view chooses and writes instead (as the Triton kernels and the PyTorch
// path do): a bad entry is never read as a page, and never stops the engine.

// ATen and torch/python.h (the pybind11 tensor casters), not torch/extension.h:
// the whole C++ frontend it adds is a third of the build time and unused here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

template <int LAYOUT>
struct Cache {
  int64_t block_stride, head_stride, bs, d;

  inline int64_t k_off(int64_t s, int64_t c) const {
    if constexpr (LAYOUT == 1) return c * bs + s;
    if constexpr (LAYOUT == 2) return (s / 16) * 16 * d + (c / 2) * 32 + (s % 16) * 2 + c % 2;
    return s * d + c;
  }
  inline int64_t v_off(int64_t s, int64_t c) const {
    if constexpr (LAYOUT == 2)
      return bs * d + (c / 16) * 16 * bs + (s / 2) * 32 + (c % 16) * 2 + s % 2;
    return bs * d + s * d + c;
  }
};

// A bf16 value is the upper half of a float's bits.
inline float float_from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}
inline float bf16_pair_lo(uint32_t u) { return float_from_bits(u << 16); }
inline float bf16_pair_hi(uint32_t u) { return float_from_bits(u & 0xffff0000u); }
inline float to_float(c10::BFloat16 x) { return bf16_pair_lo(x.x); }
template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// Smallest power of two s with maxabs <= 448 * s (1 for an all-zero row).
inline float fp8_row_scale(float maxabs) {
  if (!(maxabs > 0.f)) return 1.f;
  int exp;
  const float frac = std::frexp(maxabs / 448.f, &exp);
  return std::ldexp(1.f, frac == 0.5f ? exp - 1 : exp);
}

// e4m3 code of y (|y| <= 448) rounded toward +inf (upward) or -inf.
inline uint8_t fp8_outward(float y, bool upward) {
  const float m = std::fabs(y);
  uint32_t code;
  bool exact;
  if (m >= 0x1p-6f) {
    uint32_t bits;
    std::memcpy(&bits, &m, sizeof bits);
    code = ((((bits >> 23) & 0xff) - 127 + 7) << 3) | ((bits >> 20) & 7);
    exact = (bits & 0xfffff) == 0;
  } else {
    const float t = m * 512.f;
    code = static_cast<uint32_t>(t);
    exact = static_cast<float>(code) == t;
  }
  if (!exact && (upward ? y >= 0.f : y < 0.f)) code += 1;
  return static_cast<uint8_t>(y < 0.f ? code | 0x80 : code);
}

// e4m3 code times scale. A normal code's exponent and mantissa bits, moved
// into a float's and rebiased, are its value (2^(e-7) * (1 + m/8)); a
// subnormal one is m * 2^-9. Both, then a bit-mask select: integer ops the
// compiler vectorizes (a 256-entry table would be a gather, a ?: a branch
// that stops vectorization). NaN codes never come from the encoder.
inline float fp8_value(uint32_t code, float scale) {
  const uint32_t mag = code & 0x7f;
  const uint32_t normal = float_bits(float_from_bits((mag << 20) + (120u << 23)) * scale);
  const uint32_t sub = float_bits(static_cast<float>(mag) * 0x1p-9f * scale);
  const uint32_t is_normal = 0u - static_cast<uint32_t>(mag >= 8);
  return float_from_bits((normal & is_normal) | (sub & ~is_normal) | ((code & 0x80) << 24));
}

// K and V elements as floats: the cache dtype's, or (FP8_KV) fp8 codes in
// format `fmt` (1 e4m3, 2 e5m2) times the layer's k or v scale, looked up in
// two 256-entry tables built once per call (NaN codes stay NaN).
template <bool FP8_KV>
struct KvDecode {
  float k_table[FP8_KV ? 256 : 1], v_table[FP8_KV ? 256 : 1];

  KvDecode(int64_t fmt, float k_scale, float v_scale) {
    if constexpr (FP8_KV) {
      for (int code = 0; code < 256; ++code) {
        const uint8_t bits = static_cast<uint8_t>(code);
        const float v = fmt == 1
            ? static_cast<float>(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits()))
            : static_cast<float>(c10::Float8_e5m2(bits, c10::Float8_e5m2::from_bits()));
        k_table[code] = v * k_scale;
        v_table[code] = v * v_scale;
      }
    }
  }
  template <typename E>
  inline float key(E x) const {
    if constexpr (FP8_KV) return k_table[x];
    else return to_float(x);
  }
  template <typename E>
  inline float val(E x) const {
    if constexpr (FP8_KV) return v_table[x];
    else return to_float(x);
  }
};

// KT row access: [min | max] as 2d floats, in either format.
template <typename T, bool FP8>
struct KtRows {
  using Elem = std::conditional_t<FP8, uint8_t, T>;
  int64_t d;

  inline void read(const Elem* row, float* out) const {
    if constexpr (FP8) {
      float scale;
      std::memcpy(&scale, row + 2 * d, sizeof scale);
#pragma omp simd
      for (int64_t k = 0; k < 2 * d; ++k) out[k] = fp8_value(row[k], scale);
    } else {
#pragma omp simd
      for (int64_t k = 0; k < 2 * d; ++k) out[k] = to_float(row[k]);
    }
  }
  // The bound of each channel as d floats: max where take_max[c] is all
  // ones, min where it is zero (a bit-mask select, so the loop vectorizes;
  // only the chosen half is converted).
  inline void read_bound(const Elem* row, const uint32_t* take_max, float* out) const {
    if constexpr (FP8) {
      float scale;
      std::memcpy(&scale, row + 2 * d, sizeof scale);
#pragma omp simd
      for (int64_t c = 0; c < d; ++c)
        out[c] = fp8_value((row[d + c] & take_max[c]) | (row[c] & ~take_max[c]), scale);
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#pragma omp simd
      for (int64_t c = 0; c < d; ++c)
        out[c] = float_from_bits(((row[d + c].x & take_max[c]) | (row[c].x & ~take_max[c]))
                                 << 16);
    } else {
      for (int64_t c = 0; c < d; ++c) out[c] = to_float(take_max[c] ? row[d + c] : row[c]);
    }
  }
  inline void write(Elem* row, const float* in) const {
    if constexpr (FP8) {
      float maxabs = 0.f;
      for (int64_t k = 0; k < 2 * d; ++k) maxabs = std::max(maxabs, std::fabs(in[k]));
      const float scale = fp8_row_scale(maxabs);
      for (int64_t k = 0; k < 2 * d; ++k) row[k] = fp8_outward(in[k] / scale, k >= d);
      std::memcpy(row + 2 * d, &scale, sizeof scale);
      std::memset(row + 2 * d + 4, 0, 12);
    } else {
      for (int64_t k = 0; k < 2 * d; ++k) row[k] = static_cast<T>(in[k]);
    }
  }
};

// Tokens [s0, s0 + n) of one head's block as float K and V rows
// (row-major, d floats each). The AMX layout keeps bf16 channels in pairs in
// 32-bit words (K: two channels of one token, consecutive tokens in
// consecutive words; V: one channel of two neighbouring tokens): one load per
// pair, and the tokens of a page come from the same cache lines.
template <typename E, int LAYOUT, bool FP8_KV>
inline void load_tokens(const Cache<LAYOUT>& cache, const KvDecode<FP8_KV>& kvd, const E* head,
                        int64_t s0, int64_t n, float* keys, float* vals) {
  const int64_t d = cache.d, bs = cache.bs;
  if constexpr (LAYOUT == 2 && std::is_same_v<E, c10::BFloat16>) {
    uint32_t word;
    for (int64_t s = s0; s < s0 + n;) {
      // K: word (c / 2) * 16 + s % 16 of the 16-token group holding s.
      const int64_t run = std::min<int64_t>(s0 + n - s, 16 - s % 16);
      const E* k = head + (s / 16) * 16 * d + (s % 16) * 2;
      float* rows = keys + (s - s0) * d;
      for (int64_t c = 0; c < d; c += 2)
        for (int64_t j = 0; j < run; ++j) {
          std::memcpy(&word, k + c * 16 + j * 2, sizeof word);
          rows[j * d + c] = bf16_pair_lo(word);
          rows[j * d + c + 1] = bf16_pair_hi(word);
        }
      s += run;
    }
    const E* v = head + bs * d;
    for (int64_t s = s0; s < s0 + n; s = (s | 1) + 1) {
      // V: tokens s & ~1 and s | 1 share one word per channel.
      const E* pair = v + (s / 2) * 32;
      const bool has_even = s % 2 == 0, has_odd = (s | 1) < s0 + n;
      float* even = has_even ? vals + (s - s0) * d : nullptr;
      float* odd = has_odd ? vals + ((s | 1) - s0) * d : nullptr;
      for (int64_t g = 0; g < d; g += 16)
        for (int64_t c = g; c < g + 16; ++c) {
          std::memcpy(&word, pair + g * bs + (c - g) * 2, sizeof word);
          if (has_even) even[c] = bf16_pair_lo(word);
          if (has_odd) odd[c] = bf16_pair_hi(word);
        }
    }
  } else {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < d; ++c) {
        keys[j * d + c] = kvd.key(head[cache.k_off(s0 + j, c)]);
        vals[j * d + c] = kvd.val(head[cache.v_off(s0 + j, c)]);
      }
  }
}

// A row's view, [0, nc) then [ts, seq), in pages of ps tokens.
struct View {
  int64_t nc, ts, seq, ps, compact_pages, num_pages;

  View(int64_t nc, int64_t ts, int64_t seq, int64_t ps)
      : nc(nc), ts(ts), seq(seq), ps(ps), compact_pages((nc + ps - 1) / ps),
        num_pages(compact_pages + (seq - ts + ps - 1) / ps) {}
  inline int64_t start(int64_t p) const {
    return p < compact_pages ? p * ps : ts + (p - compact_pages) * ps;
  }
  inline int64_t tokens(int64_t p) const {
    return std::min<int64_t>(ps, (p < compact_pages ? nc : seq) - start(p));
  }
  inline int64_t current() const { return compact_pages + (seq - 1 - ts) / ps; }
  // Pages a row attends: num_select (at least one), plus the forced current page.
  inline int64_t selection_size(int64_t num_select, bool force_current_page) const {
    return std::min<int64_t>(std::max<int64_t>(num_select, 1) + force_current_page, num_pages);
  }
};

// The selection store: entries [S, Hkv, width], each row's slot (-1: none)
// and reuse flag; entries == nullptr when the call has none.
struct Selections {
  int32_t* entries;
  const int32_t* slot;
  const int32_t* reuse;
  int64_t width;
};

template <typename T, int LAYOUT, bool FP8, bool FP8_KV>
void hsa_decode_impl(const torch::Tensor& query, torch::Tensor& kv_cache,
                     torch::Tensor& kt_cache, const torch::Tensor& block_table,
                     const torch::Tensor& num_compact, const torch::Tensor& tail_start,
                     const torch::Tensor& seq_lens, const torch::Tensor& topr,
                     const torch::Tensor& num_select, int64_t page_size, double scale,
                     bool force_current_page, const float* sinks, const KvDecode<FP8_KV>& kvd,
                     const Selections& sel, torch::Tensor& out) {
  using E = std::conditional_t<FP8_KV, uint8_t, T>;  // a KV element
  const int64_t B = query.size(0), Hq = query.size(1), d = query.size(2);
  const int64_t Hkv = kv_cache.size(1), bs = kv_cache.size(2);
  const int64_t G = Hq / Hkv;
  const Cache<LAYOUT> cache{kv_cache.stride(0), kv_cache.stride(1), bs, d};
  E* kv = static_cast<E*>(kv_cache.data_ptr());
  using Kt = KtRows<T, FP8>;
  const Kt kt_rows{d};
  auto* kt = static_cast<typename Kt::Elem*>(kt_cache.data_ptr());
  const int64_t kt_sb = kt_cache.stride(0), kt_sh = kt_cache.stride(1),
                kt_sp = kt_cache.stride(2);
  const T* q_ptr = query.data_ptr<T>();
  const int64_t q_sb = query.stride(0), q_sh = query.stride(1);
  T* o_ptr = out.data_ptr<T>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  const int32_t* nc_p = num_compact.data_ptr<int32_t>();
  const int32_t* ts_p = tail_start.data_ptr<int32_t>();
  const int32_t* sl_p = seq_lens.data_ptr<int32_t>();
  const int32_t* topr_p = topr.data_ptr<int32_t>();
  const int32_t* ns_p = num_select.data_ptr<int32_t>();
  const int64_t ps = page_size;

  // 1. KT update: the newest key of every row into its page's min | max.
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t pos = sl_p[b] - 1;
      if (pos < 0) continue;
      const int64_t block = table[b * table_stride + pos / bs], off = pos % bs;
      E* head = kv + block * cache.block_stride + h * cache.head_stride;
      auto* page = kt + block * kt_sb + h * kt_sh + (off / ps) * kt_sp;
      const bool fresh = pos % ps == 0;
      std::vector<float> row(2 * d);
      kt_rows.read(page, row.data());
      for (int64_t c = 0; c < d; ++c) {
        const float key = kvd.key(head[cache.k_off(off, c)]);
        row[c] = fresh ? key : std::min(row[c], key);
        row[d + c] = fresh ? key : std::max(row[d + c], key);
      }
      kt_rows.write(page, row.data());
    }
  }

  // 2. Page choice and sparse attention per (row, KV head): independent items
  // (each writes its own query heads' output rows and store entry), spread
  // over torch's intra-op threads.
  //
  // Page choice: the view's pages for query group q [G, d], the n most
  // probable first (in no particular order).
  auto choose_pages = [&](int64_t b, int64_t h, const View& view, int64_t n,
                          const std::vector<float>& q) {
    const int64_t num_pages = view.num_pages;
    // Channels: top-r of the group's summed |q|; sign of the group's sum.
    std::vector<float> mag(d, 0.f), sum(d, 0.f);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < d; ++c) {
        mag[c] += std::fabs(q[g * d + c]);
        sum[c] += q[g * d + c];
      }
    const int64_t r = std::min<int64_t>(std::max<int64_t>(topr_p[b], 1), d);
    std::vector<int64_t> chan(d);
    std::iota(chan.begin(), chan.end(), 0);
    std::partial_sort(chan.begin(), chan.begin() + r, chan.end(),
                      [&](int64_t a, int64_t c) { return mag[a] > mag[c]; });
    chan.resize(r);
    // The bound reads max where the group's sum is positive, else min; a
    // query row zero off the chosen channels, scaled by the SparQ
    // temperature, makes scoring a page one dense dot product over d.
    std::vector<float> q_sel(G * d, 0.f);
    std::vector<uint32_t> take_max(d);
    for (int64_t c = 0; c < d; ++c) take_max[c] = sum[c] > 0.f ? ~0u : 0u;
    for (int64_t g = 0; g < G; ++g) {
      float all = 0.f, kept = 0.f;
      for (int64_t c = 0; c < d; ++c) all += std::fabs(q[g * d + c]);
      for (int64_t i = 0; i < r; ++i) kept += std::fabs(q[g * d + chan[i]]);
      const float tau = std::sqrt(d * kept / std::max(all, 1e-30f));
      const float inv_tau = 1.f / std::max(tau, 1e-30f);
      for (int64_t i = 0; i < r; ++i) q_sel[g * d + chan[i]] = q[g * d + chan[i]] * inv_tau;
    }
    // Page logits [G, P] and token counts.
    std::vector<float> logits(G * num_pages), bound(d);
    std::vector<int64_t> page_tokens(num_pages);
    for (int64_t p = 0; p < num_pages; ++p) {
      const int64_t start = view.start(p);
      page_tokens[p] = view.tokens(p);
      const int64_t block = table[b * table_stride + start / bs];
      kt_rows.read_bound(kt + block * kt_sb + h * kt_sh + ((start % bs) / ps) * kt_sp,
                         take_max.data(), bound.data());
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = &q_sel[g * d];
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < d; ++c) s += qg[c] * bound[c];
        logits[g * num_pages + p] = s;
      }
    }
    // Token-count weighted softmax per query head, averaged over the group.
    std::vector<float> probs(num_pages, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      float* l = &logits[g * num_pages];
      const float peak = *std::max_element(l, l + num_pages);
      float denom = 0.f;
      for (int64_t p = 0; p < num_pages; ++p) {
        l[p] = std::exp(l[p] - peak);
        denom += page_tokens[p] * l[p];
      }
      const float inv = 1.f / (G * std::max(denom, 1e-30f));
      for (int64_t p = 0; p < num_pages; ++p) probs[p] += l[p] * inv;
    }
    if (force_current_page) probs[view.current()] = 2.f;
    std::vector<int64_t> order(num_pages);
    std::iota(order.begin(), order.end(), 0);
    std::nth_element(order.begin(), order.begin() + (n - 1), order.end(),
                     [&](int64_t a, int64_t c) { return probs[a] > probs[c]; });
    return order;
  };
  auto row_head = [&](int64_t b, int64_t h) {
    const int64_t seq = sl_p[b];
    if (seq <= 0) return;
    const View view(nc_p[b], ts_p[b], seq, ps);
    const int64_t n = view.selection_size(ns_p[b], force_current_page);
    std::vector<float> q(G * d);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < d; ++c)
        q[g * d + c] = to_float(q_ptr[b * q_sb + (h * G + g) * q_sh + c]);
    const int64_t slot = sel.entries ? sel.slot[b] : -1;
    int32_t* entry = slot >= 0 ? sel.entries + (slot * Hkv + h) * sel.width : nullptr;
    const bool reusing = entry && sel.reuse[b] && n <= sel.width &&
                         std::all_of(entry, entry + n, [&](int32_t p) {
                           return p >= 0 && p < view.num_pages;
                         });
    std::vector<int64_t> order;
    if (reusing) {
      order.assign(entry, entry + n);  // no scoring: what reuse saves
    } else {
      order = choose_pages(b, h, view, n, q);
      if (entry && n <= sel.width) std::copy(order.begin(), order.begin() + n, entry);
    }
    // Exact attention over the chosen pages' tokens: gather them into
    // float rows, then logits, softmax and the weighted sum of values per
    // query head, in loops the compiler vectorizes.
    int64_t num_tokens = 0;
    for (int64_t i = 0; i < n; ++i) num_tokens += view.tokens(order[i]);
    std::vector<float> keys(num_tokens * d), vals(num_tokens * d), w(num_tokens),
        acc(d);
    int64_t t = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = order[i];
      // A page lies in one block (page_size divides block_size).
      const int64_t start = view.start(p), tokens = view.tokens(p);
      const int64_t block = table[b * table_stride + start / bs];
      const E* head = kv + block * cache.block_stride + h * cache.head_stride;
      load_tokens(cache, kvd, head, start % bs, tokens, &keys[t * d], &vals[t * d]);
      t += tokens;
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = &q[g * d];
      // A sink enters the max too, so exp never overflows.
      float peak = sinks ? sinks[h * G + g] : -std::numeric_limits<float>::infinity();
      for (int64_t u = 0; u < num_tokens; ++u) {
        const float* key = &keys[u * d];
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < d; ++c) s += qg[c] * key[c];
        w[u] = s * static_cast<float>(scale);
        peak = std::max(peak, w[u]);
      }
      float den = 0.f;
      for (int64_t u = 0; u < num_tokens; ++u) {
        w[u] = std::exp(w[u] - peak);
        den += w[u];
      }
      if (sinks) den += std::exp(sinks[h * G + g] - peak);  // no value: denominator only
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t u = 0; u < num_tokens; ++u) {
        const float* val = &vals[u * d];
        const float wu = w[u];
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) acc[c] += wu * val[c];
      }
      T* o = o_ptr + (b * Hq + h * G + g) * d;
      const float inv = den > 0.f ? 1.f / den : 0.f;
      for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(acc[c] * inv);
    }
  };
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) row_head(i / Hkv, i % Hkv);
  });
}

// The store's tensors and the rows' slots checked (caller bugs); the stored
// entries are checked where read (row_head: a bad one means choosing anew).
Selections check_selections(const std::optional<torch::Tensor>& selections,
                            const std::optional<torch::Tensor>& sel_slot,
                            const std::optional<torch::Tensor>& reuse, int64_t num_kv_heads,
                            const torch::Tensor& sl) {
  const bool given = selections.has_value();
  TORCH_CHECK(sel_slot.has_value() == given && reuse.has_value() == given,
              "hsa_decode: selections, sel_slot and reuse come together");
  if (!given) return {nullptr, nullptr, nullptr, 0};
  const int64_t B = sl.size(0);
  TORCH_CHECK(selections->device().is_cpu() && selections->scalar_type() == torch::kInt32 &&
                  selections->dim() == 3 && selections->is_contiguous(),
              "hsa_decode: selections must be a contiguous int32 CPU tensor [S, Hkv, W]");
  TORCH_CHECK(selections->size(1) == num_kv_heads, "hsa_decode: selections must be [S, ",
              num_kv_heads, ", W], got ", selections->sizes());
  for (const auto* t : {&*sel_slot, &*reuse})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt32 && t->dim() == 1 &&
                    t->size(0) == B && t->is_contiguous(),
                "hsa_decode: sel_slot and reuse must be contiguous int32 CPU tensors [", B,
                "], got ", t->scalar_type(), " ", t->sizes());
  const Selections sel{selections->data_ptr<int32_t>(), sel_slot->data_ptr<int32_t>(),
                       reuse->data_ptr<int32_t>(), selections->size(2)};
  const int64_t S = selections->size(0);
  const int32_t* sl_p = sl.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    if (sl_p[b] <= 0) continue;  // padding: never touches the store
    const int64_t slot = sel.slot[b];
    TORCH_CHECK(slot >= -1 && slot < S, "hsa_decode: row ", b, "'s sel_slot ", slot,
                " is outside [-1, ", S, ")");
  }
  return sel;
}

}  // namespace

// query [B, Hq, d]; kv_cache [num_blocks, Hkv, bs, 2d] (each head's block a
// contiguous 2*bs*d run, blocks and heads at any stride); kt_cache
// [num_blocks, Hkv, bs/page_size, 2d] (last dim contiguous), or uint8
// [..., 2d + 16] fp8 rows; int32 [B]
// columns; sinks: None or [Hq] sink logits (any float dtype); kv_format 0
// (kv_cache in query's dtype) or, for a uint8 kv_cache of fp8 codes, 1 (e4m3)
// or 2 (e5m2) with the layer's k_scale and v_scale; selections, sel_slot,
// reuse: all three None, or the selection store int32 [S, Hkv, W] and int32
// [B] slots (-1: none) and reuse flags. Returns [B, Hq, d] in query's dtype.
torch::Tensor hsa_decode(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor kt_cache,
                         torch::Tensor block_table, torch::Tensor num_compact,
                         torch::Tensor tail_start, torch::Tensor seq_lens, torch::Tensor topr,
                         torch::Tensor num_select, int64_t page_size, double scale,
                         bool force_current_page, int64_t layout,
                         std::optional<torch::Tensor> sinks, int64_t kv_format, double k_scale,
                         double v_scale, std::optional<torch::Tensor> selections,
                         std::optional<torch::Tensor> sel_slot,
                         std::optional<torch::Tensor> reuse) {
  TORCH_CHECK(query.device().is_cpu(), "hsa_decode: CPU tensors only");
  const bool fp8_kt = kt_cache.scalar_type() == at::ScalarType::Byte;
  const bool fp8_kv = kv_format != 0;
  TORCH_CHECK(kv_format >= 0 && kv_format <= 2, "hsa_decode: kv_format must be 0, 1 or 2");
  TORCH_CHECK((fp8_kv ? kv_cache.scalar_type() == at::ScalarType::Byte && fp8_kt
                      : kv_cache.scalar_type() == query.scalar_type()) &&
                  (fp8_kt || kt_cache.scalar_type() == query.scalar_type()),
              "hsa_decode: query, kv_cache and kt_cache must share a dtype "
              "(or kt_cache holds uint8 fp8 rows; an fp8 kv_cache is uint8 codes with "
              "fp8 KT rows)");
  TORCH_CHECK(kt_cache.size(3) == (fp8_kt ? 2 * query.size(2) + 16 : 2 * query.size(2)),
              "hsa_decode: KT rows must hold 2 * head_dim values (+16 bytes in fp8)");
  TORCH_CHECK(kv_cache.stride(3) == 1 && kv_cache.stride(2) == kv_cache.size(3),
              "hsa_decode: each head's block must be contiguous");
  TORCH_CHECK(kt_cache.stride(3) == 1, "hsa_decode: KT rows must be contiguous");
  TORCH_CHECK(layout >= 0 && layout <= 2, "hsa_decode: layout must be 0, 1 or 2");
  // CPU_ATTN packs AMX tiles only for head sizes and block sizes divisible by
  // 32 (others get its vec16 kernels, layout 1); the tile offsets above
  // assume them.
  TORCH_CHECK(layout != 2 || (query.size(2) % 32 == 0 && kv_cache.size(2) % 32 == 0),
              "hsa_decode: the AMX layout needs head_size and block_size divisible by 32, "
              "got ", query.size(2), " and ", kv_cache.size(2));
  torch::Tensor sink_f;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == query.size(1),
                "hsa_decode: sinks must be [num_q_heads], got ", sinks->sizes());
    sink_f = sinks->to(torch::kFloat32).contiguous();
  }
  const float* sink_p = sinks.has_value() ? sink_f.data_ptr<float>() : nullptr;
  auto q = query.contiguous();
  auto out = torch::empty_like(q);
  auto as_i32 = [](const torch::Tensor& t) { return t.to(torch::kInt32).contiguous(); };
  auto table = block_table.to(torch::kInt32);
  if (table.stride(1) != 1) table = table.contiguous();
  auto nc = as_i32(num_compact), ts = as_i32(tail_start), sl = as_i32(seq_lens),
       tr = as_i32(topr), ns = as_i32(num_select);
  const Selections sel = check_selections(selections, sel_slot, reuse, kv_cache.size(1), sl);
  // The dtypes vLLM serves in (no float64): each one is 9 instantiations
  // (3 layouts x 3 KV/KT formats), the bulk of the first-use build.
  auto for_dtype = [&](auto dtype_tag) {
    using scalar_t = typename decltype(dtype_tag)::type;
    auto run = [&](auto layout_tag) {
      constexpr int L = decltype(layout_tag)::value;
      if (fp8_kv)
        hsa_decode_impl<scalar_t, L, true, true>(
            q, kv_cache, kt_cache, table, nc, ts, sl, tr, ns, page_size, scale,
            force_current_page, sink_p,
            KvDecode<true>(kv_format, static_cast<float>(k_scale),
                           static_cast<float>(v_scale)),
            sel, out);
      else if (fp8_kt)
        hsa_decode_impl<scalar_t, L, true, false>(
            q, kv_cache, kt_cache, table, nc, ts, sl, tr, ns, page_size, scale,
            force_current_page, sink_p, KvDecode<false>(0, 1.f, 1.f), sel, out);
      else
        hsa_decode_impl<scalar_t, L, false, false>(
            q, kv_cache, kt_cache, table, nc, ts, sl, tr, ns, page_size, scale,
            force_current_page, sink_p, KvDecode<false>(0, 1.f, 1.f), sel, out);
    };
    if (layout == 1) run(std::integral_constant<int, 1>{});
    else if (layout == 2) run(std::integral_constant<int, 2>{});
    else run(std::integral_constant<int, 0>{});
  };
  switch (q.scalar_type()) {
    case at::ScalarType::Float: for_dtype(std::type_identity<float>{}); break;
    case at::ScalarType::Half: for_dtype(std::type_identity<c10::Half>{}); break;
    case at::ScalarType::BFloat16: for_dtype(std::type_identity<c10::BFloat16>{}); break;
    default:
      TORCH_CHECK(false, "hsa_decode: query must be float32, float16 or bfloat16, got ",
                  q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("hsa_decode", &hsa_decode, "RocketKV Stage 2 decode on CPU (one token per row)");
}
