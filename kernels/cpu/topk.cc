// Top-k fold as an XLA FFI CPU handler: the k best rows of a block merged into a
// running top-k state, as adv_jax_math.top_k's TopK monoid merges its fold of the
// block into the state (monoids/topk.py), with the same order and ties.
//
// Inputs (B: leading batch dimensions, all alike):
//   values (B, R, T) float32   the block: R rows, T items per row
//   idx    (B, R)    int32     the rows' global indices
//   alive  (B, R)    int32     0: the row is left out (weight 0)
//   vals   (B, K, T) float32   the state: K slots per item, best first
//   rows   (B, K, T) int32     the slots' rows (INT32_MAX: an empty slot)
// Outputs: the new state, (B, K, T) float32 and int32. Attribute smallest (0/1).
//
// Order: a value's key is its IEEE total-order integer (-0.0 below +0.0), every NaN
// the highest, bit-inverted for smallest; an empty slot's key is the lowest. A
// candidate is better with the higher key, then the lower row. Each item's state is
// kept sorted; a row of the block only enters where it beats the item's k-th slot,
// which the block's rows are compared against T at a time (vectorized): past the
// first rows of a long reduction almost none do, so the block costs about one
// compare per value, where a sort (lax.top_k) and a merge network cost many.

#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(ADV_JAX_MATH_TARGET_CLONES)
#define ADV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ADV_CLONES
#endif

namespace {

constexpr int32_t kEmptyRow = std::numeric_limits<int32_t>::max();
constexpr int32_t kLowest = std::numeric_limits<int32_t>::min();
constexpr int kLanes = 16;  // items compared at once against their k-th slots

// The order key of a float32 (its bits), inverted (~) for smallest.
inline int32_t Key(float v, int32_t flip) {
  int32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  int32_t key = bits < 0 ? bits ^ std::numeric_limits<int32_t>::max() : bits;
  key = v != v ? std::numeric_limits<int32_t>::max() : key;
  return key ^ flip;
}

inline bool Better(int32_t ka, int32_t ra, int32_t kb, int32_t rb) {
  return ka > kb || (ka == kb && ra < rb);
}

// One batch element: the state transposed to (T, K) in k/r/v, the block folded in.
struct Item {
  int64_t k, t;
  std::vector<int32_t> key, row;
  std::vector<float> val;
  std::vector<int32_t> last_key, last_row;  // each item's k-th slot
  std::vector<float> bar;  // a value must not be below it (above, for smallest) to enter
  float none;              // the bar of an empty k-th slot: -inf (+inf for smallest)

  Item(int64_t k_, int64_t t_, bool smallest)
      : k(k_), t(t_), key(k_ * t_), row(k_ * t_), val(k_ * t_), last_key(t_), last_row(t_),
        bar(t_), none(smallest ? std::numeric_limits<float>::infinity()
                               : -std::numeric_limits<float>::infinity()) {}

  void Last(int64_t i) {
    last_key[i] = key[i * k + k - 1];
    last_row[i] = row[i * k + k - 1];
    bar[i] = last_row[i] == kEmptyRow ? none : val[i * k + k - 1];
  }

  void Load(const float* vals, const int32_t* rows, int32_t flip) {
    for (int64_t s = 0; s < k; ++s) {
      for (int64_t i = 0; i < t; ++i) {
        const int32_t r = rows[s * t + i];
        key[i * k + s] = r == kEmptyRow ? kLowest : Key(vals[s * t + i], flip);
        row[i * k + s] = r;
        val[i * k + s] = vals[s * t + i];
      }
    }
    for (int64_t i = 0; i < t; ++i) Last(i);
  }

  void Store(float* vals, int32_t* rows) const {
    for (int64_t s = 0; s < k; ++s) {
      for (int64_t i = 0; i < t; ++i) {
        vals[s * t + i] = val[i * k + s];
        rows[s * t + i] = row[i * k + s];
      }
    }
  }

  void Insert(int64_t i, int32_t kk, int32_t r, float v) {
    int32_t* ks = &key[i * k];
    int32_t* rs = &row[i * k];
    float* vs = &val[i * k];
    int64_t p = k - 1;
    for (; p > 0 && Better(kk, r, ks[p - 1], rs[p - 1]); --p) {
      ks[p] = ks[p - 1];
      rs[p] = rs[p - 1];
      vs[p] = vs[p - 1];
    }
    ks[p] = kk;
    rs[p] = r;
    vs[p] = v;
    Last(i);
  }
};

// Whether any of kLanes items may beat its k-th slot with the row's values: not below
// its bar (largest; not above it, smallest), a NaN or a NaN bar always: a superset of
// those that do (a tie, -0.0 against +0.0), which the keys then decide. One float
// comparison per value, branch-free, so that the compiler vectorizes it.
typedef float VecF __attribute__((vector_size(4 * kLanes)));  // GCC vector extensions
typedef int32_t VecI __attribute__((vector_size(4 * kLanes)));

template <bool kSmallest>
inline __attribute__((always_inline)) bool MayEnter(const float* v, const float* bar) {
  VecF a, b;
  std::memcpy(&a, v, sizeof a);
  std::memcpy(&b, bar, sizeof b);
  const VecI hit = kSmallest ? ~(a > b) : ~(a < b);  // unordered (NaN): a hit
  uint64_t w[sizeof hit / 8];
  std::memcpy(w, &hit, sizeof hit);
  uint64_t any = 0;
  for (uint64_t x : w) any |= x;
  return any != 0;
}

// The block's rows folded into the state, one row at a time, kLanes items at a time
// (compiled per instruction set: the comparisons as AVX-512 or AVX2 vectors).
template <bool kSmallest>
ADV_CLONES void Fold(Item& it, const float* values, const int32_t* idx, const int32_t* alive,
                     int64_t rows) {
  const int32_t flip = kSmallest ? -1 : 0;
  const int64_t t = it.t;
  for (int64_t j = 0; j < rows; ++j) {
    if (!alive[j]) continue;
    const int32_t r = idx[j];
    const float* v = values + j * t;
    for (int64_t i0 = 0; i0 < t; i0 += kLanes) {
      const int64_t end = i0 + kLanes <= t ? i0 + kLanes : t;
      if (end - i0 == kLanes && !MayEnter<kSmallest>(v + i0, &it.bar[i0])) continue;
      for (int64_t i = i0; i < end; ++i) {
        const int32_t kk = Key(v[i], flip);
        if (Better(kk, r, it.last_key[i], it.last_row[i])) it.Insert(i, kk, r, v[i]);
      }
    }
  }
}

std::string ShapeStr(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

ffi::Error TopkFoldImpl(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> idx,
                        ffi::Buffer<ffi::S32> alive, ffi::Buffer<ffi::F32> vals,
                        ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out_vals,
                        ffi::ResultBuffer<ffi::S32> out_rows, int64_t smallest) {
  const auto dv = values.dimensions(), di = idx.dimensions(), ds = vals.dimensions();
  const std::string what = "adv_jax_math_topk_fold: values " + ShapeStr(dv) + ", idx " +
                           ShapeStr(di) + ", state " + ShapeStr(ds);
  const size_t rank = dv.size();
  bool ok = rank >= 2 && di.size() == rank - 1 && alive.dimensions().size() == rank - 1 &&
            ds.size() == rank && rows.dimensions().size() == rank;
  for (size_t d = 0; ok && d + 2 < rank; ++d) {
    ok = di[d] == dv[d] && ds[d] == dv[d] && alive.dimensions()[d] == dv[d];
  }
  ok = ok && di[rank - 2] == dv[rank - 2] && alive.dimensions()[rank - 2] == dv[rank - 2] &&
       ds[rank - 1] == dv[rank - 1] && ds[rank - 2] >= 1;
  for (size_t d = 0; ok && d < rank; ++d) ok = rows.dimensions()[d] == ds[d];
  if (!ok) {
    return ffi::Error::InvalidArgument(
        what + ": need values (*B, R, T), idx and alive (*B, R), state (*B, K, T), K >= 1");
  }
  int64_t batch = 1;
  for (size_t d = 0; d + 2 < rank; ++d) batch *= dv[d];
  const int64_t r = dv[rank - 2], t = dv[rank - 1], k = ds[rank - 2];
  const int32_t flip = smallest ? -1 : 0;
  try {
    Item it(k, t, smallest != 0);
    for (int64_t b = 0; b < batch; ++b) {
      it.Load(vals.typed_data() + b * k * t, rows.typed_data() + b * k * t, flip);
      const float* block = values.typed_data() + b * r * t;
      (smallest ? Fold<true> : Fold<false>)(it, block, idx.typed_data() + b * r,
                                            alive.typed_data() + b * r, r);
      it.Store(out_vals->typed_data() + b * k * t, out_rows->typed_data() + b * k * t);
    }
  } catch (const std::exception& e) {
    return ffi::Error::Internal(what + ": " + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* AdvJaxMathTopkFold(
    XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdvJaxMathTopkFold, TopkFoldImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("smallest"));
