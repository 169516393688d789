// Enumerations shared by every layer. The numeric values are part of the C API
// (kerasdist/_capi.py learns them by asking the library, through
// kerasdist_dtypes() & co, never by copying them).
#ifndef KERASDIST_CORE_TYPES_H_
#define KERASDIST_CORE_TYPES_H_

#include <cstdint>
#include <string>
#include <vector>

namespace kerasdist::core {

enum class DataType : int32_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt8 = 6,
  kBool = 7,
  kInt8 = 8,
  kInt16 = 9,
  kUInt16 = 10,
};
constexpr int kNumDataTypes = 11;

// Horovod's values, so scripts passing ints move over. Adasum combines two
// gradients a, b as (1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b, tensor by
// tensor, over a power-of-two number of ranks (backends/adasum_backend.cc).
enum class ReduceOp : int32_t {
  kAverage = 0,
  kSum = 1,
  kAdasum = 2,
  kMin = 3,
  kMax = 4,
  kProduct = 5,
};

enum class OpType : int32_t {
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kAlltoall = 3,
  kReducescatter = 4,
  kBarrier = 5,
  // This rank ran out of data: it serves the other ranks' allreduces with
  // zeros until every rank has joined (Horovod's join()).
  kJoin = 6,
};
constexpr int kNumOpTypes = 7;

// A value of one of the enums above with its name, for the C API's tables.
struct EnumName {
  const char* name;
  int32_t value;
};
// Every value with its *Name() below, in numeric order.
std::vector<EnumName> DataTypeNames();
std::vector<EnumName> ReduceOpNames();
std::vector<EnumName> OpTypeNames();

int64_t DataTypeSize(DataType dt);
bool IsValidDataType(int32_t v);
bool IsValidReduceOp(int32_t v);
bool IsValidOpType(int32_t v);
bool IsFloating(DataType dt);
const char* DataTypeName(DataType dt);
const char* ReduceOpName(ReduceOp op);
const char* OpTypeName(OpType op);
const char* OpPhaseName(OpType op);  // upper case, as in the timeline
std::string ShapeString(const std::vector<int64_t>& shape);
int64_t NumElements(const std::vector<int64_t>& shape);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_TYPES_H_
