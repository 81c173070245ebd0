// One-pass (online) logsumexp reduction as an XLA FFI CPU handler.
//
// Input x: (*batch, *reduced, *rest), float32 or float64, seen as (batch, n, m)
// with n = prod(reduced) and m = prod(rest); output y: (*batch, *rest) of the same
// dtype, y[b, j] = log(sum_i exp(x[b, i, j])). The attributes reduced_rank and
// rest_rank give the number of dimensions in each group. Semantics follow
// jax.nn.logsumexp: a column of -inf (or n == 0) gives -inf, any +inf gives +inf,
// any NaN gives NaN.
//
// Algorithm: each column keeps a running state (mx, s): the running maximum and
// s = sum exp(x - off(mx)), off(v) = v if v is finite else 0. Rows are read once,
// in small tiles: the tile maximum first, then one rescale of s, then the tile's
// exponentials, so each element costs one exp and memory is streamed once (XLA's
// reduction reads it twice). The work is split into (batch, column block, row
// segment) items whose bounds depend only on the shape, and the partial states are
// combined in a fixed order: the result does not depend on the number of threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using adv_jax_math_native::ForEach;

#if defined(ADV_JAX_MATH_TARGET_CLONES)
#define ADV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ADV_CLONES
#endif
#define ADV_INLINE inline __attribute__((always_inline))

namespace {

// ---------------------------------------------------------------------------
// SIMD through GCC/Clang vector extensions: 64-byte vectors (16 float / 8 double)
// become one AVX-512 register, two AVX2 registers or four SSE2 registers,
// depending on the clone being compiled. Every helper below works on scalars and
// vectors alike.
// ---------------------------------------------------------------------------

template <typename T>
struct Traits;

template <>
struct Traits<float> {
  typedef float Vec __attribute__((vector_size(64)));
  typedef uint32_t VecBits __attribute__((vector_size(64)));
  using Bits = uint32_t;
  static constexpr int kLanes = 16;
  static constexpr int kMantissa = 23;
  static constexpr float kLo = -87.0f;  // 2^k stays a normal number
  static constexpr float kHi = 88.0f;   // k <= 127
  static constexpr float kLog2e = 1.44269504088896341f;
  static constexpr float kShift = 12582912.0f + 127.0f;  // 1.5 * 2^23 + bias
  static constexpr float kLn2Hi = 0.693359375f;
  static constexpr float kLn2Lo = -2.12194440e-4f;
  // Near-minimax fit of exp on [-ln2/2, ln2/2] (iteratively reweighted least
  // squares): relative error < 1e-7 in float32 arithmetic.
  template <typename V>
  static ADV_INLINE V Poly(V r) {
    V p = r * 0.0013843622291460633f + 0.00837415549904108f;
    p = p * r + 0.04166800156235695f;
    p = p * r + 0.16666431725025177f;
    p = p * r + 0.4999999403953552f;
    p = p * r + 1.0f;
    return p * r + 1.0f;
  }
  static constexpr int kRows = 8;     // rows per tile (wide path)
  static constexpr int kCols = 1024;  // columns per work item (wide path): whole rows
                                      // up to 4 KiB, which the prefetchers follow
};

template <>
struct Traits<double> {
  typedef double Vec __attribute__((vector_size(64)));
  typedef uint64_t VecBits __attribute__((vector_size(64)));
  using Bits = uint64_t;
  static constexpr int kLanes = 8;
  static constexpr int kMantissa = 52;
  static constexpr double kLo = -708.0;
  static constexpr double kHi = 709.0;
  static constexpr double kLog2e = 1.4426950408889634074;
  static constexpr double kShift = 6755399441055744.0 + 1023.0;  // 1.5 * 2^52 + bias
  static constexpr double kLn2Hi = 6.93147180369123816490e-01;
  static constexpr double kLn2Lo = 1.90821492927058770002e-10;
  // Degree-11 interpolant of exp at Chebyshev nodes of [-ln2/2, ln2/2] (computed in
  // 50-digit arithmetic): relative error < 2e-17 before rounding.
  template <typename V>
  static ADV_INLINE V Poly(V r) {
    V p = r * 2.5110037605963777e-08 + 2.763263963904103e-07;
    p = p * r + 2.755724091857897e-06;
    p = p * r + 2.4801485482328494e-05;
    p = p * r + 0.00019841269890047113;
    p = p * r + 0.0013888888952314775;
    p = p * r + 0.008333333333319601;
    p = p * r + 0.0416666666664881;
    p = p * r + 0.1666666666666668;
    p = p * r + 0.5000000000000019;
    p = p * r + 1.0;
    return p * r + 1.0;
  }
  static constexpr int kRows = 8;
  static constexpr int kCols = 1024;
};

template <typename To, typename From>
ADV_INLINE To BitCast(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

template <typename V>
ADV_INLINE V Load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
ADV_INLINE void Store(void* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}

template <typename V, typename T>
ADV_INLINE V Splat(T c) {
  return V{} + c;
}

// a if cond else b, for scalars and vectors.
template <typename C, typename V>
ADV_INLINE V Select(C cond, V a, V b) {
  return cond ? a : b;
}

// max(a, b) ignoring a NaN in a (b never holds one).
template <typename V>
ADV_INLINE V MaxNoNaN(V a, V b) {
  return Select(a > b, a, b);
}

// ExpClamped(x) = exp(clamp(x, kLo, kHi)) to ~1 ulp; NaN stays NaN. It never
// returns 0 or inf: the callers handle infinities through the running maximum.
// Cody-Waite range reduction, a polynomial, and 2^k built from the bits.
template <typename T, typename V, typename B>
ADV_INLINE V ExpClamped(V x) {
  using Tr = Traits<T>;
  V xc = Select(x < Tr::kLo, Splat<V>(Tr::kLo), x);  // NaN passes both
  xc = Select(xc > Tr::kHi, Splat<V>(Tr::kHi), xc);
  const V shifted = xc * Tr::kLog2e + Tr::kShift;  // its mantissa holds k + bias
  const V k = shifted - Tr::kShift;                // round(x / ln2)
  V r = xc - k * Tr::kLn2Hi;
  r = r - k * Tr::kLn2Lo;
  const V scale = BitCast<V>(static_cast<B>(BitCast<B>(shifted) << Tr::kMantissa));  // 2^k
  return Tr::Poly(r) * scale;
}

template <typename T>
ADV_INLINE T Exp1(T x) {
  return ExpClamped<T, T, typename Traits<T>::Bits>(x);
}

template <typename T>
ADV_INLINE typename Traits<T>::Vec ExpV(typename Traits<T>::Vec x) {
  return ExpClamped<T, typename Traits<T>::Vec, typename Traits<T>::VecBits>(x);
}

template <typename T, typename V>
ADV_INLINE V Exp(V x) {
  if constexpr (std::is_same_v<T, V>) {
    return Exp1<T>(x);
  } else {
    return ExpV<T>(x);
  }
}

// ---------------------------------------------------------------------------
// Running state of one column: (mx, s). mx is the maximum of the non-NaN values
// seen (-inf if none); s is the sum of ExpClamped(x - Offset(mx)), NaN once a NaN
// was seen. When mx is finite, s >= 1 and clamped terms are negligible.
// ---------------------------------------------------------------------------

template <typename T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

// The offset subtracted before exp: mx when finite, else 0 (as jax.nn.logsumexp).
template <typename V>
ADV_INLINE V Offset(V mx) {
  return Select(mx - mx == 0, mx, V{});  // inf - inf and NaN - NaN are NaN
}

// Factor that moves a sum taken relative to Offset(old_mx) to Offset(new_mx). A sum
// whose max is -inf holds only clamped exp(-inf) terms, so it is dropped (a NaN
// sum stays NaN, as NaN * 0 is NaN).
template <typename T, typename V>
ADV_INLINE V Carry(V old_mx, V new_mx) {
  return Select(old_mx == kNegInf<T>, V{}, Exp<T>(Offset(old_mx) - Offset(new_mx)));
}

template <typename T>
T Finish(T mx, T s) {
  if (std::isnan(s)) return s;
  if (mx == kNegInf<T>) return mx;                          // every value -inf, or n == 0
  if (mx == std::numeric_limits<T>::infinity()) return mx;  // some +inf
  return std::log(s) + mx;
}

// ---------------------------------------------------------------------------
// Wide path (m >= kNarrowMax): columns in SIMD lanes. For a tile of rr rows and a
// group of columns (one vector V, or one scalar column): the tile max first, then
// one rescale, then the sum of exponentials; the rows stay in L1 between passes.
// ---------------------------------------------------------------------------

template <typename T, typename V>
ADV_INLINE void WideGroup(const T* x, int64_t stride, int rr, T* __restrict mx_p,
                          T* __restrict s_p) {
  const V mx = Load<V>(mx_p);
  V tm = mx;
  for (int r = 0; r < rr; ++r) tm = MaxNoNaN(Load<V>(x + r * stride), tm);
  const V off = Offset(tm);
  V acc{};
  for (int r = 0; r < rr; ++r) acc += Exp<T>(Load<V>(x + r * stride) - off);  // NaN propagates
  Store(s_p, Load<V>(s_p) * Carry<T>(mx, tm) + acc);
  Store(mx_p, tm);
}

// Reduces `rows` rows of `w` columns at x (row stride `stride`) into (mx, s).
template <typename T>
ADV_INLINE void WideSegment(const T* x, int64_t stride, int64_t rows, int w, T* __restrict mx,
                            T* __restrict s) {
  using V = typename Traits<T>::Vec;
  constexpr int L = Traits<T>::kLanes;
  constexpr int R = Traits<T>::kRows;
  for (int c = 0; c < w; ++c) {
    mx[c] = kNegInf<T>;
    s[c] = T(0);
  }
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const T* tile = x + r0 * stride;
    const int rr = static_cast<int>(std::min<int64_t>(R, rows - r0));
    int c = 0;
    if (rr == R) {
      for (; c + L <= w; c += L) WideGroup<T, V>(tile + c, stride, R, mx + c, s + c);
    } else {
      for (; c + L <= w; c += L) WideGroup<T, V>(tile + c, stride, rr, mx + c, s + c);
    }
    for (; c < w; ++c) WideGroup<T, T>(tile + c, stride, rr, mx + c, s + c);
  }
}

// ---------------------------------------------------------------------------
// Narrow path (m < kNarrowMax): rows in SIMD lanes. Each lane keeps its own state
// over the rows it sees; the lanes are folded in a fixed order at the end. A
// column is read in place when m == 1, else gathered tile by tile into a buffer.
// ---------------------------------------------------------------------------

constexpr int kNarrowMax = 16;  // m below this uses the narrow path
constexpr int kNarrowRows = 1024;

// Folds the state (mx2, s2) into (mx, s).
template <typename T>
ADV_INLINE void Combine(T& mx, T& s, T mx2, T s2) {
  const T new_mx = MaxNoNaN(mx2, mx);
  s = s * Carry<T>(mx, new_mx) + s2 * Carry<T>(mx2, new_mx);
  mx = new_mx;
}

// `count` (a multiple of the lane count) contiguous values into lane states.
template <typename T, typename V>
ADV_INLINE void NarrowTile(const T* p, int count, V& mx, V& s) {
  constexpr int L = Traits<T>::kLanes;
  V tm = mx;
  for (int i = 0; i < count; i += L) tm = MaxNoNaN(Load<V>(p + i), tm);
  const V off = Offset(tm);
  V acc{};
  for (int i = 0; i < count; i += L) acc += Exp<T>(Load<V>(p + i) - off);
  s = s * Carry<T>(mx, tm) + acc;
  mx = tm;
}

template <typename T>
ADV_INLINE void NarrowSegment(const T* x, int64_t m, int64_t rows, T* __restrict mx_out,
                              T* __restrict s_out) {
  using V = typename Traits<T>::Vec;
  constexpr int L = Traits<T>::kLanes;
  alignas(64) T buf[kNarrowRows];
  V mx[kNarrowMax];
  V s[kNarrowMax];
  for (int64_t c = 0; c < m; ++c) {
    mx[c] = Splat<V>(kNegInf<T>);
    s[c] = V{};
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kNarrowRows) {
    const int rr = static_cast<int>(std::min<int64_t>(kNarrowRows, rows - r0));
    const T* tile = x + r0 * m;
    if (m == 1 && rr == kNarrowRows) {
      NarrowTile<T, V>(tile, rr, mx[0], s[0]);
      continue;
    }
    const int padded = (rr + L - 1) / L * L;
    for (int64_t c = 0; c < m; ++c) {
      for (int i = 0; i < rr; ++i) buf[i] = tile[i * m + c];
      for (int i = rr; i < padded; ++i) buf[i] = kNegInf<T>;
      NarrowTile<T, V>(buf, padded, mx[c], s[c]);
    }
  }
  for (int64_t c = 0; c < m; ++c) {
    T cmx = kNegInf<T>;
    T cs = T(0);
    for (int j = 0; j < L; ++j) Combine<T>(cmx, cs, mx[c][j], s[c][j]);
    mx_out[c] = cmx;
    s_out[c] = cs;
  }
}

// Non-template entry points: the unit of function multiversioning.
ADV_CLONES void WideSegmentF32(const float* x, int64_t stride, int64_t rows, int w, float* mx,
                               float* s) {
  WideSegment<float>(x, stride, rows, w, mx, s);
}

ADV_CLONES void WideSegmentF64(const double* x, int64_t stride, int64_t rows, int w, double* mx,
                               double* s) {
  WideSegment<double>(x, stride, rows, w, mx, s);
}

ADV_CLONES void NarrowSegmentF32(const float* x, int64_t m, int64_t rows, float* mx, float* s) {
  NarrowSegment<float>(x, m, rows, mx, s);
}

ADV_CLONES void NarrowSegmentF64(const double* x, int64_t m, int64_t rows, double* mx, double* s) {
  NarrowSegment<double>(x, m, rows, mx, s);
}

void WideSegmentT(const float* x, int64_t st, int64_t rows, int w, float* mx, float* s) {
  WideSegmentF32(x, st, rows, w, mx, s);
}
void WideSegmentT(const double* x, int64_t st, int64_t rows, int w, double* mx, double* s) {
  WideSegmentF64(x, st, rows, w, mx, s);
}
void NarrowSegmentT(const float* x, int64_t m, int64_t rows, float* mx, float* s) {
  NarrowSegmentF32(x, m, rows, mx, s);
}
void NarrowSegmentT(const double* x, int64_t m, int64_t rows, double* mx, double* s) {
  NarrowSegmentF64(x, m, rows, mx, s);
}

// ---------------------------------------------------------------------------
// Work split and threading.
// ---------------------------------------------------------------------------

constexpr int64_t kItemElems = int64_t{1} << 17;      // elements per work item (target)
constexpr int64_t kParallelMinElems = int64_t{1} << 16;  // below: run on the caller only

struct Plan {
  int64_t batch, n, m;
  bool narrow;
  int64_t cols;      // columns per block
  int64_t ncb;       // column blocks
  int64_t seg_rows;  // rows per segment
  int64_t nseg;      // row segments
  int64_t items() const { return batch * ncb * nseg; }
};

template <typename T>
Plan MakePlan(int64_t batch, int64_t n, int64_t m) {
  Plan p{};
  p.batch = batch;
  p.n = n;
  p.m = m;
  p.narrow = m < kNarrowMax;
  p.cols = p.narrow ? m : std::min<int64_t>(m, Traits<T>::kCols);
  p.ncb = p.narrow ? 1 : (m + p.cols - 1) / p.cols;
  const int64_t quantum = p.narrow ? kNarrowRows : Traits<T>::kRows;
  const int64_t want = std::max<int64_t>(1, kItemElems / std::max<int64_t>(p.cols, 1));
  p.seg_rows = std::max<int64_t>(quantum, (want + quantum - 1) / quantum * quantum);
  p.nseg = (n + p.seg_rows - 1) / p.seg_rows;
  return p;
}

template <typename T>
void RunItem(const Plan& p, const T* x, T* pmx, T* ps, int64_t item) {
  const int64_t per_batch = p.ncb * p.nseg;
  const int64_t b = item / per_batch;
  const int64_t cb = (item % per_batch) / p.nseg;
  const int64_t sg = item % p.nseg;
  const int64_t r0 = sg * p.seg_rows;
  const int64_t rows = std::min(p.seg_rows, p.n - r0);
  const T* src = x + (b * p.n + r0) * p.m;
  T* dmx = pmx + (b * p.nseg + sg) * p.m;
  T* ds = ps + (b * p.nseg + sg) * p.m;
  if (p.narrow) {
    NarrowSegmentT(src, p.m, rows, dmx, ds);
  } else {
    const int64_t c0 = cb * p.cols;
    const int w = static_cast<int>(std::min(p.cols, p.m - c0));
    WideSegmentT(src + c0, p.m, rows, w, dmx + c0, ds + c0);
  }
}

template <typename T>
void Logsumexp(ffi::ThreadPool& pool, const T* x, T* y, int64_t batch, int64_t n, int64_t m) {
  const Plan p = MakePlan<T>(batch, n, m);
  const int64_t items = p.items();
  std::vector<T> pmx(static_cast<size_t>(batch * p.nseg * m));
  std::vector<T> ps(pmx.size());
  if (items > 0) {
    ForEach(pool, items, batch * n * m >= kParallelMinElems,
            [&](int64_t i) { RunItem(p, x, pmx.data(), ps.data(), i); });
  }
  // Combine the row segments of each column in order.
  for (int64_t b = 0; b < batch; ++b) {
    const T* bmx = pmx.data() + b * p.nseg * m;
    const T* bs = ps.data() + b * p.nseg * m;
    T* out = y + b * m;
    if (p.nseg == 0) {
      std::fill(out, out + m, kNegInf<T>);
      continue;
    }
    for (int64_t c = 0; c < m; ++c) {
      T mx = bmx[c];
      T s = bs[c];
      for (int64_t sg = 1; sg < p.nseg; ++sg) Combine<T>(mx, s, bmx[sg * m + c], bs[sg * m + c]);
      out[c] = Finish(mx, s);
    }
  }
}

// ---------------------------------------------------------------------------
// FFI handler: validation and dispatch.
// ---------------------------------------------------------------------------

std::string ShapeStr(ffi::Span<const int64_t> dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(dims[i]);
  }
  if (dims.size() == 1) out += ",";
  return out + ")";
}

std::string DtypeStr(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    default:
      return "dtype code " + std::to_string(static_cast<int>(t));
  }
}

constexpr const char* kName = "adv_jax_math_logsumexp";

// x: (*batch, *reduced, *rest) with len(reduced) = reduced_rank and
// len(rest) = rest_rank; y: (*batch, *rest). Leading batch dimensions are what
// vmap_method="expand_dims" adds, so the attributes stay valid under vmap.
ffi::Error LogsumexpImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         int64_t reduced_rank, int64_t rest_rank) {
  const auto in = x.dimensions();
  const auto out = y->dimensions();
  const int64_t rank = static_cast<int64_t>(in.size());
  const std::string what = std::string(kName) + ": input " + ShapeStr(in) + " " +
                           DtypeStr(x.element_type()) + ", output " + ShapeStr(out) + " " +
                           DtypeStr(y->element_type()) + ", reduced_rank=" +
                           std::to_string(reduced_rank) + ", rest_rank=" + std::to_string(rest_rank);
  if (reduced_rank < 0 || rest_rank < 0 || reduced_rank + rest_rank > rank) {
    return ffi::Error::InvalidArgument(
        what + ": need reduced_rank >= 0, rest_rank >= 0 and reduced_rank + rest_rank <= "
               "the input rank");
  }
  const auto dt = x.element_type();
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::F64) {
    return ffi::Error::InvalidArgument(
        what + ": only float32 and float64 are supported; cast the input or use "
               "jax.nn.logsumexp");
  }
  if (y->element_type() != dt) {
    return ffi::Error::InvalidArgument(what + ": the output dtype must equal the input dtype");
  }
  const int64_t batch_rank = rank - reduced_rank - rest_rank;
  bool shape_ok = static_cast<int64_t>(out.size()) == batch_rank + rest_rank;
  for (int64_t i = 0; shape_ok && i < batch_rank; ++i) shape_ok = out[i] == in[i];
  for (int64_t i = 0; shape_ok && i < rest_rank; ++i) {
    shape_ok = out[batch_rank + i] == in[batch_rank + reduced_rank + i];
  }
  for (int64_t i = 0; shape_ok && i < rank; ++i) shape_ok = in[i] >= 0;
  if (!shape_ok) {
    return ffi::Error::InvalidArgument(
        what + ": the output shape must be the input shape without its reduced dimensions");
  }
  int64_t batch = 1, n = 1, m = 1;
  for (int64_t i = 0; i < batch_rank; ++i) batch *= in[i];
  for (int64_t i = batch_rank; i < batch_rank + reduced_rank; ++i) n *= in[i];
  for (int64_t i = batch_rank + reduced_rank; i < rank; ++i) m *= in[i];
  if (batch * m == 0) return ffi::Error::Success();
  if ((n > 0 && x.untyped_data() == nullptr) || y->untyped_data() == nullptr) {
    return ffi::Error::Internal(what + ": got a null buffer");
  }
  try {
    if (dt == ffi::DataType::F32) {
      Logsumexp<float>(pool, static_cast<const float*>(x.untyped_data()),
                       static_cast<float*>(y->untyped_data()), batch, n, m);
    } else {
      Logsumexp<double>(pool, static_cast<const double*>(x.untyped_data()),
                        static_cast<double*>(y->untyped_data()), batch, n, m);
    }
  } catch (const std::exception& e) {
    return ffi::Error::Internal(what + ": " + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* AdvJaxMathLogsumexp(
    XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdvJaxMathLogsumexp, LogsumexpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("reduced_rank")
                                  .Attr<int64_t>("rest_rank"));
