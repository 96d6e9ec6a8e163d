// train_cuda: the runtime of exec/runtime.hpp on GPUs. The same programs as the CPU backend and
// the simulator, interpreted by one worker per rank over device memory: the bf16 stage of
// gpt_stage.hpp, fp32 master weights and moments, 2BW's two bf16 weight versions, an arena per
// device, a compute stream plus send, receive and all-reduce streams ordered with events, CUDA
// events timing every op.
#pragma once

#include <cstdint>
#include <functional>

#include "exec/runtime.hpp"

namespace pw::exec {
class MpiSession;  // exec/mpi/launch.hpp
}  // namespace pw::exec

namespace pw::exec::cuda {

using exec::MpiSession;

struct CudaRunOptions {
  // Bytes of the one cudaMalloc per device; 0: default_arena_bytes() (arena.hpp: the free memory
  // less max(512 MiB, 1/32 of the total) for cuBLASLt, NCCL and the context).
  std::int64_t arena_bytes = 0;
  // A transport op or a wait for the GPU longer than this is an error naming the rank and op.
  double timeout_s = 300;
  // Under `mpirun -np N`: this process runs rank mpi->rank() alone on GPU local_rank, talking NCCL
  // to the others. Null: every rank is a thread of this process on GPU 0 (LocalTransport).
  MpiSession* mpi = nullptr;
};

// As train_cpu (exec/runtime.hpp) for a model with a 2-byte dtype (fp16 or bf16; computed in
// bf16). The weights start as the CPU backend's (the same fp32 initialisation, rounded to bf16;
// the fp32 master keeps them exactly). Under mpirun the result holds every rank's memory and busy
// time (gathered to every process), every rank's timeline on rank 0 (the others: their own) and
// only this rank's weights; the step logs (loss
// and time per step) are complete on every process, and `on_step` is called on rank 0 only, at the
// end of the run (the loss lives on the last stage's process).
// RankResult::weights are the newest bf16 weights as floats.
TrainResult train_cuda(const models::ModelSpec& model, const planner::Plan& plan,
                       const TrainOptions& options,
                       const std::function<void(const StepLog&)>& on_step = {},
                       const CudaRunOptions& run = {});

}  // namespace pw::exec::cuda
