// train_cpu: programs for the plan, one thread per rank, step logs as steps complete (one process
// per rank under mpirun: exec/mpi/train.cpp).
#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "exec/checkpoint.hpp"
#include "exec/machine_load.hpp"
#include "exec/worker.hpp"

namespace pw::exec {

void detail::check_cpu_model(const models::ModelSpec& model) {
  if (model.dtype != models::DType::fp32)
    throw InputError(
        fmt::format("model {}: the CPU backend trains in fp32 (the model says {}); "
                    "use a model file with \"dtype\": \"fp32\"",
                    model.name, models::to_string(model.dtype)));
}

TrainResult train_cpu(const models::ModelSpec& model, const planner::Plan& plan,
                      const TrainOptions& options,
                      const std::function<void(const StepLog&)>& on_step) {
  detail::check_cpu_model(model);
  const detail::PreparedRun run = detail::prepare_run(model, plan, options, "cpu");
  if (run.finished) return *run.finished;
  const planner::Programs& programs = run.programs;
  const TokenSource data(options.data, model.vocab, options.seed);
  InProcessTransport transport;
  detail::Shared shared;
  shared.transport = &transport;
  // t devices (threads) per pipeline rank.
  const int devices = plan.ranks() * plan.t;
  shared.init(model, run, options, data, devices);
  shared.devices = std::vector<MemoryCounter>(std::size_t(devices));
  for (int r = 0; r < devices; ++r)
    shared.devices[std::size_t(r)].set_budget(options.device_memory, fmt::format("rank {}", r));
  shared.on_step = on_step;
  if (!options.cores.empty() && int(options.cores.size()) != devices)
    throw InputError(fmt::format("{} cores to pin {} ranks to", options.cores.size(), devices));
  if (options.core_turns && plan.t == 1 && !options.cores.empty()) {
    std::map<int, std::shared_ptr<detail::CoreQueue>> by_core;
    for (int c : options.cores)
      if (std::count(options.cores.begin(), options.cores.end(), c) > 1 && !by_core.count(c))
        by_core[c] = std::make_shared<detail::CoreQueue>();
    if (!by_core.empty())
      for (int c : options.cores)
        shared.core_queues.push_back(by_core.count(c) ? by_core[c] : nullptr);
  }
  std::vector<std::unique_ptr<detail::Worker>> workers;
  for (int r = 0; r < devices; ++r)
    workers.push_back(std::make_unique<detail::Worker>(shared, r));
  shared.start = detail::Clock::now();
  detail::run_threads(
      devices,
      [&](int r) {
        if (!options.cores.empty()) pin_current_thread(options.cores[std::size_t(r)]);
        workers[std::size_t(r)]->run();
      },
      [&] {
        transport.abort();
        for (const auto& q : shared.core_queues)
          if (q) q->abort();
      });
  TrainResult result;
  result.first_step = run.first_step;
  result.programs = programs;
  result.steps = shared.logs;
  result.wall_s = std::chrono::duration<double>(detail::Clock::now() - shared.start).count();
  for (const auto& w : workers)
    result.ranks.push_back(w->result());
  shared.write_final_manifest(result);
  return result;
}

}  // namespace pw::exec
