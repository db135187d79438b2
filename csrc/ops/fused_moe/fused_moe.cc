// The fused_experts CPU kernels (forward and backward) and fused_moe's softmax router.
#include "csrc/ops/fused_moe/fused_moe.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "csrc/core/base/int_math.h"
#include "csrc/core/runtime/isa.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/core/runtime/scratch_arena.h"
#include "csrc/core/vec/tiers.h"
#include "csrc/ops/moe_gather/element_access.h"
#include "csrc/ops/topk/topk.h"

namespace tokamax {

TOKAMAX_DECLARE_IN_TIERS(MoeRowGradsFn MoeRowGrads(DType dtype, Activation activation);)

namespace {

// The tier's row pass of the backward; the avx512bf16 and amx tiers run avx512's.
MoeRowGradsFn RowGradsOf(Isa isa, DType dtype, Activation activation) {
  TOKAMAX_RETURN_BY_VECTOR_WIDTH(isa, MoeRowGrads(dtype, activation));
}


using moe::Acc;
using moe::Load;
using moe::LoadAny;
using moe::Store;
using moe::StoreAny;

// d/dg of Activate(activation, g), the backward's only use of the activation's form.
template <typename A>
A ActivationGrad(Activation activation, A g) {
  if (activation == Activation::kSilu) {
    const A s = A(1) / (A(1) + std::exp(-g));
    return s * (A(1) + g * (A(1) - s));
  }
  const A c = A(0.7978845608028654), a = A(0.044715);
  const A th = std::tanh(c * (g + a * g * g * g));
  return A(0.5) * (A(1) + th) + A(0.5) * g * (A(1) - th * th) * c * (A(1) + A(3) * a * g * g);
}

// The (token, slot) pairs sorted by expert: sorted row s is flat position order[s] = t*k + j.
struct Routing {
  int64_t rows = 0;
  LargeBuffer<int64_t> order, inverse, token;
  std::vector<int64_t> offsets;  // [E + 1]: expert e owns sorted rows [offsets[e], offsets[e+1])
};

Status Route(const FusedExpertsParams& p, const char* op, Routing* r) {
  const int64_t tokens = p.topk_ids.rows, k = p.topk_ids.cols, experts = p.w1.sizes[0];
  r->rows = tokens * k;
  r->order = LargeBuffer<int64_t>(r->rows, LargeBuffer<int64_t>::kUninitialized);
  r->inverse = LargeBuffer<int64_t>(r->rows, LargeBuffer<int64_t>::kUninitialized);
  r->token = LargeBuffer<int64_t>(r->rows, LargeBuffer<int64_t>::kUninitialized);
  std::vector<int32_t> sizes(experts);
  MoePermuteParams permute;
  permute.expert_indices = p.topk_ids;
  permute.num_experts = experts;
  permute.order = r->order.data();
  permute.inverse = r->inverse.data();
  permute.group_sizes = sizes.data();
  Status status = MoePermute(permute);
  if (!status.ok()) {
    // moe_permute's message, in this op's words.
    std::string message = status.message();
    const std::string from = "moe_permute: expert_indices";
    if (message.rfind(from, 0) == 0) message = std::string(op) + ": topk_ids" + message.substr(from.size());
    return Status::Error(message);
  }
  r->offsets.assign(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) r->offsets[e + 1] = r->offsets[e] + sizes[e];
  for (int64_t s = 0; s < r->rows; ++s) r->token[s] = r->order[s] / k;
  return Status::Ok();
}

// Sorted rows [row0, row1) of one expert and columns [col0, col1) of a product's output.
struct Task {
  int64_t expert, row0, row1, col0, col1;
};

// Tasks over (expert, at most task_rows of its rows, `width` of `cols` columns): a task packs each
// panel of its expert's weight columns once for all its rows. (Tasks over rows alone repacked the
// whole expert per task: the bf16 engine's weight copies were 19% of the forward's samples.) An
// expert without rows gets no task.
std::vector<Task> Tasks(const Routing& r, int64_t task_rows, int64_t cols, int64_t width) {
  std::vector<Task> tasks;
  for (size_t e = 0; e + 1 < r.offsets.size(); ++e) {
    for (int64_t r0 = r.offsets[e]; r0 < r.offsets[e + 1]; r0 += task_rows) {
      const int64_t r1 = std::min(r0 + task_rows, r.offsets[e + 1]);
      for (int64_t c0 = 0; c0 < cols; c0 += width) {
        tasks.push_back({static_cast<int64_t>(e), r0, r1, c0, std::min(c0 + width, cols)});
      }
    }
  }
  return tasks;
}

// Runs body(task) for every task, threads pulling indices from a shared counter (uneven experts).
template <typename Item, typename Body>
void RunTasks(const std::vector<Item>& tasks, const Body& body) {
  const int64_t count = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  ParallelFor(0, count, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) body(tasks[i]);
  });
}

// The blocking of a product with B packed (the weight gradients': their rows are H or I).
GemmBlocking PackedBlockingOf(const FusedExpertsConfig& config) {
  GemmBlocking blocking;
  blocking.block_m = 144;  // ragged_dot's measured default (rows of A packed at once)
  blocking.block_k = config.block_k;
  blocking.block_n = config.block_n;
  return blocking;
}

// The blocking of a product over `rows` of an expert's rows: below pack_b_min_rows the GEMM
// reads the weight's columns in place where they are contiguous (packing pays only once enough
// rows reuse each element). The sums' order is block_k's either way: the same bits.
GemmBlocking BlockingOf(const FusedExpertsConfig& config, int64_t rows) {
  GemmBlocking blocking = PackedBlockingOf(config);
  blocking.pack_b = rows >= config.pack_b_min_rows;
  return blocking;
}

// The gated product packs gate and up columns side by side: half of block_n each, so a task
// packs as many weight columns as the plain products'.
int64_t GatedBlockN(const FusedExpertsConfig& config) { return std::max(kGemmNr, RoundUp(config.block_n / 2, kGemmNr)); }

// Expert e's matrices (and their transposes), no copies: any strides.
ConstMatrix W1(const FusedExpertsParams& p, int64_t e, int64_t col0, int64_t cols) {
  return {p.w1.At(e, 0, col0), p.w1.dtype, p.w1.sizes[1], cols, p.w1.strides[1], p.w1.strides[2]};
}
ConstMatrix W1T(const FusedExpertsParams& p, int64_t e) {
  return {p.w1.At(e, 0, 0), p.w1.dtype, p.w1.sizes[2], p.w1.sizes[1], p.w1.strides[2], p.w1.strides[1]};
}
ConstMatrix W2(const FusedExpertsParams& p, int64_t e) {
  return {p.w2.At(e, 0, 0), p.w2.dtype, p.w2.sizes[1], p.w2.sizes[2], p.w2.strides[1], p.w2.strides[2]};
}
ConstMatrix W2T(const FusedExpertsParams& p, int64_t e) {
  return {p.w2.At(e, 0, 0), p.w2.dtype, p.w2.sizes[2], p.w2.sizes[1], p.w2.strides[2], p.w2.strides[1]};
}
template <typename A>
MutableMatrix AccMatrix(A* data, int64_t rows, int64_t cols) {
  return {data, std::is_same_v<A, double> ? DType::kFloat64 : DType::kFloat32, rows, cols, cols, 1};
}

// C[:, n0:n1] = A · B[:, n0:n1] for a weight gradient C laid out as its weight. A gradient of a
// transposed weight view has strided columns, and the GEMM's store would write it one cache line
// per element (seconds at the benchmark's sizes); there Cᵀ = Bᵀ · Aᵀ is stored along its rows.
void WeightGradProduct(const GemmKernels& kernels, const ConstMatrix& a, const ConstMatrix& b, const MutableMatrix& c,
                       int64_t n0, int64_t n1, const GemmBlocking& blocking) {
  if (!(c.col_stride != 1 && c.row_stride == 1)) {
    GemmRegion(kernels, a, b, c, 0, a.rows, n0, n1, blocking);
    return;
  }
  const ConstMatrix bt{b.data, b.dtype, b.cols, b.rows, b.col_stride, b.row_stride};
  const ConstMatrix at{a.data, a.dtype, a.cols, a.rows, a.col_stride, a.row_stride};
  const MutableMatrix ct{c.data, c.dtype, c.cols, c.rows, c.col_stride, c.row_stride};
  GemmRegion(kernels, bt, at, ct, n0, n1, 0, at.cols, blocking);
}

// Rows row_map[0..rows) of x, copied into `dst` [rows, H] (contiguous).
template <typename T>
void GatherRows(const StridedView<2>& x, const int64_t* row_map, int64_t rows, T* dst) {
  const int64_t hidden = x.sizes[1];
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = static_cast<const T*>(x.data) + row_map[r] * x.strides[0];
    if (x.strides[1] == 1) {
      std::memcpy(dst + r * hidden, src, hidden * sizeof(T));
    } else {
      for (int64_t c = 0; c < hidden; ++c) dst[r * hidden + c] = src[c * x.strides[1]];
    }
  }
}

// A [E, N] bias as fp32 (the gated epilogue's bias type); empty without one.
std::vector<float> BiasFloat(const StridedView<2>& bias) {
  std::vector<float> out;
  if (bias.data == nullptr) return out;
  out.resize(bias.sizes[0] * bias.sizes[1]);
  for (int64_t e = 0; e < bias.sizes[0]; ++e) {
    for (int64_t n = 0; n < bias.sizes[1]; ++n) {
      out[e * bias.sizes[1] + n] = static_cast<float>(LoadAny(bias.At(e, n), bias.dtype));
    }
  }
  return out;
}

// h[s][col0:col1] = act(x_s·w1_gate + b1_gate) * (x_s·w1_up + b1_up) for the task's sorted rows s
// (x_s read through the routing's token map, no copy), one gated product on the GEMM core: gate
// and up share x's packed panels and the GLU runs in the GEMM's store, so the pre-activations
// exist only where `pre` ([R, 2I] in T, sorted rows: gate then up) asks for them. float64 keeps
// its bias exact (the epilogue's bias is fp32): the biases and the GLU then run here.
template <typename T>
void GatedProjection(const GemmKernels& kernels, const FusedExpertsParams& p, const Routing& routing, const Task& task,
                     const GemmBlocking& blocking, const std::vector<float>& b1, T* h, T* pre) {
  using A = Acc<T>;
  const int64_t inter = p.w2.sizes[1], rows = task.row1 - task.row0, e = task.expert;
  const DType dtype = p.x.dtype;
  const ConstMatrix x{p.x.data, dtype, rows, p.x.sizes[1], p.x.strides[0], p.x.strides[1]};
  GemmPrologue gather;
  gather.a_row_map = &routing.token[task.row0];
  GemmGate gate;
  gate.up = W1(p, e, inter, inter);
  GemmEpilogue epilogue;
  epilogue.gate = &gate;
  epilogue.activation = p.activation;
  const bool exact_bias = std::is_same_v<T, double> && p.w1_bias.data != nullptr;
  ScratchLease lease;
  T* pre_rows = pre != nullptr ? pre + task.row0 * 2 * inter : nullptr;
  if (exact_bias) {
    epilogue.activation = Activation::kNone;
    if (pre_rows == nullptr) pre_rows = lease.Get<T>(0, rows * 2 * inter);
  } else if (!b1.empty()) {
    epilogue.bias = &b1[e * 2 * inter];
    gate.up_bias = &b1[e * 2 * inter + inter];
  }
  if (pre_rows != nullptr) {
    gate.gate_out = {pre_rows, dtype, rows, inter, 2 * inter, 1};
    gate.up_out = {pre_rows + inter, dtype, rows, inter, 2 * inter, 1};
  }
  // The task's columns as a [0, width) range of shifted views (B, up, C and the pre-activations).
  const int64_t width = task.col1 - task.col0;
  ConstMatrix b = W1(p, e, task.col0, width);
  gate.up = W1(p, e, inter + task.col0, width);
  if (epilogue.bias != nullptr) {
    epilogue.bias += task.col0;
    gate.up_bias += task.col0;
  }
  if (pre_rows != nullptr) {
    gate.gate_out.data = pre_rows + task.col0;
    gate.up_out.data = pre_rows + inter + task.col0;
    gate.gate_out.cols = gate.up_out.cols = width;
  }
  const MutableMatrix hm{h + task.row0 * inter + task.col0, dtype, rows, width, inter, 1};
  GemmRegion(kernels, x, b, hm, 0, rows, 0, width, blocking, epilogue, gather);
  if (!exact_bias) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = task.col0; i < task.col1; ++i) {
      T* g = pre_rows + r * 2 * inter + i;
      T* u = g + inter;
      const A gv = Load(g) + static_cast<A>(LoadAny(p.w1_bias.At(e, i), p.w1_bias.dtype));
      const A uv = Load(u) + static_cast<A>(LoadAny(p.w1_bias.At(e, inter + i), p.w1_bias.dtype));
      Store(g, gv);
      Store(u, uv);
      Store(h + (task.row0 + r) * inter + i, Activate(p.activation, gv) * uv);
    }
  }
}

// Every sorted row's GLU output h [R, I] (and with `pre` its pre-activations [R, 2I]), in T.
template <typename T>
void GatedProjections(const GemmKernels& kernels, const FusedExpertsParams& p, const Routing& routing,
                      const FusedExpertsConfig& config, T* h, T* pre) {
  const std::vector<float> b1 = BiasFloat(p.w1_bias);
  const std::vector<Task> tasks = Tasks(routing, config.task_rows, p.w2.sizes[1], GatedBlockN(config));
  RunTasks(tasks, [&](const Task& task) {
    GemmBlocking blocking = BlockingOf(config, task.row1 - task.row0);
    blocking.block_n = GatedBlockN(config);
    GatedProjection<T>(kernels, p, routing, task, blocking, b1, h, pre);
  });
}

Status Prepare(const FusedExpertsParams& p, const FusedExpertsConfig& config, const char* op, Routing* routing,
               const GemmKernels** kernels) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  if (p.activation != Activation::kSilu && p.activation != Activation::kGeluTanh) {
    return Status::Error(std::string(op) + ": act_fn must be silu or gelu");
  }
  Isa isa;
  status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  *kernels = &GetGemmKernels(isa);
  return Route(p, op, routing);
}

}  // namespace

// Two passes of tasks over (expert, column block) with all of a block of the expert's rows: the
// gated gate|up product into h [R, I], then h·w2 into a per-slot fp32 buffer y [R, H]; a
// fixed-order per-token sum combines the slots.
Status FusedExperts(const FusedExpertsParams& p, const FusedExpertsConfig& config) {
  Routing routing;
  const GemmKernels* kernels = nullptr;
  Status status = Prepare(p, config, "fused_experts", &routing, &kernels);
  if (!status.ok()) return status;
  const int64_t tokens = p.x.sizes[0], hidden = p.x.sizes[1], inter = p.w2.sizes[1], k = p.topk_ids.cols;
  return DispatchDType(p.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    LargeBuffer<T> h(routing.rows * inter, LargeBuffer<T>::kUninitialized);
    GatedProjections<T>(*kernels, p, routing, config, h.data(), static_cast<T*>(p.residuals));
    // Each sorted row's expert output y (h·w2 + b2), combined below in a fixed order.
    LargeBuffer<A> y(routing.rows * hidden, LargeBuffer<A>::kUninitialized);
    RunTasks(Tasks(routing, config.task_rows, hidden, config.block_n), [&](const Task& task) {
      const int64_t rows = task.row1 - task.row0;
      const ConstMatrix hm{&h[task.row0 * inter], p.x.dtype, rows, inter, inter, 1};
      A* y_rows = &y[task.row0 * hidden];
      GemmRegion(*kernels, hm, W2(p, task.expert), AccMatrix(y_rows, rows, hidden), 0, rows, task.col0, task.col1,
                 BlockingOf(config, rows));
      if (p.w2_bias.data != nullptr) {
        for (int64_t c = task.col0; c < task.col1; ++c) {
          const A b = static_cast<A>(LoadAny(p.w2_bias.At(task.expert, c), p.w2_bias.dtype));
          for (int64_t r = 0; r < rows; ++r) y_rows[r * hidden + c] += b;
        }
      }
    });
    // out[t] = sum over j ascending of w[t, j] * y[row of (t, j)].
    ParallelFor(0, tokens, 16, [&](int64_t t0, int64_t t1) {
      std::vector<A> acc(hidden);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t j = 0; j < k; ++j) {
          const A w = static_cast<A>(LoadAny(p.topk_weights.At(t, j), p.topk_weights.dtype));
          const A* row = &y[routing.inverse[t * k + j] * hidden];
          for (int64_t c = 0; c < hidden; ++c) acc[c] += w * row[c];
        }
        T* out = static_cast<T*>(p.out.data);
        for (int64_t c = 0; c < hidden; ++c) Store(out + t * p.out.strides[0] + c * p.out.strides[1], acc[c]);
      }
    });
    return Status::Ok();
  });
}

// The backward, with s a sorted row of expert e, token t and weight w, h_s its GLU output and
// g_s = dout[t]·w2[e]ᵀ:
//   dw_s = h_s·g_s + dout[t]·b2[e];  dh_s = w g_s;  dgate = dh u act'(gate);  dup = dh act(gate)
//   dx[t] = sum over the token's slots, ascending, of [dgate|dup]_s · w1[e]ᵀ
//   dw1[e] = X_eᵀ [dgate|dup]_e,  dw2[e] = (w h)_eᵀ dout_e,  db1[e] = sum_s [dgate|dup]_s,
//   db2[e] = sum_s w dout[t]  (sums over the expert's rows in sorted order).
// gate|up come from the forward's saved pre-activations (params.residuals), or are recomputed
// by the forward's gated product (the same bits) when none were saved.
Status FusedExpertsBackward(const FusedExpertsParams& p, const FusedExpertsConfig& config) {
  Routing routing;
  const GemmKernels* kernels = nullptr;
  Status status = Prepare(p, config, "fused_experts", &routing, &kernels);
  if (!status.ok()) return status;
  Isa isa;
  status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  const int64_t tokens = p.x.sizes[0], hidden = p.x.sizes[1], inter = p.w2.sizes[1], k = p.topk_ids.cols;
  const int64_t experts = p.w1.sizes[0], rows_total = routing.rows;
  const GemmBlocking blocking = PackedBlockingOf(config);  // the weight gradients'
  return DispatchDType(p.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    const DType dtype = p.x.dtype;
    const T* pre = static_cast<const T*>(p.residuals);
    LargeBuffer<T> recomputed;
    if (pre == nullptr) {
      recomputed = LargeBuffer<T>(rows_total * 2 * inter, LargeBuffer<T>::kUninitialized);
      LargeBuffer<T> h(rows_total * inter, LargeBuffer<T>::kUninitialized);
      GatedProjections<T>(*kernels, p, routing, config, h.data(), recomputed.data());
      pre = recomputed.data();
    }
    // Per sorted row: the gathered x and dout rows, dout·w2ᵀ (A), w*h and [dgate|dup] (T), dx's
    // part (A).
    LargeBuffer<T> xg(rows_total * hidden, LargeBuffer<T>::kUninitialized);
    LargeBuffer<T> doutg(rows_total * hidden, LargeBuffer<T>::kUninitialized);
    ParallelFor(0, rows_total, 64, [&](int64_t s0, int64_t s1) {
      GatherRows(p.x, &routing.token[s0], s1 - s0, &xg[s0 * hidden]);
      GatherRows(p.dout, &routing.token[s0], s1 - s0, &doutg[s0 * hidden]);
    });
    LargeBuffer<A> grad(rows_total * inter, LargeBuffer<A>::kUninitialized);
    RunTasks(Tasks(routing, config.task_rows, inter, config.block_n), [&](const Task& task) {
      const int64_t rows = task.row1 - task.row0;
      const ConstMatrix dout_rows{&doutg[task.row0 * hidden], dtype, rows, hidden, hidden, 1};
      GemmRegion(*kernels, dout_rows, W2T(p, task.expert), AccMatrix(&grad[task.row0 * inter], rows, inter), 0, rows,
                 task.col0, task.col1, BlockingOf(config, rows));
    });
    LargeBuffer<T> wh(rows_total * inter, LargeBuffer<T>::kUninitialized);
    LargeBuffer<T> dpre(rows_total * 2 * inter, LargeBuffer<T>::kUninitialized);
    const MoeRowGradsFn row_grads = RowGradsOf(isa, dtype, p.activation);
    ParallelFor(0, rows_total, 16, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t flat = routing.order[s], t = flat / k, j = flat % k, e = p.topk_ids.At(t, j);
        const A w = static_cast<A>(LoadAny(p.topk_weights.At(t, j), p.topk_weights.dtype));
        A dw = 0;
        if (p.w2_bias.data != nullptr) {
          for (int64_t c = 0; c < hidden; ++c) {
            dw += Load(&doutg[s * hidden + c]) * static_cast<A>(LoadAny(p.w2_bias.At(e, c), p.w2_bias.dtype));
          }
        }
        A hg = 0;
        const T* gate = pre + s * 2 * inter;
        T* dg = &dpre[s * 2 * inter];
        if constexpr (std::is_same_v<A, float>) {
          if (row_grads != nullptr) {
            hg = row_grads(&grad[s * inter], gate, gate + inter, w, &wh[s * inter], dg, dg + inter, inter);
            StoreAny(p.dtopk_weights.At(t, j), p.dtopk_weights.dtype, static_cast<double>(dw + hg));
            continue;
          }
        }
        for (int64_t i = 0; i < inter; ++i) {
          const A g = Load(gate + i), u = Load(gate + inter + i), d = grad[s * inter + i];
          const A act = Activate(p.activation, g);
          hg += act * u * d;
          Store(&wh[s * inter + i], w * act * u);
          const A dh = w * d;
          Store(dg + i, dh * u * ActivationGrad(p.activation, g));
          Store(dg + inter + i, dh * act);
        }
        StoreAny(p.dtopk_weights.At(t, j), p.dtopk_weights.dtype, static_cast<double>(dw + hg));
      }
    });
    grad = LargeBuffer<A>();
    LargeBuffer<A> dxs(rows_total * hidden, LargeBuffer<A>::kUninitialized);
    RunTasks(Tasks(routing, config.task_rows, hidden, config.block_n), [&](const Task& task) {
      const int64_t rows = task.row1 - task.row0;
      const ConstMatrix dpre_rows{&dpre[task.row0 * 2 * inter], dtype, rows, 2 * inter, 2 * inter, 1};
      GemmRegion(*kernels, dpre_rows, W1T(p, task.expert), AccMatrix(&dxs[task.row0 * hidden], rows, hidden), 0, rows,
                 task.col0, task.col1, BlockingOf(config, rows));
    });
    // Weight gradients: one task per (expert, column block), each summing all the expert's rows in
    // sorted order (an expert with no rows gets K = 0: exact zeros).
    struct WeightTask {
      int64_t expert, which, n0, n1;  // which: 0 dw1, 1 dw2
    };
    std::vector<WeightTask> weight_tasks;
    for (int64_t e = 0; e < experts; ++e) {
      for (int64_t n0 = 0; n0 < 2 * inter; n0 += config.block_n) {
        weight_tasks.push_back({e, 0, n0, std::min(n0 + config.block_n, 2 * inter)});
      }
      for (int64_t n0 = 0; n0 < hidden; n0 += config.block_n) {
        weight_tasks.push_back({e, 1, n0, std::min(n0 + config.block_n, hidden)});
      }
    }
    RunTasks(weight_tasks, [&](const WeightTask& task) {
      const int64_t e = task.expert, r0 = routing.offsets[e], rows = routing.offsets[e + 1] - r0;
      if (task.which == 0) {
        const ConstMatrix a{&xg[r0 * hidden], dtype, hidden, rows, 1, hidden};
        const ConstMatrix b{&dpre[r0 * 2 * inter], dtype, rows, 2 * inter, 2 * inter, 1};
        const MutableMatrix c{p.dw1.At(e, 0, 0), p.dw1.dtype, hidden, 2 * inter, p.dw1.strides[1], p.dw1.strides[2]};
        WeightGradProduct(*kernels, a, b, c, task.n0, task.n1, blocking);
        if (p.dw1_bias.data != nullptr) {
          for (int64_t n = task.n0; n < task.n1; ++n) {
            A sum = 0;
            for (int64_t r = 0; r < rows; ++r) sum += Load(&dpre[(r0 + r) * 2 * inter + n]);
            StoreAny(p.dw1_bias.At(e, n), p.dw1_bias.dtype, static_cast<double>(sum));
          }
        }
      } else {
        const ConstMatrix a{&wh[r0 * inter], dtype, inter, rows, 1, inter};
        const ConstMatrix b{&doutg[r0 * hidden], dtype, rows, hidden, hidden, 1};
        const MutableMatrix c{p.dw2.At(e, 0, 0), p.dw2.dtype, inter, hidden, p.dw2.strides[1], p.dw2.strides[2]};
        WeightGradProduct(*kernels, a, b, c, task.n0, task.n1, blocking);
        if (p.dw2_bias.data != nullptr) {
          for (int64_t n = task.n0; n < task.n1; ++n) {
            A sum = 0;
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t flat = routing.order[r0 + r];
              const A w = static_cast<A>(LoadAny(p.topk_weights.At(flat / k, flat % k), p.topk_weights.dtype));
              sum += w * Load(&doutg[(r0 + r) * hidden + n]);
            }
            StoreAny(p.dw2_bias.At(e, n), p.dw2_bias.dtype, static_cast<double>(sum));
          }
        }
      }
    });
    // dx[t] = sum over j ascending of the slot's part.
    ParallelFor(0, tokens, 16, [&](int64_t t0, int64_t t1) {
      std::vector<A> acc(hidden);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t j = 0; j < k; ++j) {
          const A* row = &dxs[routing.inverse[t * k + j] * hidden];
          for (int64_t c = 0; c < hidden; ++c) acc[c] += row[c];
        }
        T* dx = static_cast<T*>(p.dx.data);
        for (int64_t c = 0; c < hidden; ++c) Store(dx + t * p.dx.strides[0] + c * p.dx.strides[1], acc[c]);
      }
    });
    return Status::Ok();
  });
}

// ---- fused_moe's router ----------------------------------------------------------------------------

namespace {

// p = softmax(gating[t]) in fp32 (a row without a finite maximum gives NaN).
void SoftmaxRow(const StridedView<2>& gating, int64_t t, float* p) {
  const int64_t experts = gating.sizes[1];
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < experts; ++e) {
    p[e] = static_cast<float>(LoadAny(gating.At(t, e), gating.dtype));
    max = std::max(max, p[e]);
  }
  float sum = 0;
  for (int64_t e = 0; e < experts; ++e) {
    p[e] = std::exp(p[e] - max);
    sum += p[e];
  }
  for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
}

}  // namespace

Status MoeRouter(const MoeRouterParams& p) {
  const int64_t tokens = p.gating.sizes[0], experts = p.gating.sizes[1], k = p.k;
  if (k < 1 || k > experts) {
    return Status::Error("fused_moe: topk must be in [1, E=" + std::to_string(experts) + "], got " +
                         std::to_string(k));
  }
  Isa isa;
  Status status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  const SelectRowFn select = GetTopKKernels(isa).select_f32;
  ParallelFor(0, tokens, 64, [&](int64_t t0, int64_t t1) {
    std::vector<float> probs(experts), vals(k);
    std::vector<int32_t> idx(k);
    for (int64_t t = t0; t < t1; ++t) {
      SoftmaxRow(p.gating, t, probs.data());
      // Probabilities are >= 0, so -1 keeps every non-NaN one; ties go to the lower id.
      int64_t kept = select(probs.data(), 1, experts, k, -1.0f, vals.data(), idx.data());
      // NaN probabilities (a row without a finite score): the lowest unselected ids, NaN weight.
      for (int32_t e = 0; kept < k; ++e) {
        if (std::find(idx.begin(), idx.begin() + kept, e) != idx.begin() + kept) continue;
        idx[kept] = e;
        vals[kept++] = std::numeric_limits<float>::quiet_NaN();
      }
      float sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += vals[j];
      for (int64_t j = 0; j < k; ++j) {
        p.weights[t * k + j] = p.renormalize ? vals[j] / sum : vals[j];
        p.ids[t * k + j] = idx[j];
      }
    }
  });
  return Status::Ok();
}

// With s_j = p[id_j], S = sum_j s_j and w_j = s_j / S (renormalize) or s_j:
//   ds_j = (dw_j - sum_i dw_i w_i) / S (renormalize) or dw_j;  dp[id_j] = ds_j;
//   dgating[e] = p[e] (dp[e] - sum_j ds_j s_j).
Status MoeRouterBackward(const MoeRouterParams& p) {
  const int64_t tokens = p.gating.sizes[0], experts = p.gating.sizes[1], k = p.k;
  ParallelFor(0, tokens, 64, [&](int64_t t0, int64_t t1) {
    std::vector<float> probs(experts), dp(experts);
    for (int64_t t = t0; t < t1; ++t) {
      SoftmaxRow(p.gating, t, probs.data());
      std::fill(dp.begin(), dp.end(), 0.0f);
      float sum = 0, dot = 0;
      for (int64_t j = 0; j < k; ++j) sum += probs[p.ids[t * k + j]];
      for (int64_t j = 0; j < k; ++j) {
        const float s = probs[p.ids[t * k + j]];
        dot += p.dweights[t * k + j] * (p.renormalize ? s / sum : s);
      }
      float ds_s = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t id = p.ids[t * k + j];
        const float ds = p.renormalize ? (p.dweights[t * k + j] - dot) / sum : p.dweights[t * k + j];
        dp[id] = ds;
        ds_s += ds * probs[id];
      }
      for (int64_t e = 0; e < experts; ++e) {
        StoreAny(p.dgating.At(t, e), p.dgating.dtype, static_cast<double>(probs[e] * (dp[e] - ds_s)));
      }
    }
  });
  return Status::Ok();
}

}  // namespace tokamax
