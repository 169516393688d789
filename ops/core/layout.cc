#include "layout.h"

namespace kerasdist::core {

namespace {

// Bytes of one row (all dimensions but the first).
int64_t RowBytes(const Request& q) {
  std::vector<int64_t> tail(q.shape.begin() + (q.shape.empty() ? 0 : 1),
                            q.shape.end());
  return NumElements(tail) * DataTypeSize(q.dtype);
}

}  // namespace

Layout AllgatherLayout(const Response& resp, const Request& local) {
  Layout l;
  const int64_t row = RowBytes(local);
  int64_t rows = 0;
  for (int64_t d : resp.first_dims) {
    l.recv_bytes.push_back(d * row);
    rows += d;
  }
  l.out_shape = local.shape;
  l.out_shape[0] = rows;
  return l;
}

Layout AlltoallLayout(const Response& resp, const Request& local, int rank,
                      int size) {
  Layout l;
  const int64_t row = RowBytes(local);
  int64_t rows = 0;
  for (int r = 0; r < size; ++r) {
    l.send_bytes.push_back(resp.splits_matrix[rank * size + r] * row);
    const int64_t in_rows = resp.splits_matrix[r * size + rank];
    l.recv_bytes.push_back(in_rows * row);
    l.recv_splits.push_back(in_rows);
    rows += in_rows;
  }
  l.out_shape = local.shape;
  l.out_shape[0] = rows;
  return l;
}

Layout ReducescatterLayout(const Request& local, int rank, int size) {
  Layout l;
  const int64_t rows = local.shape[0];
  const int64_t per_row = NumElements(local.shape) / (rows > 0 ? rows : 1);
  for (int r = 0; r < size; ++r) {
    l.counts.push_back((rows / size + (r < rows % size ? 1 : 0)) * per_row);
  }
  l.out_shape = local.shape;
  l.out_shape[0] = rows / size + (rank < rows % size ? 1 : 0);
  return l;
}

}  // namespace kerasdist::core
