#include "reference/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "numerics/mxfp8.h"
#include "numerics/numerics.h"
#include "reference/gemm.h"

namespace mok::ref {
namespace {

using Matrix = std::vector<float>;  // row-major; dimensions carried beside it

// Round every element of an activation/operand matrix [rows, cols] as the precision
// demands: bf16 mode rounds to bf16, mxfp8 mode round-trips MXFP8 along the columns.
enum class Rounding { none, bf16, mxfp8 };

void apply_rounding(ThreadPool& pool, Matrix& m, std::int64_t rows, std::int64_t cols, Rounding r) {
  if (r == Rounding::none || rows == 0) return;
  pool.parallel_for(rows, 16, [&](std::int64_t b, std::int64_t e) {
    if (r == Rounding::mxfp8) {
      num::mx_roundtrip_rows(m.data() + b * cols, e - b, cols);
    } else {
      for (std::int64_t i = b * cols; i < e * cols; ++i) m[i] = num::round_bf16(m[i]);
    }
  });
}

Rounding operand_rounding(const Problem& p) {
  return p.precision == Precision::mxfp8 ? Rounding::mxfp8 : Rounding::bf16;
}

// bf16 [rows, cols] at `src` -> f32, optionally transposed to [cols, rows].
Matrix load_bf16(ThreadPool& pool, const std::uint16_t* src, std::int64_t rows, std::int64_t cols,
                 bool transpose) {
  Matrix out(static_cast<std::size_t>(rows * cols));
  pool.parallel_for(rows, 16, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t r = b; r < e; ++r)
      for (std::int64_t c = 0; c < cols; ++c) {
        const float v = num::bf16_to_float(src[r * cols + c]);
        if (transpose) out[c * rows + r] = v; else out[r * cols + c] = v;
      }
  });
  return out;
}

Matrix transpose(const Matrix& m, std::int64_t rows, std::int64_t cols) {
  Matrix t(m.size());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) t[c * rows + r] = m[r * cols + c];
  return t;
}

const std::uint16_t* bf16_ptr(const TensorView& v) { return v.as<const std::uint16_t>(); }

// One expert's weights as f32 GEMM operands for the forward:
//   gate, up [I, H] (contraction H), down [H, I] (contraction I).
struct ForwardWeights {
  Matrix gate, up, down;
  std::int64_t width;  // I of this expert
};

ForwardWeights forward_weights(const Problem& p, ThreadPool& pool, const std::uint16_t* wg,
                               const std::uint16_t* wu, const std::uint16_t* wd, std::int64_t width) {
  const std::int64_t H = p.hidden;
  ForwardWeights w{load_bf16(pool, wg, width, H, false), load_bf16(pool, wu, width, H, false),
                   load_bf16(pool, wd, H, width, false), width};
  if (p.precision == Precision::mxfp8) {
    apply_rounding(pool, w.gate, width, H, Rounding::mxfp8);
    apply_rounding(pool, w.up, width, H, Rounding::mxfp8);
    apply_rounding(pool, w.down, H, width, Rounding::mxfp8);
  }
  return w;
}

// x rows (as the GEMM operand) for a list of (rank, token) pairs: [n, H].
template <typename RowSource>
Matrix gather_rows(const Problem& p, ThreadPool& pool, std::int64_t n, RowSource row_ptr) {
  const std::int64_t H = p.hidden;
  Matrix m(static_cast<std::size_t>(n * H));
  pool.parallel_for(n, 16, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t r = b; r < e; ++r) {
      const std::uint16_t* src = row_ptr(r);
      for (std::int64_t h = 0; h < H; ++h) m[r * H + h] = num::bf16_to_float(src[h]);
    }
  });
  if (p.precision == Precision::mxfp8) apply_rounding(pool, m, n, H, Rounding::mxfp8);
  return m;
}

float limit_of(const Problem& p) { return p.swiglu_limit ? *p.swiglu_limit : 0.0f; }

// The expert FFN on n gathered rows X [n, H]: fills G, U [n, I] (fp32 pre-activations)
// and A [n, I], the SwiGLU output as the down GEMM sees it; and, when given, A_fp32 with
// the SwiGLU output before the mxfp8 operand rounding (the backward quantises its other
// orientation from those values; in bf16 mode A's bf16 values are what is kept).
void ffn_up(const Problem& p, ThreadPool& pool, const Matrix& X, std::int64_t n,
            const ForwardWeights& w, Matrix& G, Matrix& U, Matrix& A, Matrix* A_fp32 = nullptr) {
  const std::int64_t H = p.hidden, I = w.width;
  G.assign(n * I, 0.0f);
  U.assign(n * I, 0.0f);
  A.assign(n * I, 0.0f);
  gemm_nt(pool, n, I, H, X.data(), H, w.gate.data(), H, G.data(), I);
  gemm_nt(pool, n, I, H, X.data(), H, w.up.data(), H, U.data(), I);
  const float L = limit_of(p);
  for (std::int64_t i = 0; i < n * I; ++i) A[i] = num::swiglu(G[i], U[i], L);
  if (A_fp32 != nullptr) *A_fp32 = A;
  apply_rounding(pool, A, n, I, operand_rounding(p));
}

// Runs one expert on n rows and returns the output rows [n, H] in fp32 (not yet rounded).
Matrix ffn_forward(const Problem& p, ThreadPool& pool, const Matrix& X, std::int64_t n,
                   const ForwardWeights& w) {
  Matrix G, U, A;
  ffn_up(p, pool, X, n, w, G, U, A);
  const std::int64_t H = p.hidden, I = w.width;
  Matrix O(n * H);
  gemm_nt(pool, n, H, I, A.data(), I, w.down.data(), I, O.data(), H);
  return O;
}

}  // namespace

std::vector<RankSchedule> build_all_schedules(const Problem& problem, const Config& config,
                                              std::span<const RankInputs> inputs) {
  std::vector<const std::int32_t*> tops;
  for (const auto& in : inputs) tops.push_back(in.top_experts.as<const std::int32_t>());
  return build_schedules(problem, config, tops);
}

SlotBuffer routed_rows_rank(const Problem& p, ThreadPool& pool, const RankSchedule& sched, int dest,
                            std::span<const RankForward> ranks) {
  const std::int64_t H = p.hidden, I = p.intermediate;
  const RankWeights& W = ranks[dest].weights;
  SlotBuffer out(static_cast<std::size_t>(sched.real_rows() * H));
  std::int64_t written = 0;
  for (int e = 0; e < p.local_experts(); ++e) {
    const std::int64_t n = sched.expert_rows[e];
    if (n == 0) continue;
    const ScheduleRow* rows = sched.rows.data() + sched.expert_begin[e];
    const auto w = forward_weights(p, pool, bf16_ptr(W.w_gate) + e * I * H, bf16_ptr(W.w_up) + e * I * H,
                                   bf16_ptr(W.w_down) + e * H * I, I);
    const Matrix X = gather_rows(p, pool, n, [&](std::int64_t r) {
      return bf16_ptr(ranks[rows[r].src_rank].inputs.x) + std::int64_t(rows[r].slot / p.top_k) * H;
    });
    const Matrix O = ffn_forward(p, pool, X, n, w);
    for (std::int64_t i = 0; i < n * H; ++i) out[written * H + i] = num::bf16_from_float(O[i]);
    written += n;
  }
  return out;
}

void routed_forward_rank(const Problem& p, ThreadPool& pool, const RankSchedule& sched, int dest,
                         std::span<const RankForward> ranks, std::span<SlotBuffer> combine) {
  const std::int64_t H = p.hidden;
  const SlotBuffer rows = routed_rows_rank(p, pool, sched, dest, ranks);
  std::int64_t r = 0;
  for (const auto& row : sched.rows) {
    if (row.src_rank < 0) continue;
    std::copy_n(&rows[r * H], H, &combine[row.src_rank][std::int64_t(row.slot) * H]);
    ++r;
  }
}

std::vector<SlotBuffer> shared_forward_rank(const Problem& p, ThreadPool& pool, const RankForward& rank) {
  const std::int64_t T = p.tokens_per_rank, H = p.hidden;
  std::vector<SlotBuffer> shared_out;
  if (p.num_shared() == 0) return shared_out;
  const Matrix X = gather_rows(p, pool, T, [&](std::int64_t t) { return bf16_ptr(rank.inputs.x) + t * H; });
  for (int s = 0; s < p.num_shared(); ++s) {
    const auto& sw = rank.weights.shared[s];
    const auto w = forward_weights(p, pool, bf16_ptr(sw.w_gate), bf16_ptr(sw.w_up), bf16_ptr(sw.w_down),
                                   p.shared_intermediate[s]);
    const Matrix O = ffn_forward(p, pool, X, T, w);
    SlotBuffer out(O.size());
    for (std::size_t i = 0; i < O.size(); ++i) out[i] = num::bf16_from_float(O[i]);
    shared_out.push_back(std::move(out));
  }
  return shared_out;
}

void combine_epilogue_rank(const Problem& p, ThreadPool& pool, const std::vector<SlotBuffer>& shared_out,
                           const SlotBuffer& combine, const float* weights, std::uint16_t* y) {
  const std::int64_t T = p.tokens_per_rank, H = p.hidden, k = p.top_k;
  // Fixed order: shared experts first, then the k slots in j order.
  pool.parallel_for(T, 8, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t t = b; t < e; ++t)
      for (std::int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (const auto& so : shared_out) acc = acc + num::bf16_to_float(so[t * H + h]);
        for (std::int64_t j = 0; j < k; ++j) {
          const float term = weights[t * k + j] * num::bf16_to_float(combine[(t * k + j) * H + h]);
          acc = acc + term;
        }
        y[t * H + h] = num::bf16_from_float(acc);
      }
  });
}

void forward(const Problem& p, ThreadPool& pool, std::span<const RankForward> ranks,
             std::span<const RankSchedule> scheds, std::vector<SlotBuffer>* combine_out) {
  const int R = p.ep_size;
  const std::int64_t T = p.tokens_per_rank, H = p.hidden, k = p.top_k;

  // Dispatch + routed experts + combine: every slot is written exactly once.
  const std::size_t slot_elems = static_cast<std::size_t>(T * k * H);
  std::vector<SlotBuffer> local;
  std::vector<SlotBuffer>& combine = combine_out != nullptr ? *combine_out : local;
  const bool in_place =
      combine.size() == static_cast<std::size_t>(R) &&
      std::all_of(combine.begin(), combine.end(), [&](const SlotBuffer& c) { return c.size() == slot_elems; });
  if (in_place) {
    for (SlotBuffer& c : combine) std::fill(c.begin(), c.end(), std::uint16_t{0});
  } else {
    combine.assign(R, SlotBuffer(slot_elems, 0));
  }
  for (int d = 0; d < R; ++d) routed_forward_rank(p, pool, scheds[d], d, ranks, combine);

  for (int r = 0; r < R; ++r) {
    const std::vector<SlotBuffer> shared_out = shared_forward_rank(p, pool, ranks[r]);
    combine_epilogue_rank(p, pool, shared_out, combine[r], ranks[r].inputs.router_weights.as<const float>(),
                          ranks[r].y.as<std::uint16_t>());
  }
}

namespace {

// The backward of one expert on n rows.
//   X_op [n,H]: x rows as the forward's GEMM operand; X_raw, DY_raw [n,H]: the bf16 x and
//   dy rows as fp32 (each GEMM rounds its own operands); row_weight [n]: router weights.
// Returns DX [n,H] fp32 (rounded into dx slots by the caller) and dw [n], the router-weight
// gradients; writes the expert's weight gradients dWg, dWu [I,H], dWd [H,I] (overwritten).
struct ExpertBackward {
  Matrix DX;
  std::vector<float> dw;
};

ExpertBackward ffn_backward(const Problem& p, ThreadPool& pool, const Matrix& X_op, const Matrix& X_raw,
                            const Matrix& DY_raw, const std::vector<float>& row_weight, std::int64_t n,
                            const std::uint16_t* wg, const std::uint16_t* wu, const std::uint16_t* wd,
                            std::int64_t I, float* dWg, float* dWu, float* dWd) {
  const std::int64_t H = p.hidden;
  const Rounding op = operand_rounding(p);
  const bool mx = p.precision == Precision::mxfp8;
  // Recompute the forward's gate/up and a.
  const auto fw = forward_weights(p, pool, wg, wu, wd, I);
  Matrix G, U, A, A_fp32;
  ffn_up(p, pool, X_op, n, fw, G, U, A, mx ? &A_fp32 : nullptr);
  Matrix DY = DY_raw;
  if (mx) apply_rounding(pool, DY, n, H, Rounding::mxfp8);

  // dgrad through down: DA [n,I] = DY [n,H] . W_down^T, W_down^T rows [I,H] (contraction H).
  Matrix WdT = load_bf16(pool, wd, H, I, /*transpose=*/true);
  if (mx) apply_rounding(pool, WdT, I, H, Rounding::mxfp8);
  Matrix DA(n * I);
  gemm_nt(pool, n, I, H, DY.data(), H, WdT.data(), H, DA.data(), I);

  ExpertBackward out;
  out.dw.resize(n);
  for (std::int64_t r = 0; r < n; ++r) out.dw[r] = dot(DA.data() + r * I, A.data() + r * I, I);

  // SwiGLU backward with the router weight: dA = w * DA.
  const float L = limit_of(p);
  Matrix DGU(n * 2 * I);      // [n, 2I] = [dG | dU], the dx GEMM operand
  Matrix DG(n * I), DU(n * I);  // fp32, for the wgrad operands
  // w * a, the down wgrad operand: mxfp8 quantises it along the rows from a's fp32 values
  // (not from A, already quantised along I for the forward's down GEMM).
  Matrix AW(n * I);
  const Matrix& A_wgrad = mx ? A_fp32 : A;
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t i = 0; i < I; ++i) {
      const std::int64_t idx = r * I + i;
      const float dA = row_weight[r] * DA[idx];
      float g = G[idx], u = U[idx];
      bool g_pass = true, u_pass = true;
      if (L > 0.0f) {
        if (g > L) { g = L; g_pass = false; }
        if (u > L) { u = L; u_pass = false; }
        if (u < -L) { u = -L; u_pass = false; }
      }
      const float sig = 1.0f / (1.0f + std::exp(-g));
      const float silu = g * sig;
      const float dsilu = sig * (1.0f + g * (1.0f - sig));
      // A clamped input's gradient is 0, selected rather than multiplied by 0 so that an
      // infinite dA gives 0 there, not NaN (as torch.clamp's backward).
      DG[idx] = g_pass ? dA * u * dsilu : 0.0f;
      DU[idx] = u_pass ? dA * silu : 0.0f;
      AW[idx] = row_weight[r] * A_wgrad[idx];
      DGU[r * 2 * I + i] = DG[idx];
      DGU[r * 2 * I + I + i] = DU[idx];
    }
  // The dx operand rounds along 2I (blocks never straddle gate|up since I % 32 == 0 in mxfp8).
  apply_rounding(pool, DGU, n, 2 * I, op);

  // dgrad through gate/up: DX [n,H] = DGU [n,2I] . [W_gate^T | W_up^T] rows [H, 2I].
  Matrix Wcat(H * 2 * I);
  {
    const Matrix WgT = load_bf16(pool, wg, I, H, true), WuT = load_bf16(pool, wu, I, H, true);
    for (std::int64_t h = 0; h < H; ++h) {
      std::memcpy(&Wcat[h * 2 * I], &WgT[h * I], I * sizeof(float));
      std::memcpy(&Wcat[h * 2 * I + I], &WuT[h * I], I * sizeof(float));
    }
    if (mx) apply_rounding(pool, Wcat, H, 2 * I, Rounding::mxfp8);
  }
  out.DX.assign(n * H, 0.0f);
  gemm_nt(pool, n, H, 2 * I, DGU.data(), 2 * I, Wcat.data(), 2 * I, out.DX.data(), H);

  // wgrad: contraction over the n rows, operands transposed to [*, n] and rounded along n.
  // bf16 mode rounds dG, dU and w*a to bf16; DY and x are bf16 already.
  Matrix DYt = transpose(DY_raw, n, H), Xt = transpose(X_raw, n, H);  // [H, n]
  Matrix AWt = transpose(AW, n, I), DGt = transpose(DG, n, I), DUt = transpose(DU, n, I);
  apply_rounding(pool, AWt, I, n, op);
  apply_rounding(pool, DGt, I, n, op);
  apply_rounding(pool, DUt, I, n, op);
  if (mx) {
    apply_rounding(pool, DYt, H, n, Rounding::mxfp8);
    apply_rounding(pool, Xt, H, n, Rounding::mxfp8);
  }
  gemm_nt(pool, H, I, n, DYt.data(), n, AWt.data(), n, dWd, I);
  gemm_nt(pool, I, H, n, DGt.data(), n, Xt.data(), n, dWg, H);
  gemm_nt(pool, I, H, n, DUt.data(), n, Xt.data(), n, dWu, H);
  return out;
}

}  // namespace

void backward(const Problem& p, ThreadPool& pool, std::span<const RankBackward> ranks,
              std::span<const RankSchedule> scheds) {
  const int R = p.ep_size, E_loc = p.local_experts();
  const std::int64_t T = p.tokens_per_rank, H = p.hidden, I = p.intermediate, k = p.top_k;
  // Rows gathered as plain bf16 values (no operand rounding): each GEMM rounds its own.
  Problem plain = p;
  plain.precision = Precision::bf16;

  std::vector<SlotBuffer> dx_slots(R, SlotBuffer(static_cast<std::size_t>(T * k * H), 0));
  for (int d = 0; d < R; ++d) {
    const RankBackward& rk = ranks[d];
    const RankSchedule& sched = scheds[d];
    float* dWg = rk.d_w_gate.as<float>();
    float* dWu = rk.d_w_up.as<float>();
    float* dWd = rk.d_w_down.as<float>();
    for (int e = 0; e < E_loc; ++e) {
      const std::int64_t n = sched.expert_rows[e];
      float* gWg = dWg + e * I * H;
      float* gWu = dWu + e * I * H;
      float* gWd = dWd + e * H * I;
      if (n == 0) {
        std::fill(gWg, gWg + I * H, 0.0f);
        std::fill(gWu, gWu + I * H, 0.0f);
        std::fill(gWd, gWd + H * I, 0.0f);
        continue;
      }
      const ScheduleRow* rows = sched.rows.data() + sched.expert_begin[e];
      auto x_row = [&](std::int64_t r) {
        return bf16_ptr(ranks[rows[r].src_rank].inputs.x) + std::int64_t(rows[r].slot / k) * H;
      };
      auto dy_row = [&](std::int64_t r) {
        return bf16_ptr(ranks[rows[r].src_rank].dy) + std::int64_t(rows[r].slot / k) * H;
      };
      const Matrix X = gather_rows(p, pool, n, x_row);
      const Matrix Xraw = gather_rows(plain, pool, n, x_row);
      const Matrix DYraw = gather_rows(plain, pool, n, dy_row);
      std::vector<float> row_weight(n);
      for (std::int64_t r = 0; r < n; ++r)
        row_weight[r] = ranks[rows[r].src_rank].inputs.router_weights.as<const float>()[rows[r].slot];
      auto res = ffn_backward(p, pool, X, Xraw, DYraw, row_weight, n, bf16_ptr(rk.weights.w_gate) + e * I * H,
                              bf16_ptr(rk.weights.w_up) + e * I * H, bf16_ptr(rk.weights.w_down) + e * H * I,
                              I, gWg, gWu, gWd);
      for (std::int64_t r = 0; r < n; ++r) {
        const int src = rows[r].src_rank, slot = rows[r].slot;
        ranks[src].d_router_weights.as<float>()[slot] = res.dw[r];
        std::uint16_t* out = dx_slots[src].data() + std::int64_t(slot) * H;
        for (std::int64_t h = 0; h < H; ++h) out[h] = num::bf16_from_float(res.DX[r * H + h]);
      }
    }
  }

  for (int r = 0; r < R; ++r) {
    const RankBackward& rk = ranks[r];
    std::vector<SlotBuffer> shared_dx;
    if (p.num_shared() > 0) {
      auto x_row = [&](std::int64_t t) { return bf16_ptr(rk.inputs.x) + t * H; };
      auto dy_row = [&](std::int64_t t) { return bf16_ptr(rk.dy) + t * H; };
      const Matrix X = gather_rows(p, pool, T, x_row);
      const Matrix Xraw = gather_rows(plain, pool, T, x_row);
      const Matrix DYraw = gather_rows(plain, pool, T, dy_row);
      const std::vector<float> ones(T, 1.0f);
      for (int s = 0; s < p.num_shared(); ++s) {
        const auto& sw = rk.weights.shared[s];
        const auto& sg = rk.d_shared[s];
        auto res = ffn_backward(p, pool, X, Xraw, DYraw, ones, T, bf16_ptr(sw.w_gate), bf16_ptr(sw.w_up),
                                bf16_ptr(sw.w_down), p.shared_intermediate[s], sg.d_w_gate.as<float>(),
                                sg.d_w_up.as<float>(), sg.d_w_down.as<float>());
        SlotBuffer out(T * H);
        for (std::int64_t i = 0; i < T * H; ++i) out[i] = num::bf16_from_float(res.DX[i]);
        shared_dx.push_back(std::move(out));
      }
    }
    std::uint16_t* dx = rk.dx.as<std::uint16_t>();
    pool.parallel_for(T, 8, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t t = b; t < e; ++t)
        for (std::int64_t h = 0; h < H; ++h) {
          float acc = 0.0f;
          for (const auto& sd : shared_dx) acc = acc + num::bf16_to_float(sd[t * H + h]);
          for (std::int64_t j = 0; j < k; ++j) acc = acc + num::bf16_to_float(dx_slots[r][(t * k + j) * H + h]);
          dx[t * H + h] = num::bf16_from_float(acc);
        }
    });
  }
}

}  // namespace mok::ref
