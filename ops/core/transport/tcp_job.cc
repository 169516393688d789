#include "tcp_job.h"

#include <unistd.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

namespace kerasdist::core {
namespace {

std::mutex g_mu;
bool g_pending = false;
TcpJobSpec g_job;

Status Malformed(const std::string& what) {
  return Status::InvalidArgument(
      "the TCP transport's job description: " + what + " (kerasdist bug).");
}

// `text` as a whole number in [lo, hi].
bool ToInt(const std::string& text, int64_t lo, int64_t hi, int64_t* out) {
  if (text.empty()) return false;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (*end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

std::vector<std::string> Split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

std::string FromHex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

Status Fields(const std::string& text,
              std::map<std::string, std::string>* fields) {
  std::stringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    if (eq == std::string::npos) return Malformed("no '=' in " + line);
    (*fields)[line.substr(0, eq)] = line.substr(eq + 1);
  }
  for (const char* name : {"rank", "size", "generation", "key", "host",
                           "data_fd", "control_fd", "data", "control"}) {
    if (!fields->count(name)) return Malformed(std::string("no ") + name);
  }
  return Status::OK();
}

}  // namespace

Status ParseTcpJob(const std::string& text, TcpJobSpec* out) {
  std::map<std::string, std::string> f;
  KD_RETURN_IF_ERROR(Fields(text, &f));
  int64_t size = 0, rank = 0, gen = 0, data_fd = 0, control_fd = 0;
  if (!ToInt(f["size"], 1, 1 << 20, &size) ||
      !ToInt(f["rank"], 0, size - 1, &rank) ||
      !ToInt(f["generation"], 0, int64_t{1} << 62, &gen) ||
      !ToInt(f["data_fd"], 0, 1 << 30, &data_fd) ||
      !ToInt(f["control_fd"], 0, 1 << 30, &control_fd)) {
    return Malformed("a number out of range");
  }
  const std::string& key = f["key"];
  if (key.size() < 32 || key.size() % 2 ||
      key.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return Malformed("the key is not 16 or more bytes in hex");
  }
  TcpContextOptions& o = out->options;
  o.mesh.rank = static_cast<int>(rank);
  o.mesh.size = static_cast<int>(size);
  o.mesh.generation = static_cast<uint64_t>(gen);
  o.mesh.key = FromHex(key);
  o.mesh.addresses = Split(f["data"]);
  o.control_addresses = Split(f["control"]);
  o.host = f["host"];
  if (static_cast<int64_t>(o.mesh.addresses.size()) != size ||
      static_cast<int64_t>(o.control_addresses.size()) != size) {
    return Malformed("not one address for each of " + f["size"] + " ranks");
  }
  for (const char* name : {"connect_timeout_s", "timeout_s"}) {
    if (!f.count(name)) continue;
    int64_t s = 0;
    if (!ToInt(f[name], 1, 86400, &s)) return Malformed(name);
    (name[0] == 'c' ? o.mesh.connect_timeout_s : o.mesh.timeout_s) = s;
  }
  out->data_fd = static_cast<int>(data_fd);
  out->control_fd = static_cast<int>(control_fd);
  return Status::OK();
}

Status SetTcpJob(const std::string& text) {
  TcpJobSpec job;
  if (!text.empty()) KD_RETURN_IF_ERROR(ParseTcpJob(text, &job));
  std::lock_guard<std::mutex> l(g_mu);
  g_pending = !text.empty();
  g_job = std::move(job);
  return Status::OK();
}

bool TcpJobPending() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_pending;
}

Status FormTcpJob(std::unique_ptr<JobTransport>* out) {
  TcpJobSpec job;
  {
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_pending)
      return Status::Internal("no TCP job to form (kerasdist bug).");
    g_pending = false;
    job = std::move(g_job);
  }
  std::unique_ptr<TcpContext> ctx;
  Status s = TcpContext::Form(job.options, job.data_fd, job.control_fd, &ctx);
  close(job.data_fd);
  close(job.control_fd);
  KD_RETURN_IF_ERROR(s);
  *out = std::move(ctx);
  return Status::OK();
}

bool TcpRecoveryOn() {
  const char* v = std::getenv("KERASDIST_RECOVER_IN_PLACE");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace kerasdist::core
