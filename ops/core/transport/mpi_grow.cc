// Growing in place (mpi_context.h; docs/failures-and-elastic.md, "Growing
// in place"): with recovery in place on (Open MPI 5's ULFM), the job's
// ranks start the new ones themselves (MPI_Comm_spawn_multiple, which
// Open MPI's mpirun places on the hosts named) and merge the
// intercommunicator into the job's communicator; the new processes' kd.init()
// merges with the job that started them. The next kd.init() of every rank
// starts from the merged communicator, as after a shrink. Shrinking in
// place (ShrinkJob) is the other way round, and cooperative: the ranks
// that leave and those that stay split the job's communicator
// (MPI_Comm_split, MPI_UNDEFINED for the leavers), and the next kd.init() of
// those that stay starts from theirs. Built against an MPI without ULFM it
// is only the error that says it cannot be had.
#include <cstdlib>
#include <string>
#include <vector>

#include "mpi_context.h"

namespace kerasdist::core {

namespace {

// Set for every process GrowJob starts: its rank in the grown job.
constexpr char kGrownVariable[] = "KERASDIST_GROWN_RANK";
int g_grows = 0;
int g_shrinks = 0;
bool g_left = false;

#ifdef KERASDIST_ULFM
// "key=value" lines into `info`.
void SetInfo(MPI_Info info, const std::string& lines) {
  size_t at = 0;
  while (at < lines.size()) {
    size_t end = lines.find('\n', at);
    if (end == std::string::npos) end = lines.size();
    const std::string line = lines.substr(at, end - at);
    const size_t eq = line.find('=');
    if (eq != std::string::npos && eq > 0) {
      MPI_Info_set(info, line.substr(0, eq).c_str(),
                   line.substr(eq + 1).c_str());
    }
    at = end + 1;
  }
}

// MPI_Comm_spawn_multiple's arguments on the rank that starts the
// processes: one command of one process per argv.
struct SpawnArgs {
  std::vector<std::vector<std::string>> text;
  std::vector<std::vector<char*>> argv;
  std::vector<char*> commands;
  std::vector<char**> argvs;
  std::vector<int> counts;
  std::vector<MPI_Info> infos;

  SpawnArgs(const std::vector<std::vector<std::string>>& argvs_in,
            const std::vector<std::string>& hosts)
      : text(argvs_in) {
    argv.resize(text.size());
    for (size_t i = 0; i < text.size(); ++i) {
      for (size_t k = 1; k < text[i].size(); ++k) {
        argv[i].push_back(text[i][k].data());
      }
      argv[i].push_back(nullptr);
      commands.push_back(text[i][0].data());
      argvs.push_back(argv[i].data());
      counts.push_back(1);
      MPI_Info info;
      MPI_Info_create(&info);
      if (i < hosts.size()) SetInfo(info, hosts[i]);
      infos.push_back(info);
    }
  }
  ~SpawnArgs() {
    for (MPI_Info& info : infos) MPI_Info_free(&info);
  }
};

double GrowDeadlineS() {
  const char* text = std::getenv("KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS");
  const double v = text != nullptr ? std::atof(text) : 0.0;
  return v > 0 ? v : 300.0;
}
#endif

}  // namespace

Status GrowJob(const std::vector<std::vector<std::string>>& argvs,
               const std::vector<std::string>& hosts, double deadline_s) {
#ifndef KERASDIST_ULFM
  (void)argvs;
  (void)hosts;
  (void)deadline_s;
  return Status::Precondition(
      "growing in place needs recovery in place (kerasdist run "
      "--recover-in-place, on Open MPI 5)");
#else
  if (!RecoveryOn()) {
    return Status::Precondition(
        "growing in place needs recovery in place (kerasdist run "
        "--recover-in-place)");
  }
  MPI_Comm world = JobWorld();
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN);
  SpawnArgs args(rank == 0 ? argvs : std::vector<std::vector<std::string>>{},
                 hosts);
  for (const auto& a : args.text) {
    if (a.empty()) return Status::InvalidArgument("an empty command to start");
  }
  std::vector<int> errors(args.text.size() + 1, MPI_SUCCESS);
  MPI_Comm inter = MPI_COMM_NULL, merged = MPI_COMM_NULL;
  int rc = MPI_SUCCESS;
  {
    ReformWatch watch(deadline_s > 0 ? deadline_s : GrowDeadlineS(), rank,
                      "growing in place: the new ranks did not join",
                      " (KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS)");
    rc = MPI_Comm_spawn_multiple(static_cast<int>(args.commands.size()),
                                 args.commands.data(), args.argvs.data(),
                                 args.counts.data(), args.infos.data(), 0,
                                 world, &inter, errors.data());
    if (rc == MPI_SUCCESS) rc = MPI_Intercomm_merge(inter, 0, &merged);
  }
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Comm_spawn_multiple");
  MPI_Comm_set_errhandler(merged, MPI_ERRORS_RETURN);
  SetJobWorld(merged);
  ++g_grows;
  return Status::OK();
#endif
}

Status JoinParents() {
#ifdef KERASDIST_ULFM
  if (!RecoveryOn() || std::getenv(kGrownVariable) == nullptr) {
    return Status::OK();
  }
  MPI_Comm parent = MPI_COMM_NULL;
  MPI_Comm_get_parent(&parent);
  if (parent == MPI_COMM_NULL || JobWorld() != MPI_COMM_WORLD) {
    return Status::OK();
  }
  MPI_Comm_set_errhandler(parent, MPI_ERRORS_RETURN);
  MPI_Comm merged = MPI_COMM_NULL;
  const int rank = std::atoi(std::getenv(kGrownVariable));
  int rc = MPI_SUCCESS;
  {
    ReformWatch watch(GrowDeadlineS(), rank,
                      "growing in place: the job that started this rank did "
                      "not take it",
                      " (KERASDIST_RENDEZVOUS_TIMEOUT_SECONDS)");
    rc = MPI_Intercomm_merge(parent, 1, &merged);
  }
  KD_RETURN_IF_ERROR(MpiStatus(rc, "MPI_Intercomm_merge"));
  MPI_Comm_set_errhandler(merged, MPI_ERRORS_RETURN);
  SetJobWorld(merged);
  ++g_grows;
#endif
  return Status::OK();
}

Status ShrinkJob(bool leave, double deadline_s) {
#ifndef KERASDIST_ULFM
  (void)leave;
  (void)deadline_s;
  return Status::Precondition(
      "shrinking in place needs recovery in place (kerasdist run "
      "--recover-in-place, on Open MPI 5)");
#else
  if (!RecoveryOn()) {
    return Status::Precondition(
        "shrinking in place needs recovery in place (kerasdist run "
        "--recover-in-place)");
  }
  MPI_Comm world = JobWorld();
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN);
  MPI_Comm kept = MPI_COMM_NULL;
  int rc = MPI_SUCCESS;
  {
    ReformWatch watch(deadline_s > 0 ? deadline_s : GrowDeadlineS(), rank,
                      "shrinking in place: the ranks did not split",
                      " (a rank lost or frozen meanwhile)");
    rc = MPI_Comm_split(world, leave ? MPI_UNDEFINED : 0, rank, &kept);
  }
  if (rc != MPI_SUCCESS) return MpiStatus(rc, "MPI_Comm_split");
  if (leave) {
    g_left = true;
  } else {
    MPI_Comm_set_errhandler(kept, MPI_ERRORS_RETURN);
    SetJobWorld(kept);
    ++g_shrinks;
  }
  return Status::OK();
#endif
}

int Grows() { return g_grows; }

int Shrinks() { return g_shrinks; }

bool LeftJob() { return g_left; }

}  // namespace kerasdist::core
