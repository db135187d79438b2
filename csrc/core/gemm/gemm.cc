// The GEMM driver: cache blocking and the loops around the per-ISA micro-kernels.
#include "csrc/core/gemm/gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <cstring>

#include "csrc/core/base/int_math.h"
#include "csrc/core/runtime/scratch_arena.h"
#include "csrc/core/vec/tiers.h"

namespace tokamax {

TOKAMAX_DECLARE_IN_TIERS(const GemmKernels& GemmKernelTable(FmaBroadcastForm form);)

namespace {

// The avx512 table of `form` with `kIsa`'s bf16 product engine (both forms built once).
template <Isa kIsa>
[[maybe_unused]] const GemmKernels& WithBf16Products(FmaBroadcastForm form) {
  const auto build = [](FmaBroadcastForm f) {
    GemmKernels table = tier_avx512::GemmKernelTable(f);
    table.bf16 = GetBf16Products(kIsa);
    return table;
  };
  static const GemmKernels embedded = build(FmaBroadcastForm::kEmbedded);
  static const GemmKernels registers = build(FmaBroadcastForm::kRegister);
  return form == FmaBroadcastForm::kRegister ? registers : embedded;
}

}  // namespace

StreamingBlocking InPlaceBlocking(int64_t rows, DType dtype, const CpuInfo& cpu) {
  const bool bf16_engine = dtype == DType::kBFloat16 && cpu.avx512bf16;
  if (rows <= 2 * kGemmMr) {
    // A few rows (decode): 1024-wide blocks and 32-deep slices, so a panel's walk down B is short
    // and the next panels' lines of the same rows, asked for ahead, are still in L1 when read
    // (M=64 K=2048 N=1024, 16 groups of 4: 2.0x faster than 256-deep slices). Zen 4 measured
    // 256-deep faster for bf16 (1.09-1.19x on four tiny-group shapes; before the micro-kernel's
    // prefetch down the panel, f09ff4f); Zen 5 measures 32 faster for bf16 too
    // (amd_zen5_avx512bf16, 2 threads: ragged_dot 16 groups of 4 1.84 -> 1.57 ms,
    // gated_linear_unit M=1-4 K=2048 N=5632 1.84-1.88 -> 1.03 ms with 1024-wide blocks).
    const bool zen4_dot_engine = bf16_engine && !(cpu.amx_tile && cpu.amx_bf16) && cpu.vendor == "amd" &&
                                 cpu.family < 0x1a;
    return {zen4_dot_engine ? 256 : 32, 1024};
  }
  // On Intel (Sapphire Rapids class, intel_model167_amx) 13-95 rows stream B best in 64-deep
  // slices: 128 rows of B in flight per panel overrun the prefetchers there (ragged_dot fp32
  // forward, 2 threads: 128 Zipf-sized groups 34.7 -> 28.6 ms, 256 groups 59.0 -> 43.0 ms, 64
  // equal groups unchanged; issue 22). Zen 4 keeps the 128 it was measured with, and so does
  // bf16 where a bf16 engine runs it (AMX: 64 measured 2% slower, 128 Zipf groups).
  return {cpu.vendor == "intel" && !bf16_engine ? 64 : 128, 512};
}

FmaBroadcastForm PreferredFmaBroadcastForm(const CpuInfo& cpu) {
  // Zen 4 (family 0x19) runs 512-bit FMAs on 256-bit halves, and its front end limits the longer
  // kRegister form; Zen 5 (0x1a) has full-width FMAs, and there the 14-load form wins like on
  // Intel (amd_zen5_avx512bf16, 2 threads, alternating processes: ragged_dot fp32 M=8192 K=1024
  // N=1024 8 groups forward 42-49 -> 38-44 ms, 79-81% -> 87-89% of the FMA peak; causal attention
  // fp32 T=2048 forward 54-57 -> 49-53 ms; gated_linear_unit fp32 M=1024 forward 126-144 ->
  // 114-122 ms; 4-row in-place tiles within noise).
  const bool full_width_amd = cpu.vendor == "amd" && cpu.family >= 0x1a;
  return cpu.vendor == "intel" || full_width_amd ? FmaBroadcastForm::kRegister : FmaBroadcastForm::kEmbedded;
}

const GemmKernels& GetGemmKernels(Isa isa) {
  static const FmaBroadcastForm preferred = PreferredFmaBroadcastForm(GetCpuInfo());
  return GetGemmKernels(isa, preferred);
}

// A tier this build lacks (IsaBuilt) gets the scalar table.
const GemmKernels& GetGemmKernels(Isa isa, FmaBroadcastForm form) {
  switch (isa) {
#ifdef TOKAMAX_HAVE_AMX
    case Isa::kAmx: return WithBf16Products<Isa::kAmx>(form);
#endif
#ifdef TOKAMAX_HAVE_AVX512BF16
    case Isa::kAvx512Bf16: return WithBf16Products<Isa::kAvx512Bf16>(form);
#endif
#ifdef TOKAMAX_HAVE_AVX512
    case Isa::kAvx512: return tier_avx512::GemmKernelTable(form);
#endif
#ifdef TOKAMAX_HAVE_AVX2
    case Isa::kAvx2: return tier_avx2::GemmKernelTable(form);
#endif
    default: break;
  }
  return tier_scalar::GemmKernelTable(form);
}

namespace {

// GemmRegion's slots of its ScratchLease: packed A/B panels and the tile accumulator (fp32),
// the bf16 engines' operands.
enum GemmScratchSlot : int { kAPack, kBPack, kBTail, kAcc, kABf16, kBVnni, kRowsBf16, kVnniBlock, kARows };

// Runs the micro-kernel on B read in place at element (k0, col), of B's own dtype.
void MicroInPlace(const GemmKernels& kernels, const ConstMatrix& b, int64_t rows, int64_t depth, const float* a,
                  int64_t k0, int64_t col, float* c, int64_t ldc, bool accumulate) {
  const int64_t offset = k0 * b.row_stride + col;
  switch (b.dtype) {
    case DType::kFloat32:
      kernels.micro_f32(rows, depth, a, kernels.mr, static_cast<const float*>(b.data) + offset, b.row_stride, c, ldc,
                        accumulate);
      return;
    case DType::kBFloat16:
      kernels.micro_bf16(rows, depth, a, kernels.mr, static_cast<const uint16_t*>(b.data) + offset, b.row_stride, c,
                         ldc, accumulate);
      return;
    case DType::kFloat16:
      kernels.micro_f16(rows, depth, a, kernels.mr, static_cast<const uint16_t*>(b.data) + offset, b.row_stride, c,
                        ldc, accumulate);
      return;
    case DType::kFloat64:  // never here: GemmRegion sends float64 to GemmRegionFloat64
      return;
  }
}

// A GemmEpilogue's elementwise part in double (the float64 path).
double Epilogue(const GemmEpilogue& e, double x, int64_t col) {
  x = e.scale * x;
  if (e.bias != nullptr) x += e.bias[col];  // not x + 0.0, which would turn -0.0 into +0.0
  return Activate(e.activation, x);
}

// m(row, col) = x, in m's dtype (the float64 path's optional pre-activation outputs).
void StoreDouble(const MutableMatrix& m, int64_t row, int64_t col, double x) {
  const int64_t offset = row * m.row_stride + col * m.col_stride;
  if (m.dtype == DType::kFloat64) {
    static_cast<double*>(m.data)[offset] = x;
    return;
  }
  DispatchDType(m.dtype, [&](auto tag) {
    using T = decltype(tag);
    StoreFromFloat(static_cast<T*>(m.data) + offset, static_cast<float>(x));
    return 0;
  });
}

// float64 (A, B and C): exact double-precision loops, for gradcheck and oracles.
void GemmRegionFloat64(const ConstMatrix& a, const ConstMatrix& b, const MutableMatrix& c, int64_t m0,
                       int64_t m1, int64_t n0, int64_t n1, const GemmEpilogue& epilogue,
                       const GemmPrologue& prologue) {
  const double* a_data = static_cast<const double*>(a.data);
  const double* b_data = static_cast<const double*>(b.data);
  double* c_data = static_cast<double*>(c.data);
  const GemmGate* gate = epilogue.gate;
  const double* up_data = gate != nullptr ? static_cast<const double*>(gate->up.data) : nullptr;
  for (int64_t i = m0; i < m1; ++i) {
    const int64_t a_row = prologue.a_row_map != nullptr ? prologue.a_row_map[i] : i;
    const int64_t c_row = epilogue.row_map != nullptr ? epilogue.row_map[i] : i;
    for (int64_t j = n0; j < n1; ++j) {
      double sum = 0.0, up_sum = 0.0;
      for (int64_t p = 0; p < a.cols; ++p) {
        const double x = a_data[a_row * a.row_stride + p * a.col_stride];
        sum += x * b_data[p * b.row_stride + j * b.col_stride];
        if (gate != nullptr) up_sum += x * up_data[p * gate->up.row_stride + j * gate->up.col_stride];
      }
      double* dst = c_data + c_row * c.row_stride + j * c.col_stride;
      if (epilogue.accumulate) sum += *dst;
      if (gate == nullptr) {
        *dst = Epilogue(epilogue, sum, j);
        continue;
      }
      double gate_x = epilogue.scale * sum, up_x = epilogue.scale * up_sum;
      if (epilogue.bias != nullptr) gate_x += epilogue.bias[j];
      if (gate->up_bias != nullptr) up_x += gate->up_bias[j];
      if (gate->gate_out.data != nullptr) StoreDouble(gate->gate_out, c_row, j, gate_x);
      if (gate->up_out.data != nullptr) StoreDouble(gate->up_out, c_row, j, up_x);
      *dst = Activate(epilogue.activation, gate_x) * up_x;
    }
    if (epilogue.row_max != nullptr) {
      float* max = epilogue.row_max + i;
      float* row_sum = epilogue.row_sum + i;
      double block_max = -std::numeric_limits<double>::infinity();
      const double* row = c_data + c_row * c.row_stride;
      for (int64_t j = n0; j < n1; ++j) block_max = std::max(block_max, row[j * c.col_stride]);
      const double new_max = std::max<double>(*max, block_max);
      if (new_max == -std::numeric_limits<double>::infinity()) continue;
      double total = *max == new_max ? *row_sum : *row_sum * std::exp(*max - new_max);
      for (int64_t j = n0; j < n1; ++j) total += std::exp(row[j * c.col_stride] - new_max);
      *max = static_cast<float>(new_max);
      *row_sum = static_cast<float>(total);
    }
  }
}

// The packed B columns of one block of a gated product (GemmGate): panel q of `nr` columns is
// columns jc + (q / 2) * nr.. of B (q even, the gate) or of up (q odd), `cols` (<= nr) of them,
// the last pair short where the block's out_cols end. A gated block of out_cols results packs
// GatedPanels(out_cols, nr) panels.
struct GatedPanel {
  const ConstMatrix* b;
  int64_t col;
  int64_t cols;
};

int64_t GatedPanels(int64_t out_cols, int64_t nr) { return 2 * CeilDiv(out_cols, nr); }

GatedPanel GatedPanelOf(const ConstMatrix& b, const GemmGate& gate, int64_t jc, int64_t out_cols, int64_t nr,
                        int64_t q) {
  const int64_t first = (q / 2) * nr;
  return {q % 2 == 0 ? &b : &gate.up, jc + first, std::min(nr, out_cols - first)};
}

// A(row(row0 + i), k0 + p) for i < rows, p < depth as row-major bf16 [rows rounded up to 16][ld
// = depth rounded up to 32], zero-padded: the A operand of a Bf16GemmFn. row(x) is row_map[x]
// (GemmPrologue's gather), or x for a null map.
void PackABf16(const ConstMatrix& a, int64_t row0, int64_t rows, int64_t k0, int64_t depth, const int64_t* row_map,
               uint16_t* dst, int64_t ld) {
  // Zeros in the padding only: the rows past `rows` and each row's columns past `depth`.
  if (depth < ld) {
    for (int64_t i = 0; i < rows; ++i) std::fill(dst + i * ld + depth, dst + (i + 1) * ld, uint16_t{0});
  }
  std::fill(dst + rows * ld, dst + RoundUp(rows, kBf16TileRows) * ld, uint16_t{0});
  const uint16_t* origin = static_cast<const uint16_t*>(a.data) + k0 * a.col_stride;
  if (row_map == nullptr) {
    CopyBf16(origin + row0 * a.row_stride, a.row_stride, a.col_stride, rows, depth, /*transpose=*/false, dst, ld);
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    CopyBf16(origin + row_map[row0 + i] * a.row_stride, a.row_stride, a.col_stride, 1, depth, /*transpose=*/false,
             dst + i * ld, ld);
  }
}

// B(k0 + p, col0 + j) for p < depth, j < cols in the VNNI panels of bf16_gemm.h, `padded_depth`
// deep (a multiple of 32) and cols rounded up to 16 wide, zero-padded.
void PackBVnni(const ConstMatrix& b, int64_t k0, int64_t depth, int64_t padded_depth, int64_t col0, int64_t cols,
               uint16_t* dst, ScratchLease& scratch) {
  const uint16_t* origin = static_cast<const uint16_t*>(b.data) + k0 * b.row_stride + col0 * b.col_stride;
  const int64_t padded_cols = RoundUp(cols, kBf16TileRows);
  auto row = [&](int64_t p) { return p < depth ? origin + p * b.row_stride : nullptr; };
  if (b.col_stride == 1 && cols == padded_cols) {  // straight from B's rows
    // Panel by panel from B's rows: each panel one sequential stream of stores (ragged_dot bf16,
    // 64 groups: 14.7 -> 13.8 ms against pair-by-pair packing, amd_zen4_avx512bf16).
    PackVnniFromBf16Rows(origin, b.row_stride, depth, padded_depth, cols, dst);
    return;
  }
  if (b.col_stride == 1) {  // the same through a padded copy of each pair (a last partial panel)
    uint16_t* rows = scratch.Get<uint16_t>(kRowsBf16, 2 * padded_cols);
    std::fill(rows, rows + 2 * padded_cols, uint16_t{0});
    for (int64_t p = 0; p < padded_depth; p += 2) {
      for (int64_t r = 0; r < 2; ++r) {
        if (p + r < depth) std::memcpy(rows + r * padded_cols, row(p + r), cols * sizeof(uint16_t));
        else std::fill(rows + r * padded_cols, rows + (r + 1) * padded_cols, uint16_t{0});
      }
      PackVnniPair(rows, rows + padded_cols, p, padded_depth, padded_cols, dst);
    }
    return;
  }
  // Columns contiguous along the depth (B a transposed view) or any strides: B's columns, 16 at
  // a time, as the vectors of one panel.
  uint16_t* block = scratch.Get<uint16_t>(kVnniBlock, kBf16TileRows * padded_depth);
  for (int64_t q = 0; q * kBf16TileRows < padded_cols; ++q) {
    const uint16_t* columns[kBf16TileRows] = {};
    for (int64_t j = 0; j < kBf16TileRows; ++j) {
      const int64_t col = q * kBf16TileRows + j;
      if (col < cols) columns[j] = origin + col * b.col_stride;
    }
    PackVnniFromBf16Vectors(columns, b.row_stride, depth, padded_depth, dst + q * padded_depth * kBf16TileRows,
                            block);
  }
}

// GemmRegion on the tier's bf16 product engine for bf16 A and B: the same loops (block_n columns, block_k deep
// slices, block_m rows), bf16 operands instead of fp32 panels, fp32 accumulation in the tile
// buffer, written into C by the tier's store_c.
void GemmRegionBf16(const GemmKernels& kernels, const ConstMatrix& a, const ConstMatrix& b, const MutableMatrix& c,
                    int64_t m0, int64_t m1, int64_t n0, int64_t n1, const GemmBlocking& blocking,
                    const GemmEpilogue& epilogue, const GemmPrologue& prologue, ScratchLease& scratch) {
  const Bf16ProductScope scope(kernels.bf16);
  const int64_t depth_total = a.cols;
  const int64_t rows = m1 - m0;
  const int64_t rows_padded = RoundUp(rows, kBf16TileRows);
  const int64_t block_m = RoundUp(blocking.block_m, kBf16TileRows);
  const int64_t block_k = RoundUp(blocking.block_k, kBf16TileDepth);
  const GemmGate* gate = epilogue.gate;
  const int64_t nr = kernels.nr;  // a gated block's column groups: the store's (GemmKernels::store_c)
  for (int64_t jc = n0; jc < n1; jc += blocking.block_n) {
    const int64_t out_cols = std::min(blocking.block_n, n1 - jc);
    const int64_t cols = gate != nullptr ? GatedPanels(out_cols, nr) * nr : out_cols;  // packed columns
    const int64_t cols_padded = RoundUp(cols, kBf16TileRows);
    float* acc = scratch.Get<float>(kAcc, rows_padded * cols_padded);
    if (depth_total == 0) std::memset(acc, 0, sizeof(float) * rows_padded * cols_padded);
    for (int64_t pc = 0; pc < depth_total; pc += block_k) {
      const int64_t depth = std::min(block_k, depth_total - pc);
      const int64_t padded_depth = RoundUp(depth, kBf16TileDepth);
      uint16_t* b_vnni = scratch.Get<uint16_t>(kBVnni, padded_depth * cols_padded);
      if (gate == nullptr) {
        PackBVnni(b, pc, depth, padded_depth, jc, cols, b_vnni, scratch);
      } else {
        for (int64_t q = 0; q < GatedPanels(out_cols, nr); ++q) {
          const GatedPanel panel = GatedPanelOf(b, *gate, jc, out_cols, nr, q);
          uint16_t* dst = b_vnni + q * padded_depth * nr;
          PackBVnni(*panel.b, pc, depth, padded_depth, panel.col, panel.cols, dst, scratch);
          const int64_t written = RoundUp(panel.cols, kBf16TileRows) * padded_depth;
          std::fill(dst + written, dst + nr * padded_depth, uint16_t{0});
        }
      }
      for (int64_t ic = m0; ic < m1; ic += block_m) {
        const int64_t block_rows = std::min(block_m, m1 - ic);
        const int64_t tile_rows = RoundUp(block_rows, kBf16TileRows);
        uint16_t* a_bf16 = scratch.Get<uint16_t>(kABf16, tile_rows * padded_depth);
        PackABf16(a, ic, block_rows, pc, depth, prologue.a_row_map, a_bf16, padded_depth);
        kernels.bf16.gemm(tile_rows, cols_padded, padded_depth, a_bf16, padded_depth, b_vnni,
                    acc + (ic - m0) * cols_padded, cols_padded, pc > 0, 1.0f);
      }
    }
    kernels.store_c(acc, cols_padded, rows, out_cols, c, m0, jc, epilogue);
  }
}

// B's columns contiguous along the depth (a transposed view), where rows are not.
bool ColumnsAlongDepth(const ConstMatrix& m) { return m.row_stride == 1 && m.col_stride != 1; }

// The column-dot form (kGemmDotMaxRows): A's rows copied once (bf16 for the bf16 engine's
// column dots where A, B and up are all bf16; else widened to fp32), then every result of a
// block_n-wide block one dot product of an A row with a B column read in place, into the tile
// buffer the tier's store takes (a gated block: the gate's and up's nr-wide groups alternating).
void GemmRegionDot(const GemmKernels& kernels, const ConstMatrix& a, const ConstMatrix& b, const MutableMatrix& c,
                   int64_t m0, int64_t m1, int64_t n0, int64_t n1, const GemmBlocking& blocking,
                   const GemmEpilogue& epilogue, const GemmPrologue& prologue, ScratchLease& scratch) {
  const int64_t rows = m1 - m0, depth = a.cols, nr = kernels.nr;
  const GemmGate* gate = epilogue.gate;
  const bool bf16_dots = kernels.bf16.column_dots != nullptr && a.dtype == DType::kBFloat16 &&
                         b.dtype == DType::kBFloat16 && (gate == nullptr || gate->up.dtype == DType::kBFloat16);
  const int64_t lda = RoundUp(std::max<int64_t>(depth, 1), kBf16TileDepth);
  float* a_rows = nullptr;
  uint16_t* a_bf16 = nullptr;
  if (bf16_dots) {
    a_bf16 = scratch.Get<uint16_t>(kABf16, RoundUp(rows, kBf16TileRows) * lda);
    PackABf16(a, m0, rows, 0, depth, prologue.a_row_map, a_bf16, lda);
  } else {
    a_rows = scratch.Get<float>(kARows, rows * lda);
    kernels.widen_rows(a, m0, rows, prologue.a_row_map, a_rows, lda);
  }
  auto dot = [&](const ConstMatrix& m, int64_t col, int64_t cols, float* out, int64_t ld) {
    switch (m.dtype) {
      case DType::kFloat32:
        kernels.dot_f32(rows, cols, depth, a_rows, lda, static_cast<const float*>(m.data) + col * m.col_stride,
                        m.col_stride, out, ld);
        return;
      case DType::kBFloat16:
        if (bf16_dots) {
          kernels.bf16.column_dots(rows, cols, depth, a_bf16, lda,
                                   static_cast<const uint16_t*>(m.data) + col * m.col_stride, m.col_stride, out, ld);
        } else {
          kernels.dot_bf16(rows, cols, depth, a_rows, lda, static_cast<const uint16_t*>(m.data) + col * m.col_stride,
                           m.col_stride, out, ld);
        }
        return;
      case DType::kFloat16:
        kernels.dot_f16(rows, cols, depth, a_rows, lda, static_cast<const uint16_t*>(m.data) + col * m.col_stride,
                        m.col_stride, out, ld);
        return;
      case DType::kFloat64:  // never here: GemmRegion sends float64 to GemmRegionFloat64
        return;
    }
  };
  for (int64_t jc = n0; jc < n1; jc += blocking.block_n) {
    const int64_t out_cols = std::min(blocking.block_n, n1 - jc);
    const int64_t cols = gate != nullptr ? GatedPanels(out_cols, nr) * nr : out_cols;
    const int64_t ld = RoundUp(cols, nr);
    float* acc = scratch.Get<float>(kAcc, rows * ld);
    if (gate == nullptr) {
      dot(b, jc, out_cols, acc, ld);
    } else {
      // The short last pair's columns past out_cols are never read by the store; zeroed anyway.
      std::fill(acc, acc + rows * ld, 0.0f);
      for (int64_t q = 0; q < GatedPanels(out_cols, nr); ++q) {
        const GatedPanel panel = GatedPanelOf(b, *gate, jc, out_cols, nr, q);
        dot(*panel.b, panel.col, panel.cols, acc + q * nr, ld);
      }
    }
    kernels.store_c(acc, ld, rows, out_cols, c, m0, jc, epilogue);
  }
}

}  // namespace

void GemmRegion(const GemmKernels& kernels, const ConstMatrix& a, const ConstMatrix& b,
                const MutableMatrix& c, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                const GemmBlocking& blocking, const GemmEpilogue& epilogue, const GemmPrologue& prologue) {
  if (m1 <= m0 || n1 <= n0) return;
  if (a.dtype == DType::kFloat64) {
    GemmRegionFloat64(a, b, c, m0, m1, n0, n1, epilogue, prologue);
    return;
  }
  // The bf16 engine needs B packed into VNNI panels and pads the rows to whole 16-row tiles.
  // Where the blocking would read B in place and the region is shorter than one tile, the
  // packing and the padding cost more than the dot engine saves, so B is widened in place by
  // the fp32 micro-kernels. Measured on Zen 4, ragged_dot bf16 forward: groups of 4 rows over
  // 64 MiB of weights 5.4 ms widened in place against 8.8 ms on the engine; groups of 64 rows
  // 15 ms on the engine against 27-31 ms widened. The tile unit takes them in slices of 128 or
  // more deep: its padded rows cost next to nothing, and the VNNI packing (a shuffle per 64
  // bytes, bound by reading B) is cheaper than widening B into 12-row fp32 FMAs
  // (intel_model167_amx, ragged_dot bf16 128 Zipf groups, 2 threads: 11.6-12.3 -> 9.3-10.3
  // ms). Shallower slices (the 32 deep of 4-8-row groups) lost on the engine: its C tiles are
  // reloaded per slice (16 groups of 4 rows, K=2048: 3.0 -> 3.3 ms; issue 22).
  const GemmGate* gate = epilogue.gate;
  const bool b_read_in_place = !blocking.pack_b && b.col_stride == 1 && (gate == nullptr || gate->up.col_stride == 1);
  const bool tile_unit_takes_few = kernels.bf16.tile_unit && blocking.block_k >= 128;
  const bool few_rows_in_place = b_read_in_place && m1 - m0 < kBf16TileRows && !tile_unit_takes_few;
  // Once per region: the lease's two mutex round trips are nothing beside the region's tiles.
  ScratchLease scratch;
  if (!blocking.pack_b && m1 - m0 <= kGemmDotMaxRows && ColumnsAlongDepth(b) &&
      (gate == nullptr || ColumnsAlongDepth(gate->up))) {
    GemmRegionDot(kernels, a, b, c, m0, m1, n0, n1, blocking, epilogue, prologue, scratch);
    return;
  }
  if (kernels.bf16 && a.dtype == DType::kBFloat16 && b.dtype == DType::kBFloat16 &&
      (gate == nullptr || gate->up.dtype == DType::kBFloat16) && !few_rows_in_place) {
    GemmRegionBf16(kernels, a, b, c, m0, m1, n0, n1, blocking, epilogue, prologue, scratch);
    return;
  }
  const int64_t mr = kernels.mr;
  const int64_t nr = kernels.nr;
  const int64_t depth_total = a.cols;
  const int64_t rows = m1 - m0;
  const int64_t rows_padded = RoundUp(rows, mr);
  // A tier whose tile is taller than block_m's granularity rounds block_m up to whole tiles,
  // so micro-kernel tiles never straddle two row blocks.
  const int64_t block_m = RoundUp(blocking.block_m, mr);
  const int64_t block_k = blocking.block_k;
  // Reading B in place needs contiguous columns.
  const bool in_place_b = b_read_in_place;

  for (int64_t jc = n0; jc < n1; jc += blocking.block_n) {
    const int64_t out_cols = std::min(blocking.block_n, n1 - jc);
    // Packed columns: a gated block has its gate's and up's panels interleaved (GatedPanelOf).
    const int64_t cols = gate != nullptr ? GatedPanels(out_cols, nr) * nr : out_cols;
    const int64_t cols_padded = RoundUp(cols, nr);
    // Panels B has whole in place; a gated block's short last pair is packed.
    const int64_t full_panels = gate != nullptr ? 2 * (out_cols / nr) : cols / nr;
    float* acc = scratch.Get<float>(kAcc, rows_padded * cols_padded);
    if (depth_total == 0) std::memset(acc, 0, sizeof(float) * rows_padded * cols_padded);

    for (int64_t pc = 0; pc < depth_total; pc += block_k) {
      const int64_t depth = std::min(block_k, depth_total - pc);
      const bool accumulate = pc > 0;
      float* b_pack = nullptr;
      float* b_tail = nullptr;
      if (!in_place_b) {
        b_pack = scratch.Get<float>(kBPack, depth * cols_padded);
        if (gate == nullptr) {
          kernels.pack_b(b, pc, depth, jc, cols, b_pack);
        } else {
          for (int64_t q = 0; q < GatedPanels(out_cols, nr); ++q) {
            const GatedPanel panel = GatedPanelOf(b, *gate, jc, out_cols, nr, q);
            kernels.pack_b(*panel.b, pc, depth, panel.col, panel.cols, b_pack + q * depth * nr);
          }
        }
      } else if (cols > full_panels * nr) {
        // The last, partial panel is packed so the micro-kernel never reads past B's columns
        // (a gated block: the last pair, gate then up).
        b_tail = scratch.Get<float>(kBTail, (gate != nullptr ? 2 : 1) * depth * nr);
        if (gate == nullptr) {
          kernels.pack_b(b, pc, depth, jc + full_panels * nr, cols - full_panels * nr, b_tail);
        } else {
          for (int64_t q = full_panels; q < full_panels + 2; ++q) {
            const GatedPanel panel = GatedPanelOf(b, *gate, jc, out_cols, nr, q);
            kernels.pack_b(*panel.b, pc, depth, panel.col, panel.cols, b_tail + (q - full_panels) * depth * nr);
          }
        }
      }

      for (int64_t ic = m0; ic < m1; ic += block_m) {
        const int64_t block_rows = std::min(block_m, m1 - ic);
        float* a_pack = scratch.Get<float>(kAPack, RoundUp(block_rows, mr) * depth);
        kernels.pack_a(a, ic, block_rows, pc, depth, prologue.a_row_map, a_pack);
        float* acc_block = acc + (ic - m0) * cols_padded;
        // A few-row block on an fp32 B read in place: its whole panels in wide runs of B's rows
        // (the same bits), so the loop below has only the packed tail panel left.
        int64_t first_panel = 0;
        if (in_place_b && block_rows <= kGemmWideRows && kernels.wide_f32 != nullptr && full_panels > 0 &&
            b.dtype == DType::kFloat32 && (gate == nullptr || gate->up.dtype == DType::kFloat32)) {
          const float* b_block = static_cast<const float*>(b.data) + pc * b.row_stride + jc;
          if (gate == nullptr) {
            kernels.wide_f32(block_rows, full_panels * nr, depth, a_pack, mr, b_block, b.row_stride, acc_block,
                             cols_padded, nr, accumulate);
          } else {  // the gate's groups at even panels, up's at odd ones
            const float* up_block = static_cast<const float*>(gate->up.data) + pc * gate->up.row_stride + jc;
            kernels.wide_f32(block_rows, full_panels / 2 * nr, depth, a_pack, mr, b_block, b.row_stride, acc_block,
                             cols_padded, 2 * nr, accumulate);
            kernels.wide_f32(block_rows, full_panels / 2 * nr, depth, a_pack, mr, up_block, gate->up.row_stride,
                             acc_block + nr, cols_padded, 2 * nr, accumulate);
          }
          first_panel = full_panels;
        }

        for (int64_t jr = first_panel * nr; jr < cols; jr += nr) {
          const int64_t panel = jr / nr;
          for (int64_t ir = 0; ir < block_rows; ir += mr) {
            const float* a_panel = a_pack + ir * depth;
            const int64_t tile_rows = std::min(mr, block_rows - ir);
            float* c_tile = acc_block + ir * cols_padded + jr;
            if (!in_place_b) {
              kernels.micro_f32(tile_rows, depth, a_panel, mr, b_pack + panel * depth * nr, nr, c_tile,
                                cols_padded, accumulate);
            } else if (panel < full_panels && gate == nullptr) {
              MicroInPlace(kernels, b, tile_rows, depth, a_panel, pc, jc + jr, c_tile, cols_padded, accumulate);
            } else if (panel < full_panels) {
              const GatedPanel source = GatedPanelOf(b, *gate, jc, out_cols, nr, panel);
              MicroInPlace(kernels, *source.b, tile_rows, depth, a_panel, pc, source.col, c_tile, cols_padded, accumulate);
            } else {
              kernels.micro_f32(tile_rows, depth, a_panel, mr, b_tail + (panel - full_panels) * depth * nr, nr, c_tile,
                                cols_padded, accumulate);
            }
          }
        }
      }
    }
    kernels.store_c(acc, cols_padded, rows, out_cols, c, m0, jc, epilogue);
  }
}

void ReferenceGemm(const ConstMatrix& a, const ConstMatrix& b, const MutableMatrix& c) {
  auto load = [](const ConstMatrix& m, int64_t i, int64_t j) -> double {
    const int64_t offset = i * m.row_stride + j * m.col_stride;
    if (m.dtype == DType::kFloat64) return static_cast<const double*>(m.data)[offset];  // exact
    return DispatchDType(m.dtype, [&](auto tag) -> double {
      using T = decltype(tag);
      return LoadAsFloat(static_cast<const T*>(m.data) + offset);
    });
  };
  for (int64_t i = 0; i < c.rows; ++i) {
    for (int64_t j = 0; j < c.cols; ++j) {
      double sum = 0.0;
      for (int64_t p = 0; p < a.cols; ++p) sum += load(a, i, p) * load(b, p, j);
      const int64_t offset = i * c.row_stride + j * c.col_stride;
      if (c.dtype == DType::kFloat64) {
        static_cast<double*>(c.data)[offset] = sum;
        continue;
      }
      DispatchDType(c.dtype, [&](auto tag) {
        using T = decltype(tag);
        StoreFromFloat(static_cast<T*>(c.data) + offset, static_cast<float>(sum));
        return 0;
      });
    }
  }
}

}  // namespace tokamax
