// Running under `mpirun -np N pipewright train ...`: one process per rank (per GPU with CUDA). The
// launcher's environment (always built), and the MPI session: the CPU ranks' transport
// (exec/mpi/transport.hpp) and the NCCL id broadcast (PW_HAVE_MPI: Debian's libopenmpi-dev; without
// it MpiSession throws a one-line error).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common/error.hpp"

namespace pw::exec {

// What the launcher told this process. OpenMPI's mpirun sets OMPI_COMM_WORLD_{RANK,SIZE,
// LOCAL_RANK,LOCAL_SIZE}; MPICH's Hydra sets PMI_RANK, PMI_SIZE and MPI_LOCALRANKID.
struct MpiEnv {
  bool launched = false;  // under a launcher; the rest is meaningful only then
  std::string launcher;   // "OpenMPI", "MPICH" or ""
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
};
// `getenv` is a parameter for the tests. A malformed value is a one-line InputError naming it.
MpiEnv detect_mpi_env(const std::function<const char*(const char*)>& getenv = nullptr);

// PlanError "mpirun started N processes but the plan has M ranks (PLAN): run mpirun -np M" unless
// they are equal.
void check_world_size(int world_size, int plan_ranks, const std::string& plan_text = "");

// The GPU of this process: its local rank, which must be below the node's device count (NCCL does
// not support two ranks of one communicator on one GPU; run those stages in one process with the
// local transport instead). PlanError otherwise.
int local_device(const MpiEnv& env, int device_count);

// MPI_Init_thread (funneled) unless MPI is already initialised, and MPI_Finalize at destruction if
// it initialised it; errors are returned (MPI_ERRORS_RETURN) and thrown as one-line pw::Error
// "rank R: OP failed: TEXT". Construct one early in main, before any thread starts.
// Throws pw::Error "rank R: OP failed: TEXT" (one line) unless `code` is MPI_SUCCESS (MPI builds).
void check_mpi(int rank, const std::string& op, int code);

// What this process waits for now ("receive gradient from rank 1"), for the one line it prints
// when mpirun ends it (SIGTERM) because another rank died or failed: under mpirun (size > 1) the
// MpiSession installs that handler. note_done_waiting: nothing.
void note_waiting(const std::string& op);
void note_done_waiting();

class MpiSession {
 public:
  static bool available();  // built with MPI
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The thread support MPI gives (MPI_THREAD_*; MPI_Init_thread asks for SERIALIZED, which the
  // CPU ranks' progress thread needs).
  int thread_level() const { return thread_level_; }
  // MPI_Bcast of `bytes` raw bytes from `root` (e.g. the ncclUniqueId, made on rank 0).
  void broadcast(void* data, int bytes, int root) const;
  template <class T>
  void broadcast_value(T& value, int root) const {
    broadcast(&value, int(sizeof(T)), root);
  }
  void barrier() const;
  // MPI_Allgather of `bytes` from every rank into `all` (size() x bytes, by rank).
  void all_gather(const void* mine, int bytes, void* all) const;
  // MPI_Allreduce in place: the sum (or the maximum) over the ranks of each of the n doubles.
  void all_reduce(double* data, int n, bool max = false) const;
  // MPI_Gatherv of every rank's bytes to `root`: there, all of them by rank; elsewhere empty.
  std::vector<std::string> gather(const std::string& mine, int root) const;
  // MPI_Abort of the whole job (the other ranks may sit in NCCL kernels); does not return.
  [[noreturn]] void abort(int code) const;

 private:
  int rank_ = 0, size_ = 1, thread_level_ = 0;
  bool initialised_here_ = false;
};

}  // namespace pw::exec
