// The one strided tensor view the torch-free core and the ops take from the adapter: a data
// pointer, a dtype, N sizes and N strides in elements (0 for a broadcast dimension). The
// adapter fills it from a torch tensor as it is (no copies); kernels index it directly.
#pragma once

#include <cstdint>
#include <type_traits>

#include "csrc/core/base/dtype.h"

namespace tokamax {

// `Pointer` is const void* (read-only; the default) or void* (MutableStridedView).
template <int N, typename Pointer = const void*>
struct StridedView {
  static_assert(std::is_same_v<Pointer, const void*> || std::is_same_v<Pointer, void*>,
                "StridedView: Pointer is const void* or void*");
  static constexpr int kRank = N;

  Pointer data = nullptr;  // null: absent (an optional input)
  DType dtype = DType::kFloat32;
  int64_t sizes[N] = {};
  int64_t strides[N] = {};  // in elements

  // The element offset of index (i_0, ..., i_{N-1}).
  template <typename... Index>
  int64_t Offset(Index... index) const {
    static_assert(sizeof...(Index) == N, "StridedView::Offset: one index per dimension");
    const int64_t indices[N] = {static_cast<int64_t>(index)...};
    int64_t offset = 0;
    for (int d = 0; d < N; ++d) offset += indices[d] * strides[d];
    return offset;
  }

  // The address of element (i_0, ..., i_{N-1}).
  template <typename... Index>
  Pointer At(Index... index) const {
    using Byte = std::conditional_t<std::is_same_v<Pointer, const void*>, const char, char>;
    return static_cast<Byte*>(data) + Offset(index...) * DTypeSize(dtype);
  }

  // The same view, read-only.
  StridedView<N> AsConst() const {
    StridedView<N> view;
    view.data = data;
    view.dtype = dtype;
    for (int d = 0; d < N; ++d) {
      view.sizes[d] = sizes[d];
      view.strides[d] = strides[d];
    }
    return view;
  }
};

template <int N>
using MutableStridedView = StridedView<N, void*>;

}  // namespace tokamax
