#include "communicator_backend.h"

#include <cstring>

#include "../scale.h"

namespace kerasdist::core {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

Status CommunicatorBackend::Allreduce(CollectiveBatch& b, uint64_t) {
  const int64_t esize = DataTypeSize(b.dtype);
  if (b.tensors.size() == 1) {
    BatchTensor& t = b.tensors[0];
    if (b.prescale == 1.0) {
      // The communicator reads the input and writes the output: no copy of
      // our own.
      KD_RETURN_IF_ERROR(comm_->AllreduceFrom(t.input, t.output, t.count,
                                              b.dtype, b.reduce_op));
    } else {
      ScaleCopy(t.output, t.input, t.count, b.dtype, b.prescale);
      KD_RETURN_IF_ERROR(
          comm_->Allreduce(t.output, t.count, b.dtype, b.reduce_op));
    }
    ScaleCopy(t.output, t.output, t.count, b.dtype, b.postscale, b.divisor);
    return Status::OK();
  }
  const int64_t total = b.elements();
  char* buf = fusion_.Reserve(total * esize);
  int64_t off = 0;
  for (const BatchTensor& t : b.tensors) {
    ScaleCopy(buf + off * esize, t.input, t.count, b.dtype, b.prescale);
    off += t.count;
  }
  b.packed = Clock::now();
  KD_RETURN_IF_ERROR(comm_->Allreduce(buf, total, b.dtype, b.reduce_op));
  b.reduced = Clock::now();
  off = 0;
  for (BatchTensor& t : b.tensors) {
    ScaleCopy(t.output, buf + off * esize, t.count, b.dtype, b.postscale,
              b.divisor);
    off += t.count;
  }
  return Status::OK();
}

Status CommunicatorBackend::Allgather(CollectiveBatch& b, uint64_t) {
  const BatchTensor& t = b.tensors[0];
  return comm_->Allgatherv(t.input, t.output, b.recv_bytes);
}

Status CommunicatorBackend::Broadcast(CollectiveBatch& b, uint64_t) {
  BatchTensor& t = b.tensors[0];
  const int64_t bytes = t.count * DataTypeSize(b.dtype);
  if (rank_ == b.root_rank && t.output != t.input && bytes > 0) {
    std::memcpy(t.output, t.input, bytes);
  }
  return comm_->Broadcast(t.output, bytes, b.root_rank);
}

Status CommunicatorBackend::Alltoall(CollectiveBatch& b, uint64_t) {
  const BatchTensor& t = b.tensors[0];
  return comm_->Alltoallv(t.input, b.send_bytes, t.output, b.recv_bytes);
}

Status CommunicatorBackend::Reducescatter(CollectiveBatch& b, uint64_t) {
  BatchTensor& t = b.tensors[0];
  const void* in = t.input;
  if (b.prescale != 1.0) {
    char* tmp = fusion_.Reserve(t.count * DataTypeSize(b.dtype));
    ScaleCopy(tmp, t.input, t.count, b.dtype, b.prescale);
    in = tmp;
  }
  KD_RETURN_IF_ERROR(
      comm_->Reducescatter(in, t.output, b.counts, b.dtype, b.reduce_op));
  ScaleCopy(t.output, t.output, b.counts[rank_], b.dtype, b.postscale,
            b.divisor);
  return Status::OK();
}

Status CommunicatorBackend::Barrier(CollectiveBatch&, uint64_t) {
  return comm_->Barrier();
}

Status SelfBackend::Allreduce(CollectiveBatch& b, uint64_t) {
  for (BatchTensor& t : b.tensors) {
    ScaleCopy(t.output, t.input, t.count, b.dtype, b.prescale);
    ScaleCopy(t.output, t.output, t.count, b.dtype, b.postscale, b.divisor);
  }
  return Status::OK();
}

}  // namespace kerasdist::core
