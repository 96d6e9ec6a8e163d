// The launcher's environment and the MPI session (exec/mpi/launch.hpp).
#include "exec/mpi/launch.hpp"

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <unistd.h>

#if PW_HAVE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only: no deprecated C++ bindings
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace pw::exec {

namespace {

// A non-negative decimal integer, or -1.
int parse_count(const char* s) {
  if (!s || !*s) return -1;
  long v = 0;
  for (const char* p = s; *p; ++p) {
    if (*p < '0' || *p > '9') return -1;
    v = v * 10 + (*p - '0');
    if (v > 1 << 24) return -1;
  }
  return int(v);
}

int read_int(const std::function<const char*(const char*)>& get, const char* name, bool required,
             int fallback) {
  const char* s = get(name);
  if (!s) {
    if (required) throw InputError(std::string("launcher environment: ") + name + " is not set");
    return fallback;
  }
  const int v = parse_count(s);
  if (v < 0)
    throw InputError(std::string("launcher environment: ") + name + "=\"" + s +
                     "\" is not a non-negative integer");
  return v;
}

}  // namespace

MpiEnv detect_mpi_env(const std::function<const char*(const char*)>& getenv_fn) {
  const std::function<const char*(const char*)> get =
      getenv_fn ? getenv_fn : [](const char* n) -> const char* { return std::getenv(n); };
  MpiEnv env;
  const char *rank_var = nullptr, *size_var = nullptr, *local_var = nullptr,
             *local_size_var = nullptr;
  if (get("OMPI_COMM_WORLD_RANK") || get("OMPI_COMM_WORLD_SIZE")) {
    env.launcher = "OpenMPI";
    rank_var = "OMPI_COMM_WORLD_RANK";
    size_var = "OMPI_COMM_WORLD_SIZE";
    local_var = "OMPI_COMM_WORLD_LOCAL_RANK";
    local_size_var = "OMPI_COMM_WORLD_LOCAL_SIZE";
  } else if (get("PMI_RANK") || get("PMI_SIZE")) {
    env.launcher = "MPICH";
    rank_var = "PMI_RANK";
    size_var = "PMI_SIZE";
    local_var = "MPI_LOCALRANKID";
    local_size_var = "MPI_LOCALNRANKS";
  } else {
    return env;
  }
  env.launched = true;
  env.rank = read_int(get, rank_var, true, 0);
  env.size = read_int(get, size_var, true, 1);
  env.local_rank = read_int(get, local_var, false, env.rank);
  env.local_size = read_int(get, local_size_var, false, env.size);
  if (env.size < 1 || env.rank >= env.size || env.local_rank >= std::max(env.local_size, 1))
    throw InputError("launcher environment (" + env.launcher + "): rank " +
                     std::to_string(env.rank) + " of " + std::to_string(env.size) +
                     ", local rank " + std::to_string(env.local_rank) + " of " +
                     std::to_string(env.local_size) + " is inconsistent");
  return env;
}

void check_world_size(int world_size, int plan_ranks, const std::string& plan_text) {
  if (world_size == plan_ranks) return;
  throw PlanError("mpirun started " + std::to_string(world_size) + " process" +
                  (world_size == 1 ? "" : "es") + " but the plan has " +
                  std::to_string(plan_ranks) + " ranks" +
                  (plan_text.empty() ? "" : " (" + plan_text + ")") + ": run mpirun -np " +
                  std::to_string(plan_ranks));
}

int local_device(const MpiEnv& env, int device_count) {
  if (env.local_rank < device_count) return env.local_rank;
  throw PlanError("rank " + std::to_string(env.rank) + ": local rank " +
                  std::to_string(env.local_rank) + " but this node has " +
                  std::to_string(device_count) + " CUDA device" + (device_count == 1 ? "" : "s") +
                  ": one process per GPU (stages sharing a GPU run in one process)");
}

#if PW_HAVE_MPI

void check_mpi(int rank, const std::string& op, int code) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int n = 0;
  MPI_Error_string(code, text, &n);
  std::string t(text, std::size_t(std::max(n, 0)));
  for (char& c : t)
    if (c == '\n') c = ' ';
  throw Error("rank " + std::to_string(rank) + ": " + op + " failed: " + t);
}

bool MpiSession::available() {
  return true;
}

namespace {

// mpirun ends the job's other processes with SIGCONT, SIGTERM (then SIGKILL) when one of them dies
// or aborts: each says so in one line, with what it was waiting for (a signal handler may only
// write(2): the line's pieces are prepared beforehand).
char rank_prefix[64];
std::size_t rank_prefix_length = 0;
// What the rank waits for now: two buffers, `waiting_now` names the complete one (-1: nothing).
char waiting_text[2][160];
std::size_t waiting_length[2] = {0, 0};
std::atomic<int> waiting_now{-1};

void put(const char* text, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, text, n);
    if (w <= 0) return;
    text += w;
    n -= std::size_t(w);
  }
}

extern "C" void on_sigterm(int) {
  static const char kEnded[] = "ended by mpirun (SIGTERM)";
  static const char kWhile[] = " while waiting to ";
  static const char kWhy[] = ": another rank of the job died, failed or was interrupted first\n";
  put(rank_prefix, rank_prefix_length);
  put(kEnded, sizeof kEnded - 1);
  const int now = waiting_now.load();
  if (now >= 0) {
    put(kWhile, sizeof kWhile - 1);
    put(waiting_text[now], waiting_length[now]);
  }
  put(kWhy, sizeof kWhy - 1);
  ::_exit(1);
}

void say_when_ended(int rank) {
  const int n =
      std::snprintf(rank_prefix, sizeof rank_prefix, "pipewright: error: rank %d: ", rank);
  rank_prefix_length = n > 0 ? std::min(std::size_t(n), sizeof rank_prefix - 1) : 0;
  struct sigaction action {};
  action.sa_handler = on_sigterm;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
}

}  // namespace

void note_waiting(const std::string& op) {
  const int next = waiting_now.load() == 0 ? 1 : 0;
  const std::size_t n = std::min(op.size(), sizeof waiting_text[0]);
  std::memcpy(waiting_text[next], op.data(), n);
  waiting_length[next] = n;
  waiting_now.store(next);
}

void note_done_waiting() {
  waiting_now.store(-1);
}

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialised = 0;
  check_mpi(0, "MPI_Initialized", MPI_Initialized(&initialised));
  if (!initialised) {
    check_mpi(0, "MPI_Init_thread",
              MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &thread_level_));
    initialised_here_ = true;
  } else {
    check_mpi(0, "MPI_Query_thread", MPI_Query_thread(&thread_level_));
  }
  check_mpi(0, "MPI_Comm_set_errhandler",
            MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  check_mpi(0, "MPI_Comm_rank", MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  check_mpi(rank_, "MPI_Comm_size", MPI_Comm_size(MPI_COMM_WORLD, &size_));
  if (size_ > 1) say_when_ended(rank_);
}

MpiSession::~MpiSession() {
  int finalised = 0;
  if (initialised_here_ && MPI_Finalized(&finalised) == MPI_SUCCESS && !finalised) MPI_Finalize();
}

void MpiSession::broadcast(void* data, int bytes, int root) const {
  check_mpi(rank_, "MPI_Bcast", MPI_Bcast(data, bytes, MPI_BYTE, root, MPI_COMM_WORLD));
}

void MpiSession::barrier() const {
  check_mpi(rank_, "MPI_Barrier", MPI_Barrier(MPI_COMM_WORLD));
}

void MpiSession::all_gather(const void* mine, int bytes, void* all) const {
  check_mpi(rank_, "MPI_Allgather",
            MPI_Allgather(mine, bytes, MPI_BYTE, all, bytes, MPI_BYTE, MPI_COMM_WORLD));
}

void MpiSession::all_reduce(double* data, int n, bool max) const {
  check_mpi(
      rank_, "MPI_Allreduce",
      MPI_Allreduce(MPI_IN_PLACE, data, n, MPI_DOUBLE, max ? MPI_MAX : MPI_SUM, MPI_COMM_WORLD));
}

std::vector<std::string> MpiSession::gather(const std::string& mine, int root) const {
  int bytes = int(mine.size());
  std::vector<int> counts(rank_ == root ? std::size_t(size_) : 0), offsets(counts.size());
  check_mpi(rank_, "MPI_Gather",
            MPI_Gather(&bytes, 1, MPI_INT, counts.data(), 1, MPI_INT, root, MPI_COMM_WORLD));
  std::string all;
  if (rank_ == root) {
    for (int r = 1; r < size_; ++r)
      offsets[std::size_t(r)] = offsets[std::size_t(r - 1)] + counts[std::size_t(r - 1)];
    all.resize(std::size_t(offsets.back() + counts.back()));
  }
  check_mpi(rank_, "MPI_Gatherv",
            MPI_Gatherv(mine.data(), bytes, MPI_BYTE, all.data(), counts.data(), offsets.data(),
                        MPI_BYTE, root, MPI_COMM_WORLD));
  std::vector<std::string> out;
  for (std::size_t r = 0; r < counts.size(); ++r)
    out.push_back(all.substr(std::size_t(offsets[r]), std::size_t(counts[r])));
  return out;
}

void MpiSession::abort(int code) const {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort should not return
}

#else  // built without MPI

bool MpiSession::available() {
  return false;
}

MpiSession::MpiSession(int*, char***) {
  throw Error("this pipewright was built without MPI: install libopenmpi-dev and rebuild");
}

MpiSession::~MpiSession() = default;

void MpiSession::broadcast(void*, int, int) const {}
void MpiSession::barrier() const {}
void MpiSession::all_gather(const void*, int, void*) const {}
void MpiSession::all_reduce(double*, int, bool) const {}
std::vector<std::string> MpiSession::gather(const std::string&, int) const {
  return {};
}
void check_mpi(int, const std::string&, int) {}
void note_waiting(const std::string&) {}
void note_done_waiting() {}
void MpiSession::abort(int code) const {
  std::_Exit(code);
}

#endif

}  // namespace pw::exec
