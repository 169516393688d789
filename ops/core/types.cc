#include "types.h"

namespace kerasdist::core {

int64_t DataTypeSize(DataType dt) {
  switch (dt) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16:
    case DataType::kUInt16:
      return 2;
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kUInt8:
    case DataType::kBool:
    case DataType::kInt8:
      return 1;
  }
  return 0;
}

bool IsValidDataType(int32_t v) { return v >= 0 && v < kNumDataTypes; }

bool IsValidReduceOp(int32_t v) { return v >= 0 && v <= 5; }

bool IsValidOpType(int32_t v) { return v >= 0 && v < kNumOpTypes; }

bool IsFloating(DataType dt) {
  return dt == DataType::kFloat16 || dt == DataType::kBFloat16 ||
         dt == DataType::kFloat32 || dt == DataType::kFloat64;
}

const char* DataTypeName(DataType dt) {
  switch (dt) {
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
    case DataType::kUInt8:
      return "uint8";
    case DataType::kBool:
      return "bool";
    case DataType::kInt8:
      return "int8";
    case DataType::kInt16:
      return "int16";
    case DataType::kUInt16:
      return "uint16";
  }
  return "unknown";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAverage:
      return "Average";
    case ReduceOp::kSum:
      return "Sum";
    case ReduceOp::kAdasum:
      return "Adasum";
    case ReduceOp::kMin:
      return "Min";
    case ReduceOp::kMax:
      return "Max";
    case ReduceOp::kProduct:
      return "Product";
  }
  return "unknown";
}

const char* OpPhaseName(OpType op) {
  switch (op) {
    case OpType::kAllreduce:
      return "ALLREDUCE";
    case OpType::kAllgather:
      return "ALLGATHER";
    case OpType::kBroadcast:
      return "BROADCAST";
    case OpType::kAlltoall:
      return "ALLTOALL";
    case OpType::kReducescatter:
      return "REDUCESCATTER";
    case OpType::kBarrier:
      return "BARRIER";
    case OpType::kJoin:
      return "JOIN";
  }
  return "UNKNOWN";
}

const char* OpTypeName(OpType op) {
  switch (op) {
    case OpType::kAllreduce:
      return "allreduce";
    case OpType::kAllgather:
      return "allgather";
    case OpType::kBroadcast:
      return "broadcast";
    case OpType::kAlltoall:
      return "alltoall";
    case OpType::kReducescatter:
      return "reducescatter";
    case OpType::kBarrier:
      return "barrier";
    case OpType::kJoin:
      return "join";
  }
  return "unknown";
}

// The ranges below cover every value the enums may take; the IsValid*
// functions decide which exist.
std::vector<EnumName> DataTypeNames() {
  std::vector<EnumName> out;
  for (int32_t v = 0; v < kNumDataTypes; ++v) {
    out.push_back({DataTypeName(static_cast<DataType>(v)), v});
  }
  return out;
}

std::vector<EnumName> ReduceOpNames() {
  std::vector<EnumName> out;
  for (int32_t v = 0; v <= static_cast<int32_t>(ReduceOp::kProduct); ++v) {
    if (IsValidReduceOp(v)) {
      out.push_back({ReduceOpName(static_cast<ReduceOp>(v)), v});
    }
  }
  return out;
}

std::vector<EnumName> OpTypeNames() {
  std::vector<EnumName> out;
  for (int32_t v = 0; v < kNumOpTypes; ++v) {
    out.push_back({OpTypeName(static_cast<OpType>(v)), v});
  }
  return out;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace kerasdist::core
