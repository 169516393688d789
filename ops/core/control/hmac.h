// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), small and dependency
// free: the heartbeat's handshake proves the job's key with them
// (liveness.h). Checked against FIPS's and RFC 4231's test vectors
// (ops/tests/hmac_test.cc).
#ifndef KERASDIST_CORE_CONTROL_HMAC_H_
#define KERASDIST_CORE_CONTROL_HMAC_H_

#include <string>

namespace kerasdist::core {

// The 32-byte digest of `data`.
std::string Sha256(const std::string& data);
// The 32-byte HMAC-SHA256 of `data` under `key`.
std::string HmacSha256(const std::string& key, const std::string& data);
// Compares without an early exit (no timing of how many bytes matched).
bool EqualInConstantTime(const std::string& a, const std::string& b);
// `n` bytes from the kernel's random source (getrandom); "" if it failed.
std::string RandomBytes(size_t n);

}  // namespace kerasdist::core

#endif  // KERASDIST_CORE_CONTROL_HMAC_H_
