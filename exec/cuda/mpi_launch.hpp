// The mpirun launch of the CUDA backend: the launcher's environment and the MPI session live in
// exec/mpi/launch.hpp (shared with the CPU ranks' MPI transport); these names keep the CUDA code's.
#pragma once

#include "exec/mpi/launch.hpp"

namespace pw::exec::cuda {

using exec::check_world_size;
using exec::detect_mpi_env;
using exec::local_device;
using exec::MpiEnv;
using exec::MpiSession;

}  // namespace pw::exec::cuda
