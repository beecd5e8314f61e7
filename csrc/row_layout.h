// Where row i of a [*, V] logits view starts, for the gather kernels of every device (plain C++,
// compiled by the host compiler and by nvcc).
//
// The leading dims are collapsed into at most two: row i = (o, r) with o = i / rows_inner and
// r = i % rows_inner starts o * outer_stride + r * row_stride elements after the data pointer,
// and the V dimension has unit stride. A [B, T, V] tensor sliced along T (logits[:, P-1:-1],
// what the full-logits path passes) is such a view and is read in place; a contiguous [N, V]
// tensor has rows_inner = N.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PYPPO_ROW_HD __host__ __device__ __forceinline__
#else
#define PYPPO_ROW_HD inline
#endif

namespace pyppo {

struct RowLayout {
  int64_t rows_inner = 1, row_stride = 0, outer_stride = 0;
};

PYPPO_ROW_HD int64_t row_offset(const RowLayout& l, int64_t i) {
  return (i / l.rows_inner) * l.outer_stride + (i % l.rows_inner) * l.row_stride;
}

}  // namespace pyppo
