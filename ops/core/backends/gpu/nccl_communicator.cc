#include "nccl_communicator.h"

#include <cstring>

namespace kerasdist::core {

std::string NcclVersion() {
  int v = 0;
  ncclGetVersion(&v);
  // NCCL >= 2.9 encodes X*10000 + Y*100 + Z.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

Status NcclError(ncclResult_t r, ncclComm_t comm, const char* call,
                 const char* file, int line) {
  std::string detail = comm ? ncclGetLastError(comm) : "";
  return Status::Internal(std::string("NCCL error in ") + file + ":" +
                          std::to_string(line) + ": " + call + ": " +
                          ncclGetErrorString(r) +
                          (detail.empty() ? "" : " (" + detail + ")") +
                          " (NCCL " + NcclVersion() + ")");
}

ncclDataType_t NcclType(DataType dt) {
  switch (dt) {
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kUInt8:
    case DataType::kBool:
      return ncclUint8;
    case DataType::kInt8:
      return ncclInt8;
    case DataType::kInt16:
    case DataType::kUInt16:
      return ncclUint8;  // moved as bytes only (NcclReduces)
  }
  return ncclUint8;
}

Status NcclReduces(DataType dt) {
  if (dt == DataType::kInt16 || dt == DataType::kUInt16) {
    return Status::InvalidArgument(
        std::string("NCCL cannot reduce ") + DataTypeName(dt) +
        " tensors; reduce them in host memory or cast them to int32 first.");
  }
  return Status::OK();
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProduct:
      return ncclProd;
    default:
      return ncclSum;  // Average arrives here as Sum (see communicator.h)
  }
}

// Collective over `o.host`: rank 0 makes the unique id, which it broadcasts.
Status NcclCommunicator::Create(const DeviceBackendOptions& o,
                                cudaStream_t stream,
                                std::unique_ptr<NcclCommunicator>* out) {
  ncclComm_t comm_ = nullptr;
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  int ok = 1;
  Status s;
  if (o.rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      s = NcclError(r, nullptr, "ncclGetUniqueId", __FILE__, __LINE__);
      ok = 0;
    }
  }
  KD_RETURN_IF_ERROR(o.host->Broadcast(&ok, sizeof(ok), 0));
  if (ok) KD_RETURN_IF_ERROR(o.host->Broadcast(&id, sizeof(id), 0));
  if (!ok) {
    return o.rank == 0
               ? s
               : Status::Internal("rank 0 could not create the NCCL id.");
  }
  KD_CHECK_NCCL(ncclCommInitRank(&comm_, o.size, id, o.rank));
  out->reset(new NcclCommunicator(comm_, stream, o.rank, o.size));
  return Status::OK();
}

}  // namespace kerasdist::core
