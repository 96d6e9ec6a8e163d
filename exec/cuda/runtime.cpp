// train_cuda: the device, the arena and the transport of this process, a worker per rank here,
// the step logs (gathered over the processes of an mpirun job).
#include "exec/cuda/runtime.hpp"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "exec/cuda/local_transport.hpp"
#include "exec/cuda/mpi_launch.hpp"
#include "exec/cuda/worker.hpp"
#include "exec/gpu_host.hpp"
#include "exec/mpi/train.hpp"
#ifdef PW_HAVE_NCCL
#include "exec/cuda/nccl_transport.hpp"
#endif

namespace pw::exec::cuda {

namespace {

std::int64_t arena_capacity(const CudaRunOptions& run) {
  if (run.arena_bytes > 0) return run.arena_bytes;
  const std::int64_t bytes = default_arena_bytes();
  if (bytes < (std::int64_t(64) << 20))
    throw InputError(
        fmt::format("--backend cuda: only {} MiB of GPU memory free beyond the reserve "
                    "(another process?)",
                    bytes >> 20));
  return bytes;
}

#ifdef PW_HAVE_NCCL
// The devices this device exchanges messages with on `channel`, from its pipeline rank's program
// (symmetric: a send on one side is a receive on the other): the peers' devices of its TP index.
std::vector<int> program_peers(const planner::Programs& programs, int device, int t,
                               Channel channel) {
  std::set<int> peers;
  for (const planner::Op& op : programs.devices[std::size_t(device / t)].ops) {
    using K = planner::OpKind;
    const bool on = (channel == Channel::activation &&
                     (op.kind == K::send_activation || op.kind == K::recv_activation)) ||
                    (channel == Channel::gradient &&
                     (op.kind == K::send_gradient || op.kind == K::recv_gradient)) ||
                    (channel == Channel::tied &&
                     (op.kind == K::send_tied_gradient || op.kind == K::recv_tied_gradient)) ||
                    (channel == Channel::tied_weights &&
                     (op.kind == K::send_tied_weights || op.kind == K::recv_tied_weights));
    if (on) peers.insert(op.peer * t + device % t);
  }
  return {peers.begin(), peers.end()};
}
#endif

}  // namespace

TrainResult train_cuda(const models::ModelSpec& model, const planner::Plan& plan,
                       const TrainOptions& options,
                       const std::function<void(const StepLog&)>& on_step,
                       const CudaRunOptions& run) {
  check_gpu_model(model);
  const int devices = cuda_device_count();
  if (devices == 0) throw InputError("--backend cuda: " + no_device_reason());
  const exec::detail::PreparedRun prepared =
      exec::detail::prepare_run(model, plan, options, "cuda", !run.mpi || run.mpi->rank() == 0);
  if (prepared.finished) return *prepared.finished;
  const TokenSource data(options.data, model.vocab, options.seed);

  detail::GpuShared shared;
  std::vector<int> here;  // the ranks this process runs
  int device = 0;
  if (run.mpi) {
    // One process per device: t per pipeline rank (device = rank · t + TP index).
    check_world_size(run.mpi->size(), plan.ranks() * plan.t,
                     fmt::format("{} w={} d={}{}", planner::to_string(plan.schedule), plan.w,
                                 plan.d, plan.t > 1 ? fmt::format(" t={}", plan.t) : ""));
    device = local_device(detect_mpi_env(), devices);
    here = {run.mpi->rank()};
  } else {
    for (int r = 0; r < plan.ranks() * plan.t; ++r)  // a worker per device (t per rank)
      here.push_back(r);
  }
  CUDA_CHECK(cudaSetDevice(device));
  // NCCL connects (and allocates its buffers) before the arena takes most of what is left; the
  // local transport stages its messages in the arena. The transport dies before the arena.
  std::unique_ptr<DeviceArena> arena;
  std::unique_ptr<DeviceTransport> transport;
  if (run.mpi) {
#ifdef PW_HAVE_NCCL
    ncclUniqueId id{};
    if (run.mpi->rank() == 0) id = nccl_unique_id();
    run.mpi->broadcast_value(id, 0);
    // The replicas' communicator per (stage, TP index), the TP group's per pipeline rank.
    const int t = plan.t, devices = plan.ranks() * t;
    std::vector<int> stage_of, tp_of;
    for (int d = 0; d < devices; ++d) {
      stage_of.push_back(plan.stage_of(d / t) * t + d % t);
      if (t > 1) tp_of.push_back(d / t);
    }
    auto nccl = std::make_unique<NcclTransport>(id, devices, run.mpi->rank(), stage_of,
                                                run.timeout_s, tp_of);
    for (Channel c : {Channel::activation, Channel::gradient, Channel::tied, Channel::tied_weights})
      nccl->connect(c, program_peers(prepared.programs, run.mpi->rank(), t, c));
    // The collectives' communicators connect at their first use: make that now, not mid-step.
    std::vector<const std::vector<int>*> groups;
    if (plan.w > 1) groups.push_back(&nccl->stage_members());
    if (t > 1) groups.push_back(&nccl->tp_members());
    if (!groups.empty()) {
      float* one = nullptr;
      cudaStream_t stream = nullptr;
      CUDA_CHECK(cudaMalloc(&one, sizeof(float)));
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      for (const std::vector<int>* g : groups) {
        nccl->all_reduce_sum_fp32(*g, run.mpi->rank(), one, 1, stream);
        nccl->synchronize(run.mpi->rank(), stream, "connect the collectives");
      }
      CUDA_CHECK(cudaStreamDestroy(stream));
      CUDA_CHECK(cudaFree(one));
    }
    transport = std::move(nccl);
    arena = std::make_unique<DeviceArena>(arena_capacity(run));
#else
    throw InputError("--backend cuda under mpirun: this build has no NCCL");
#endif
  } else {
    arena = std::make_unique<DeviceArena>(arena_capacity(run));
    transport = std::make_unique<LocalTransport>(*arena, plan.ranks() * plan.t, run.timeout_s);
  }

  shared.init(model, prepared, options, data, int(here.size()));
  shared.arena = arena.get();
  shared.transport = transport.get();
  shared.device = device;
  shared.counters = std::vector<MemoryCounter>(here.size());
  // --device-memory: each rank's counted tensors (the planner's per-rank figure) inside a budget,
  // as the CPU backend's emulated device; the arena bounds the whole GPU.
  for (std::size_t i = 0; i < here.size(); ++i)
    shared.counters[i].set_budget(options.device_memory, fmt::format("rank {}", here[i]));
  if (run.mpi) {
    shared.write_manifests = run.mpi->rank() == 0;
    shared.before_manifest = [&] { run.mpi->barrier(); };
  } else {
    shared.on_step = on_step;
  }

  std::vector<std::unique_ptr<detail::CudaWorker>> workers;
  for (std::size_t i = 0; i < here.size(); ++i)
    workers.push_back(std::make_unique<detail::CudaWorker>(shared, here[i], shared.counters[i]));
  if (run.mpi) run.mpi->barrier();
  shared.start = exec::detail::Clock::now();
  for (auto& w : workers)
    w->start();
  if (run.mpi) {
    try {
      workers.front()->run();  // MPI is funneled: this thread only
    } catch (...) {
      transport->abort();  // ends NCCL kernels waiting for peers, so nothing below hangs
      throw;
    }
  } else {
    exec::detail::run_threads(
        int(workers.size()), [&](int i) { workers[std::size_t(i)]->run(); },
        [&] { transport->abort(); });
  }
  TrainResult result;
  result.first_step = prepared.first_step;
  result.programs = prepared.programs;
  result.wall_s = std::chrono::duration<double>(exec::detail::Clock::now() - shared.start).count();
  for (auto& w : workers)
    result.ranks.push_back(w->result());
  if (run.mpi) {
    exec::detail::merge_logs(shared, *run.mpi);
    exec::detail::gather_ranks(result, *run.mpi, true);
    if (run.mpi->rank() == 0 && on_step)
      for (const StepLog& log : shared.logs)
        on_step(log);
  }
  result.steps = shared.logs;
  workers.clear();  // before the transport and the arena
  // Every process has written its last shard (the gathers above waited for all of them).
  shared.write_final_manifest(result);
  return result;
}

}  // namespace pw::exec::cuda
