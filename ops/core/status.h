// Errors are values: every fallible call returns a Status, and failures reach
// the TF op (or the C API handle) through its completion callback.
#ifndef KERASDIST_CORE_STATUS_H_
#define KERASDIST_CORE_STATUS_H_

#include <string>
#include <utility>

namespace kerasdist::core {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad input from this rank
  kPrecondition = 2,     // e.g. not initialized, already shut down
  kMismatch = 3,         // ranks disagree about a tensor
  kAborted = 4,          // shut down / another rank went away / stall timeout
  kInternal = 5,         // MPI/NCCL failure
  // A rank of the job was lost and the survivors re-form without it
  // (recovery in place, transport/mpi_context.h): kerasdist.RanksLostError.
  kRanksLost = 6,
};

// [[nodiscard]]: a Status dropped on the floor is a bug the compiler reports.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(std::move(message)) {}
  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) {
    return Status(StatusCode::kInvalidArgument, std::move(m));
  }
  static Status Precondition(std::string m) {
    return Status(StatusCode::kPrecondition, std::move(m));
  }
  static Status Mismatch(std::string m) {
    return Status(StatusCode::kMismatch, std::move(m));
  }
  static Status Aborted(std::string m) {
    return Status(StatusCode::kAborted, std::move(m));
  }
  static Status Internal(std::string m) {
    return Status(StatusCode::kInternal, std::move(m));
  }
  static Status RanksLost(std::string m) {
    return Status(StatusCode::kRanksLost, std::move(m));
  }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

#define KD_RETURN_IF_ERROR(expr)           \
  do {                                     \
    ::kerasdist::core::Status _s = (expr); \
    if (!_s.ok()) return _s;               \
  } while (0)

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_STATUS_H_
