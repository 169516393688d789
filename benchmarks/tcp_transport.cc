// The TCP transport (ops/core/transport/tcp_communicator.h) against the
// job's MPI, in one run: MPI_Allreduce and TcpCommunicator::Allreduce on
// the same float32 buffers, alternating round by round. Built and started
// by benchmarks/tcp_transport.py (see there); the mesh's addresses travel
// over MPI.
//
//   tcp_transport ADDRESS SIZES ROUNDS
//
// ADDRESS: where this rank listens ("127.0.0.1", or "auto": this host's
// first address other than loopback); SIZES: bytes, comma
// separated. Each call is timed on its own after a barrier; the figure is
// the median over the calls of the slowest rank's time. Every result is
// checked against the sum it must be.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "control/liveness.h"
#include "transport/tcp_communicator.h"

using namespace kerasdist::core;

namespace {

std::vector<int64_t> ParseSizes(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream s(text);
  std::string item;
  while (std::getline(s, item, ',')) out.push_back(std::stoll(item));
  return out;
}

std::unique_ptr<TcpCommunicator> FormMesh(std::string address) {
  // "auto": this host's first address that is not loopback (a test host's
  // link), else loopback.
  if (address == "auto") address = Liveness::Addresses("").front();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int fd = -1, port = 0;
  Status s = TcpMesh::Listen(address, &fd, &port);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  char mine[64] = {};
  std::snprintf(mine, sizeof(mine), "%s:%d", address.c_str(), port);
  std::vector<char> all(64 * size);
  MPI_Allgather(mine, 64, MPI_CHAR, all.data(), 64, MPI_CHAR, MPI_COMM_WORLD);
  TcpMeshOptions opt;
  opt.rank = rank;
  opt.size = size;
  opt.key = "benchmark";
  for (int r = 0; r < size; ++r) opt.addresses.push_back(&all[64 * r]);
  std::unique_ptr<TcpMesh> mesh;
  s = TcpMesh::Form(opt, fd, &mesh);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return std::make_unique<TcpCommunicator>(std::move(mesh));
}

int Calls(int64_t bytes) {
  return bytes <= 64 << 10   ? 100
         : bytes <= 1 << 20  ? 40
         : bytes <= 16 << 20 ? 10
                             : 4;
}

// The slowest rank's time of each of `calls` calls of `one`, appended to
// *times; the number of wrong elements seen, summed over the ranks.
template <typename F>
int64_t Time(F one, std::vector<float>& buf, int calls, int rank, int size,
             std::vector<double>* times) {
  int64_t wrong = 0;
  for (int c = 0; c < calls; ++c) {
    std::fill(buf.begin(), buf.end(), static_cast<float>(rank + 1));
    MPI_Barrier(MPI_COMM_WORLD);
    double t = MPI_Wtime();
    one();
    t = MPI_Wtime() - t;
    double slowest = 0;
    MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    times->push_back(slowest);
    const float want = size * (size + 1) / 2.0f;
    for (float v : buf) wrong += v != want;
  }
  int64_t all = 0;
  MPI_Allreduce(&wrong, &all, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return all;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (argc != 4) {
    std::fprintf(stderr, "usage: tcp_transport ADDRESS SIZES ROUNDS\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::unique_ptr<TcpCommunicator> tcp = FormMesh(argv[1]);
  const int rounds = std::atoi(argv[3]);
  if (rank == 0) {
    std::printf(
        "| size | MPI (ms) | TCP (ms) | TCP / MPI | TCP busbw (GB/s) | #wrong "
        "|\n");
    std::printf("|---|---|---|---|---|---|\n");
  }
  for (int64_t bytes : ParseSizes(argv[2])) {
    std::vector<float> buf(bytes / 4);
    const int64_t n = buf.size();
    std::vector<double> mpi_t, tcp_t;
    int64_t wrong = 0;
    for (int round = 0; round < rounds; ++round) {
      wrong += Time(
          [&] {
            MPI_Allreduce(MPI_IN_PLACE, buf.data(), n, MPI_FLOAT, MPI_SUM,
                          MPI_COMM_WORLD);
          },
          buf, Calls(bytes), rank, size, &mpi_t);
      wrong += Time(
          [&] {
            Status s = tcp->Allreduce(buf.data(), n, DataType::kFloat32,
                                      ReduceOp::kSum);
            if (!s.ok()) {
              std::fprintf(stderr, "%s\n", s.message().c_str());
              MPI_Abort(MPI_COMM_WORLD, 1);
            }
          },
          buf, Calls(bytes), rank, size, &tcp_t);
    }
    if (rank == 0) {
      const double m = Median(mpi_t), t = Median(tcp_t);
      const double busbw = bytes / t * 2.0 * (size - 1) / size / 1e9;
      std::printf("| %lld | %.3f | %.3f | %.2f | %.2f | %lld |\n",
                  static_cast<long long>(bytes), m * 1e3, t * 1e3, t / m, busbw,
                  static_cast<long long>(wrong));
      std::fflush(stdout);
    }
  }
  tcp.reset();
  MPI_Finalize();
  return 0;
}
