// mok tests: shared helpers.
//
//  - Building problems and layer data with a few lines.
//  - An independent dense formulation of the layer in double precision (DenseLayer): a loop
//    per token and per slot, no schedule, no GEMM blocking. In Mode::bf16 it rounds to bf16
//    at exactly the points the CPU reference does (see src/reference/reference.h and the
//    backward in src/reference/reference.cpp); in Mode::mxfp8 it replaces each GEMM operand,
//    forward and backward, by its MXFP8 round trip along the contraction (a wgrad's: along
//    the expert's rows, which it gathers for that: mx_wgrad); in Mode::exact it rounds
//    nothing (the true math of the layer on the bf16 inputs, for finite differences).
//  - Gathering a LayerData's per-rank tensors into global ones (tokens and experts in rank
//    order), and error metrics.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mok/mok.h"
#include "numerics/mxfp8.h"
#include "numerics/numerics.h"

#include <unistd.h>

namespace mok::test {

// A fresh directory under the system temp dir, removed (with its contents) on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = "mok_test_" + std::to_string(::getpid()) + "_" + tag;
    if (info) name += std::string("_") + info->test_suite_name() + "_" + info->name();
    for (auto& c : name)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') c = '_';
    path_ = std::filesystem::temp_directory_path() / name;
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// ---- building blocks ----------------------------------------------------------------------

inline Problem make_problem(int E, int H, int I, int k, std::vector<int> shared, int R, int T,
                            Precision precision = Precision::bf16,
                            std::optional<float> swiglu_limit = std::nullopt) {
  Problem p;
  p.num_experts = E;
  p.hidden = H;
  p.intermediate = I;
  p.top_k = k;
  p.shared_intermediate = std::move(shared);
  p.ep_size = R;
  p.tokens_per_rank = T;
  p.precision = precision;
  p.swiglu_limit = swiglu_limit;
  return p;
}

// A config whose capacity covers every routing and whose tiles are small.
inline Config roomy_config() {
  Config c;
  c.tile_rows = 64;
  c.minibatch_rows = 64;
  c.macrobatch_rows = 1024;
  c.schedule_capacity_factor = 1.0;
  return c;
}

inline LayerData make_data(const Problem& p, std::uint64_t seed, bool backward,
                           const RoutingSpec& spec = RoutingSpec{}) {
  return make_layer_data(p, generate_routing(p, spec, seed), seed, backward);
}

inline LayerOptions cpu_options(int threads = 0) {
  LayerOptions o;
  o.cpu_threads = threads;
  return o;
}

// Runs the reference forward (and backward) on `data` in place.
inline void run_reference(LayerData& data, bool backward, const Config& config = roomy_config(),
                          int threads = 0) {
  Layer layer(data.problem, config, cpu_options(threads));
  layer.forward(data.forward_args());
  if (backward) layer.backward(data.backward_args());
}


// A routing whose rank 0 experts receive exactly `rows_per_expert[e]` rows (e < E/R), every
// other slot going to other ranks' experts. Laid out as one sequence over (slot j, token g)
// in slot-major order, expert after expert, so that an expert's rows (at most R*T of them)
// fall on distinct tokens and a token's slots on distinct experts. Needs R >= 2 and
// k <= E - E/R (the other ranks' experts fill the rest); the weights are 1/k.
inline Routing routing_with_rank0_rows(const Problem& p, const std::vector<std::int64_t>& rows_per_expert) {
  const int R = p.ep_size, k = p.top_k, E = p.num_experts, E_loc = p.local_experts();
  const std::int64_t T = p.tokens_per_rank, tokens = std::int64_t(R) * T;
  if (R < 2 || k > E - E_loc || static_cast<int>(rows_per_expert.size()) != E_loc)
    throw std::invalid_argument("routing_with_rank0_rows: needs R >= 2, k <= E - E/R and E/R counts");
  std::vector<std::vector<std::int32_t>> top(R, std::vector<std::int32_t>(std::size_t(T) * k, -1));
  std::int64_t pos = 0;  // slot-major: token pos % tokens, slot pos / tokens
  for (int e = 0; e < E_loc; ++e) {
    if (rows_per_expert[e] > tokens) throw std::invalid_argument("routing_with_rank0_rows: an expert takes <= R*T rows");
    for (std::int64_t n = 0; n < rows_per_expert[e]; ++n, ++pos) {
      const std::int64_t g = pos % tokens, j = pos / tokens;
      if (j >= k) throw std::invalid_argument("routing_with_rank0_rows: more rows than R*T*k");
      top[g / T][std::size_t(g % T) * k + j] = e;
    }
  }
  // The rest: slot j of token g to another rank's expert E_loc + (g + j) mod (E - E_loc),
  // distinct over a token's slots (k <= E - E_loc) and never rank 0's.
  for (std::int64_t g = 0; g < tokens; ++g)
    for (int j = 0; j < k; ++j) {
      std::int32_t& id = top[g / T][std::size_t(g % T) * k + j];
      if (id < 0) id = E_loc + static_cast<std::int32_t>((g + j) % (E - E_loc));
    }
  Routing r;
  r.top_experts = std::move(top);
  r.router_weights.assign(R, std::vector<float>(std::size_t(T) * k, 1.0f / k));
  return r;
}

// Rank 0 expert counts that fill `padded_rows` (a multiple of `tile`) with whole tiles,
// expert after expert, none above R*T rows (each token sends an expert at most one row).
inline std::vector<std::int64_t> whole_tile_rows(const Problem& p, std::int64_t padded_rows, int tile) {
  const std::int64_t most = std::int64_t(p.ep_size) * p.tokens_per_rank / tile * tile;
  std::vector<std::int64_t> rows(p.local_experts(), 0);
  for (auto& n : rows) {
    n = std::min(most, padded_rows);
    padded_rows -= n;
  }
  if (padded_rows != 0) throw std::invalid_argument("whole_tile_rows: rank 0's experts cannot hold that many rows");
  return rows;
}
// The global batch of `a` with its tokens moved over positions and ranks and about a
// quarter of them replaced by `fresh`'s tokens (same problem; the weights stay a's): token n
// of `a` (global index rank*T + t) sits at global position moved_to[n] of `data`, or was
// replaced (moved_to[n] = -1). MISSION: a token's output never depends on its neighbours,
// so y at moved_to[n] must equal a's y of token n bit for bit.
struct ShuffledBatch {
  LayerData data;
  std::vector<std::int64_t> moved_to;
};

inline ShuffledBatch shuffle_tokens(const LayerData& a, const LayerData& fresh, std::uint64_t seed) {
  const Problem& p = a.problem;
  const std::int64_t T = p.tokens_per_rank, N = std::int64_t(p.ep_size) * T, H = p.hidden, k = p.top_k;
  ShuffledBatch out{a, std::vector<std::int64_t>(N, -1)};
  std::vector<std::int64_t> position(N);
  for (std::int64_t n = 0; n < N; ++n) position[n] = n;
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&] {  // splitmix64: a fixed sequence on every platform
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (std::int64_t n = N - 1; n > 0; --n) std::swap(position[n], position[next() % (n + 1)]);
  auto copy_token = [&](const LayerData& from, std::int64_t src, std::int64_t dst) {
    const RankData& f = from.ranks[src / T];
    RankData& t = out.data.ranks[dst / T];
    const std::int64_t fs = src % T, ts = dst % T;
    std::memcpy(t.x.data<std::uint16_t>() + ts * H, f.x.data<std::uint16_t>() + fs * H, H * 2);
    std::memcpy(t.top_experts.data<std::int32_t>() + ts * k, f.top_experts.data<std::int32_t>() + fs * k, k * 4);
    std::memcpy(t.router_weights.data<float>() + ts * k, f.router_weights.data<float>() + fs * k, k * 4);
    if (!t.dy.empty()) std::memcpy(t.dy.data<std::uint16_t>() + ts * H, f.dy.data<std::uint16_t>() + fs * H, H * 2);
  };
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t dst = position[n];
    if (next() % 4 == 0) {
      copy_token(fresh, dst, dst);
    } else {
      copy_token(a, n, dst);
      out.moved_to[n] = dst;
    }
  }
  return out;
}

// y of token n of `a` against y at its new place in `shuffled` (shuffle_tokens), bit for
// bit; returns how many tokens were compared (a test asks for a fair number).
inline std::int64_t expect_same_y_where_moved(const LayerData& a, const LayerData& shuffled,
                                              const std::vector<std::int64_t>& moved_to) {
  const std::int64_t T = a.problem.tokens_per_rank, H = a.problem.hidden;
  std::int64_t compared = 0, differing = 0;
  for (std::int64_t n = 0; n < std::int64_t(moved_to.size()); ++n) {
    if (moved_to[n] < 0) continue;
    const std::int64_t d = moved_to[n];
    const std::uint16_t* want = a.ranks[n / T].y.data<std::uint16_t>() + (n % T) * H;
    const std::uint16_t* got = shuffled.ranks[d / T].y.data<std::uint16_t>() + (d % T) * H;
    ++compared;
    if (std::memcmp(want, got, H * 2) != 0 && differing++ < 5)
      ADD_FAILURE() << "token " << n << " (rank " << n / T << ") moved to " << d << " (rank " << d / T
                    << "): its y differs from where it was";
  }
  EXPECT_EQ(differing, 0) << "of " << compared << " tokens whose neighbours changed";
  return compared;
}

// Catches the mok::Error `fn` must throw and returns its message; fails the test if
// nothing (or something else) is thrown.
template <typename Fn>
std::string error_message(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected mok::Error, got std::exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected mok::Error, nothing was thrown";
  return "";
}

// ---- tensors as doubles ---------------------------------------------------------------------

inline double element(const HostTensor& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::bf16: return num::bf16_to_float(t.data<std::uint16_t>()[i]);
    case DType::f32: return t.data<float>()[i];
    case DType::i32: return t.data<std::int32_t>()[i];
    case DType::i64: return double(t.data<std::int64_t>()[i]);
    default: ADD_FAILURE() << "element: unsupported dtype"; return 0;
  }
}

inline std::vector<double> to_doubles(const HostTensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) v[i] = element(t, i);
  return v;
}

// Concatenates a member of every rank (e.g. &RankData::y) along the first dimension:
// tokens (or local experts) in rank order.
inline std::vector<double> concat_ranks(const LayerData& d, HostTensor RankData::*member) {
  std::vector<double> out;
  for (const auto& r : d.ranks) {
    const auto v = to_doubles(r.*member);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// Bytes of a member of every rank, concatenated (for bitwise comparisons across EP sizes).
inline std::vector<std::uint8_t> concat_bytes(const LayerData& d, HostTensor RankData::*member) {
  std::vector<std::uint8_t> out;
  for (const auto& r : d.ranks) {
    const HostTensor& t = r.*member;
    const auto* b = t.data<std::uint8_t>();
    out.insert(out.end(), b, b + t.bytes());
  }
  return out;
}

inline std::vector<std::uint8_t> bytes_of(const HostTensor& t) {
  const auto* b = t.data<std::uint8_t>();
  return {b, b + t.bytes()};
}

// ---- error metrics --------------------------------------------------------------------------

struct Diff {
  double rel = 0;       // sum |out - ref| / sum |ref|
  double max_abs = 0;   // max |out - ref|
  double max_ref = 0;   // max |ref|
  double cosine = 1;
  double rel_l2 = 0;    // ||out - ref|| / ||ref||
  std::int64_t non_finite = 0;
  std::string describe() const {
    return "rel=" + std::to_string(rel) + " max_abs=" + std::to_string(max_abs) +
           " max_ref=" + std::to_string(max_ref) + " cos=" + std::to_string(cosine) +
           " rel_l2=" + std::to_string(rel_l2) + " non_finite=" + std::to_string(non_finite);
  }
};

inline Diff diff(const std::vector<double>& out, const std::vector<double>& ref) {
  Diff d;
  EXPECT_EQ(out.size(), ref.size());
  double sd = 0, sr = 0, dot = 0, no = 0, nr = 0, sd2 = 0;
  for (std::size_t i = 0; i < std::min(out.size(), ref.size()); ++i) {
    if (!std::isfinite(out[i]) || !std::isfinite(ref[i])) {
      ++d.non_finite;
      continue;
    }
    const double e = std::fabs(out[i] - ref[i]);
    d.max_abs = std::max(d.max_abs, e);
    d.max_ref = std::max(d.max_ref, std::fabs(ref[i]));
    sd += e;
    sd2 += e * e;
    sr += std::fabs(ref[i]);
    dot += out[i] * ref[i];
    no += out[i] * out[i];
    nr += ref[i] * ref[i];
  }
  d.rel = sr > 0 ? sd / sr : (sd > 0 ? INFINITY : 0);
  d.rel_l2 = nr > 0 ? std::sqrt(sd2 / nr) : (sd2 > 0 ? INFINITY : 0);
  d.cosine = (no > 0 && nr > 0) ? dot / std::sqrt(no * nr) : (no == nr ? 1.0 : 0.0);
  return d;
}

// ---- the dense formulation ------------------------------------------------------------------

enum class Mode { exact, bf16, mxfp8 };

struct DenseExpert {
  int width = 0;
  std::vector<double> gate, up, down;  // [I,H], [I,H], [H,I]
};

struct DenseGrads {
  std::vector<double> dx;                       // [N,H]
  std::vector<double> d_router;                 // [N,k]
  std::vector<double> d_gate, d_up, d_down;     // [E,I,H], [E,I,H], [E,H,I]
  std::vector<std::vector<double>> d_shared_gate, d_shared_up, d_shared_down;
};

struct DenseForward {
  std::vector<double> y;        // [N,H]
  std::vector<double> combine;  // [N*k,H]: expert e[t,j]'s output row for token t
  std::int64_t gate_clamped = 0, up_clamped = 0;  // how often the swiglu clamp acted
};

// The whole EP group as one global batch: N = R*T tokens, E experts.
struct DenseLayer {
  int N = 0, H = 0, k = 0, T = 0;  // T: tokens per rank (rows [r*T, (r+1)*T) are rank r's)
  double limit = 0;  // 0: no clamp
  std::vector<double> x, dy;                   // [N,H]
  std::vector<int> top;                        // [N,k]
  std::vector<double> w;                       // [N,k]
  std::vector<DenseExpert> experts, shared;

  static DenseLayer from(const LayerData& d) {
    const Problem& p = d.problem;
    DenseLayer L;
    L.N = p.ep_size * p.tokens_per_rank;
    L.T = p.tokens_per_rank;
    L.H = p.hidden;
    L.k = p.top_k;
    L.limit = p.swiglu_limit ? double(*p.swiglu_limit) : 0.0;
    L.x = concat_ranks(d, &RankData::x);
    if (!d.ranks[0].dy.empty()) L.dy = concat_ranks(d, &RankData::dy);
    for (double v : concat_ranks(d, &RankData::top_experts)) L.top.push_back(int(v));
    L.w = concat_ranks(d, &RankData::router_weights);
    const std::int64_t I = p.intermediate, H = p.hidden;
    const auto g = concat_ranks(d, &RankData::w_gate), u = concat_ranks(d, &RankData::w_up),
               dn = concat_ranks(d, &RankData::w_down);
    for (int e = 0; e < p.num_experts; ++e) {
      DenseExpert x;
      x.width = p.intermediate;
      x.gate.assign(g.begin() + e * I * H, g.begin() + (e + 1) * I * H);
      x.up.assign(u.begin() + e * I * H, u.begin() + (e + 1) * I * H);
      x.down.assign(dn.begin() + e * H * I, dn.begin() + (e + 1) * H * I);
      L.experts.push_back(std::move(x));
    }
    for (int s = 0; s < p.num_shared(); ++s) {
      DenseExpert x;
      x.width = p.shared_intermediate[s];
      x.gate = to_doubles(d.ranks[0].shared[s].w_gate);
      x.up = to_doubles(d.ranks[0].shared[s].w_up);
      x.down = to_doubles(d.ranks[0].shared[s].w_down);
      L.shared.push_back(std::move(x));
    }
    return L;
  }
};

inline double rnd_bf16(double v) { return num::round_bf16(static_cast<float>(v)); }

// MXFP8 round trip of a row of values (blocks of 32 from its start), through fp32.
inline std::vector<double> mx_row(const double* v, std::int64_t n) {
  std::vector<float> f(v, v + n);
  num::mx_roundtrip_rows(f.data(), 1, n);
  return {f.begin(), f.end()};
}

inline std::vector<double> mx_rows(const std::vector<double>& m, std::int64_t rows, std::int64_t cols) {
  std::vector<double> out;
  out.reserve(m.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto q = mx_row(m.data() + r * cols, cols);
    out.insert(out.end(), q.begin(), q.end());
  }
  return out;
}

struct Swiglu {
  double gc, uc, sig, silu, a;
  bool g_pass, u_pass;
};

inline Swiglu swiglu_parts(double g, double u, double limit) {
  Swiglu s{g, u, 0, 0, 0, true, true};
  if (limit > 0) {
    if (g > limit) { s.gc = limit; s.g_pass = false; }
    if (u > limit) { s.uc = limit; s.u_pass = false; }
    if (u < -limit) { s.uc = -limit; s.u_pass = false; }
  }
  s.sig = 1.0 / (1.0 + std::exp(-s.gc));
  s.silu = s.gc * s.sig;
  s.a = s.silu * s.uc;
  return s;
}

// One expert on one token row in the forward: returns the output row [H] (rounded as the
// mode demands) and fills g, u, a (a as the down GEMM sees it).
inline std::vector<double> expert_row(const DenseExpert& ex, const double* x, int H, double limit, Mode mode,
                                      std::vector<double>& g, std::vector<double>& u, std::vector<double>& a,
                                      DenseForward* stats = nullptr, std::vector<double>* a_fp32 = nullptr) {
  const int I = ex.width;
  // In mxfp8 mode every GEMM operand is its MXFP8 round trip along the contraction.
  std::vector<double> xq(x, x + H);
  const std::vector<double>* wg = &ex.gate;
  const std::vector<double>* wu = &ex.up;
  const std::vector<double>* wd = &ex.down;
  std::vector<double> qg, qu, qd;
  if (mode == Mode::mxfp8) {
    xq = mx_row(x, H);
    qg = mx_rows(ex.gate, I, H);
    qu = mx_rows(ex.up, I, H);
    qd = mx_rows(ex.down, H, I);
    wg = &qg;
    wu = &qu;
    wd = &qd;
  }
  g.assign(I, 0);
  u.assign(I, 0);
  a.assign(I, 0);
  for (int i = 0; i < I; ++i) {
    double sg = 0, su = 0;
    for (int h = 0; h < H; ++h) {
      sg += (*wg)[std::size_t(i) * H + h] * xq[h];
      su += (*wu)[std::size_t(i) * H + h] * xq[h];
    }
    g[i] = sg;
    u[i] = su;
    const Swiglu s = swiglu_parts(sg, su, limit);
    if (stats) {
      stats->gate_clamped += !s.g_pass;
      stats->up_clamped += !s.u_pass;
    }
    a[i] = mode == Mode::bf16 ? rnd_bf16(s.a) : s.a;
  }
  if (mode == Mode::mxfp8) {
    std::vector<double> af(a.begin(), a.end());
    for (auto& v : af) v = static_cast<float>(v);  // the reference quantises a from fp32
    a = mx_row(af.data(), I);
    if (a_fp32 != nullptr) *a_fp32 = std::move(af);  // (the wgrad's orientation starts from these)
  }
  std::vector<double> o(H, 0);
  for (int h = 0; h < H; ++h) {
    double s = 0;
    for (int i = 0; i < I; ++i) s += (*wd)[std::size_t(h) * I + i] * a[i];
    o[h] = mode == Mode::exact ? s : rnd_bf16(s);
  }
  return o;
}

inline DenseForward dense_forward(const DenseLayer& L, Mode mode) {
  DenseForward f;
  const int H = L.H, k = L.k;
  f.y.assign(std::size_t(L.N) * H, 0);
  f.combine.assign(std::size_t(L.N) * k * H, 0);
  std::vector<double> g, u, a;
  for (int t = 0; t < L.N; ++t) {
    const double* x = &L.x[std::size_t(t) * H];
    std::vector<double> acc(H, 0);
    for (const auto& sh : L.shared) {
      const auto o = expert_row(sh, x, H, L.limit, mode, g, u, a, &f);
      for (int h = 0; h < H; ++h) acc[h] += o[h];
    }
    for (int j = 0; j < k; ++j) {
      const auto o = expert_row(L.experts[L.top[t * k + j]], x, H, L.limit, mode, g, u, a, &f);
      std::copy(o.begin(), o.end(), f.combine.begin() + (std::size_t(t) * k + j) * H);
      for (int h = 0; h < H; ++h) acc[h] += L.w[t * k + j] * o[h];
    }
    for (int h = 0; h < H; ++h) f.y[std::size_t(t) * H + h] = mode == Mode::exact ? acc[h] : rnd_bf16(acc[h]);
  }
  return f;
}

// loss = sum(y * dy) with y from the exact (unrounded) forward.
inline double dense_loss(const DenseLayer& L) {
  const auto f = dense_forward(L, Mode::exact);
  double s = 0;
  for (std::size_t i = 0; i < f.y.size(); ++i) s += f.y[i] * L.dy[i];
  return s;
}

// What a row gives the weight gradients: dG, dU and a (as the down GEMM saw it; in mxfp8 mode
// its fp32 values, which mx_wgrad quantises along the rows).
struct RowGrads {
  std::vector<double> dg, du, a;
};

// The backward of one expert on one token row with router weight w (1 for shared experts).
// Accumulates the weight gradients into dgate/dup/ddown, returns the dx row and sets *dw.
// With `keep`, the row's dG, dU and a go there instead, for a wgrad over all of an expert's
// rows (mxfp8: its operands are rounded along the rows; mx_wgrad).
inline std::vector<double> expert_row_backward(const DenseExpert& ex, const double* x, const double* dy, int H,
                                               double limit, double w, Mode mode, double* dgate, double* dup,
                                               double* ddown, double* dw, RowGrads* keep = nullptr,
                                               bool round_backward = true) {
  const int I = ex.width;
  const auto R = [&](double v) { return mode == Mode::bf16 ? rnd_bf16(v) : v; };
  const bool mx = mode == Mode::mxfp8 && round_backward;
  std::vector<double> g, u, a, a_fp32;
  expert_row(ex, x, H, limit, mode, g, u, a, nullptr, &a_fp32);
  // The dgrad GEMMs' operands in mxfp8 mode, as the reference has them: dy and W_down^T's
  // rows rounded along H (DA's contraction), [dG | dU] and [W_gate^T | W_up^T]'s rows along 2I
  // (dx's). The wgrad's operands are rounded along the expert's rows: mx_wgrad, over every
  // row this returns in `keep`.
  std::vector<double> dyq(dy, dy + H);
  if (mx) dyq = mx_row(dy, H);
  std::vector<double> DA(I, 0);
  std::vector<double> wd_col(H);
  for (int i = 0; i < I; ++i) {
    for (int h = 0; h < H; ++h) wd_col[h] = ex.down[std::size_t(h) * I + i];
    if (mx) wd_col = mx_row(wd_col.data(), H);
    double s = 0;
    for (int h = 0; h < H; ++h) s += wd_col[h] * dyq[h];
    DA[i] = s;
  }
  double sdw = 0;
  for (int i = 0; i < I; ++i) sdw += DA[i] * a[i];
  *dw = sdw;
  std::vector<double> DG(I), DU(I);
  for (int i = 0; i < I; ++i) {
    const Swiglu s = swiglu_parts(g[i], u[i], limit);
    const double dA = w * DA[i];
    const double dsilu = s.sig * (1.0 + s.gc * (1.0 - s.sig));
    DG[i] = R(s.g_pass ? dA * s.uc * dsilu : 0.0);
    DU[i] = R(s.u_pass ? dA * s.silu : 0.0);
  }
  std::vector<double> dx(H, 0);
  if (mx) {
    std::vector<double> dgu(DG);
    dgu.insert(dgu.end(), DU.begin(), DU.end());
    for (auto& v : dgu) v = static_cast<float>(v);  // (the reference quantises from fp32)
    dgu = mx_row(dgu.data(), 2 * I);
    std::vector<double> wcat(2 * std::size_t(I));
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < I; ++i) {
        wcat[i] = ex.gate[std::size_t(i) * H + h];
        wcat[I + i] = ex.up[std::size_t(i) * H + h];
      }
      const auto wq = mx_row(wcat.data(), 2 * I);
      double s = 0;
      for (int c = 0; c < 2 * I; ++c) s += dgu[c] * wq[c];
      dx[h] = rnd_bf16(s);  // (each expert's dx row lands in a bf16 slot, as in bf16 mode)
    }
  } else {
    for (int h = 0; h < H; ++h) {
      double s = 0;
      for (int i = 0; i < I; ++i) s += ex.gate[std::size_t(i) * H + h] * DG[i] + ex.up[std::size_t(i) * H + h] * DU[i];
      dx[h] = R(s);
    }
  }
  if (keep != nullptr) {
    *keep = RowGrads{DG, DU, mx ? a_fp32 : a};
    return dx;
  }
  for (int i = 0; i < I; ++i) {
    const double aw = R(w * a[i]);
    for (int h = 0; h < H; ++h) {
      ddown[std::size_t(h) * I + i] += dy[h] * aw;
      dgate[std::size_t(i) * H + h] += DG[i] * x[h];
      dup[std::size_t(i) * H + h] += DU[i] * x[h];
    }
  }
  return dx;
}

// One expert's rows, in the order its GEMMs see them (global token order; a shared expert's
// per rank).
struct ExpertRows {
  std::vector<const double*> x, dy;
  std::vector<double> w;
  std::vector<RowGrads> grads;
};

// The MXFP8 wgrad of one expert over its rows, as the reference computes it: each operand
// (dy, x, w*a, dG, dU) quantised from fp32 along the rows (blocks of 32 from the first row),
// then the exact products summed into dgate/dup/ddown.
inline void mx_wgrad(const ExpertRows& rows, int H, int I, double* dgate, double* dup, double* ddown) {
  const std::size_t n = rows.x.size();
  if (n == 0) return;
  auto along_rows = [&](auto value) {  // value(r) for r < n -> its MXFP8 round trip along r
    std::vector<double> v(n);
    for (std::size_t r = 0; r < n; ++r) v[r] = static_cast<float>(value(r));
    return mx_row(v.data(), static_cast<std::int64_t>(n));
  };
  std::vector<std::vector<double>> dyq(H), xq(H), awq(I), dgq(I), duq(I);
  for (int h = 0; h < H; ++h) {
    dyq[h] = along_rows([&](std::size_t r) { return rows.dy[r][h]; });
    xq[h] = along_rows([&](std::size_t r) { return rows.x[r][h]; });
  }
  for (int i = 0; i < I; ++i) {
    // (w*a as the reference forms it: fp32 product of fp32 values)
    awq[i] = along_rows([&](std::size_t r) {
      return static_cast<float>(rows.w[r]) * static_cast<float>(rows.grads[r].a[i]);
    });
    dgq[i] = along_rows([&](std::size_t r) { return rows.grads[r].dg[i]; });
    duq[i] = along_rows([&](std::size_t r) { return rows.grads[r].du[i]; });
  }
  for (int i = 0; i < I; ++i)
    for (int h = 0; h < H; ++h) {
      double sd = 0, sg = 0, su = 0;
      for (std::size_t r = 0; r < n; ++r) {
        sd += dyq[h][r] * awq[i][r];
        sg += dgq[i][r] * xq[h][r];
        su += duq[i][r] * xq[h][r];
      }
      ddown[std::size_t(h) * I + i] += sd;
      dgate[std::size_t(i) * H + h] += sg;
      dup[std::size_t(i) * H + h] += su;
    }
}

// Mode::bf16: the reference's rounding points; Mode::exact: no rounding; Mode::mxfp8: the
// gradient of the MXFP8 forward (g, u, a and the clamp masks recomputed as the MXFP8 forward
// has them) with every GEMM operand rounded where the reference rounds it: the dgrads' along
// H and 2I (expert_row_backward), the wgrads' along the expert's rows (mx_wgrad).
// round_backward = false (mxfp8 only): the straight-through gradient instead, every backward
// product exact and unrounded (MoK's gradient bar holds against it).
inline DenseGrads dense_backward(const DenseLayer& L, Mode mode, bool round_backward = true) {
  const int H = L.H, k = L.k, E = static_cast<int>(L.experts.size());
  const std::size_t I = L.experts.empty() ? 0 : L.experts[0].width;
  DenseGrads d;
  d.dx.assign(std::size_t(L.N) * H, 0);
  d.d_router.assign(std::size_t(L.N) * k, 0);
  d.d_gate.assign(E * I * H, 0);
  d.d_up.assign(E * I * H, 0);
  d.d_down.assign(E * I * H, 0);
  for (const auto& s : L.shared) {
    d.d_shared_gate.emplace_back(std::size_t(s.width) * H, 0.0);
    d.d_shared_up.emplace_back(std::size_t(s.width) * H, 0.0);
    d.d_shared_down.emplace_back(std::size_t(s.width) * H, 0.0);
  }
  // mxfp8: every expert's rows kept for its wgrad (a shared expert's per rank: each rank's
  // reference computes its own, which the tests sum).
  const bool mx = mode == Mode::mxfp8 && round_backward;
  std::vector<ExpertRows> routed_rows(mx ? E : 0);
  std::vector<ExpertRows> shared_rows;  // [s], the current rank's
  auto shared_wgrad = [&] {
    for (std::size_t s = 0; s < shared_rows.size(); ++s)
      mx_wgrad(shared_rows[s], H, L.shared[s].width, d.d_shared_gate[s].data(), d.d_shared_up[s].data(),
               d.d_shared_down[s].data());
    shared_rows.assign(L.shared.size(), ExpertRows{});
  };
  if (mx) shared_rows.assign(L.shared.size(), ExpertRows{});
  auto keep_row = [&](ExpertRows& rows, const double* x, const double* dy, double w) -> RowGrads* {
    rows.x.push_back(x);
    rows.dy.push_back(dy);
    rows.w.push_back(w);
    rows.grads.emplace_back();
    return &rows.grads.back();
  };
  for (int t = 0; t < L.N; ++t) {
    if (mx && L.T > 0 && t > 0 && t % L.T == 0) shared_wgrad();  // (a new rank's tokens)
    const double* x = &L.x[std::size_t(t) * H];
    const double* dy = &L.dy[std::size_t(t) * H];
    std::vector<double> acc(H, 0);
    double unused;
    for (std::size_t s = 0; s < L.shared.size(); ++s) {
      RowGrads* keep = mx ? keep_row(shared_rows[s], x, dy, 1.0) : nullptr;
      const auto dx = expert_row_backward(L.shared[s], x, dy, H, L.limit, 1.0, mode, d.d_shared_gate[s].data(),
                                          d.d_shared_up[s].data(), d.d_shared_down[s].data(), &unused, keep,
                                          round_backward);
      for (int h = 0; h < H; ++h) acc[h] += dx[h];
    }
    for (int j = 0; j < k; ++j) {
      const int e = L.top[t * k + j];
      RowGrads* keep = mx ? keep_row(routed_rows[e], x, dy, L.w[t * k + j]) : nullptr;
      const auto dx = expert_row_backward(L.experts[e], x, dy, H, L.limit, L.w[t * k + j], mode,
                                          d.d_gate.data() + e * I * H, d.d_up.data() + e * I * H,
                                          d.d_down.data() + e * I * H, &d.d_router[t * k + j], keep,
                                          round_backward);
      for (int h = 0; h < H; ++h) acc[h] += dx[h];
    }
    for (int h = 0; h < H; ++h) d.dx[std::size_t(t) * H + h] = mode == Mode::exact ? acc[h] : rnd_bf16(acc[h]);
  }
  if (mx) {
    shared_wgrad();
    for (int e = 0; e < E; ++e)
      mx_wgrad(routed_rows[e], H, static_cast<int>(I), d.d_gate.data() + e * I * H, d.d_up.data() + e * I * H,
               d.d_down.data() + e * I * H);
  }
  return d;
}

// Shared expert s's gradient of one kind summed over ranks, as doubles.
inline std::vector<double> shared_grad_sum(const LayerData& d, int s, HostTensor SharedHostGrads::*member) {
  std::vector<double> sum;
  for (const auto& r : d.ranks) {
    const auto v = to_doubles(r.d_shared[s].*member);
    if (sum.empty()) sum.assign(v.size(), 0.0);
    for (std::size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
  }
  return sum;
}

}  // namespace mok::test
