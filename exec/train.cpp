// train_cpu: programs for the plan, one thread per rank, step logs as steps complete.
#include <exception>
#include <thread>

#include <fmt/format.h>

#include "exec/checkpoint.hpp"
#include "exec/worker.hpp"

namespace pw::exec {

common::Json run_identity(const models::ModelSpec& model, const planner::Plan& plan,
                          const TrainOptions& o) {
  // Floats as their shortest decimal (0.001, not 0.0010000000474974513).
  const auto num = [](float x) { return std::stod(fmt::format("{}", x)); };
  common::Json optimizer = {{"name", o.optimizer}, {"lr", num(o.lr)}};
  if (o.optimizer == "adamw") {
    optimizer["beta1"] = num(o.beta1);
    optimizer["beta2"] = num(o.beta2);
    optimizer["eps"] = num(o.eps);
    optimizer["weight_decay"] = num(o.weight_decay);
  } else {
    optimizer["momentum"] = num(o.momentum);
  }
  return {{"backend", "cpu"},
          {"model", models::to_json(model)},
          {"plan", planner::to_json(plan)},
          {"optimizer", optimizer},
          {"seed", o.seed},
          {"data", o.data}};
}

TrainResult train_cpu(const models::ModelSpec& model, const planner::Plan& plan,
                      const TrainOptions& options,
                      const std::function<void(const StepLog&)>& on_step) {
  if (model.dtype != models::DType::fp32)
    throw InputError(
        fmt::format("model {}: the CPU backend trains in fp32 (the model says {}); "
                    "use a model file with \"dtype\": \"fp32\"",
                    model.name, models::to_string(model.dtype)));
  if (options.optimizer != "adamw" && options.optimizer != "sgd")
    throw InputError(fmt::format("--optimizer: unknown \"{}\" (adamw or sgd)", options.optimizer));
  if (options.steps < 1) throw InputError("--steps must be at least 1");
  if (options.checkpoint_every < 1) throw InputError("--checkpoint-every must be at least 1");
  if (options.resume && options.checkpoint_dir.empty())
    throw InputError("--resume needs --checkpoint-dir");
  const common::Json identity = run_identity(model, plan, options);
  int first_step = 0;
  if (!options.checkpoint_dir.empty()) remove_incomplete_checkpoints(options.checkpoint_dir);
  if (!options.resume && !options.checkpoint_dir.empty()) {
    if (const auto step = latest_checkpoint(options.checkpoint_dir))
      throw InputError(fmt::format(
          "--checkpoint-dir {}: holds a checkpoint of step {}; pass --resume to continue from it "
          "or use an empty directory",
          options.checkpoint_dir, *step));
  }
  if (options.resume) {
    if (const auto step = latest_checkpoint(options.checkpoint_dir)) {
      check_manifest(options.checkpoint_dir, *step, plan.ranks(), identity);
      if (*step >= options.steps)
        throw InputError(fmt::format("--resume: {} is at step {}; --steps {} leaves nothing to run",
                                     checkpoint_path(options.checkpoint_dir, *step), *step,
                                     options.steps));
      first_step = *step;
    }
  }
  planner::ProgramOptions po;
  po.steps = options.steps - first_step;
  po.gradient_buckets = options.gradient_buckets;
  po.first_step = first_step;
  po.tied_embeddings = model.tied_embeddings;
  const planner::Programs programs = planner::generate_programs(plan, po);
  const TokenSource data(options.data, model.vocab, options.seed);
  detail::Shared shared;
  shared.model = &model;
  shared.programs = &programs;
  shared.options = &options;
  shared.data = &data;
  shared.first_step = first_step;
  shared.identity = identity;
  shared.devices = std::vector<MemoryCounter>(std::size_t(plan.ranks()));
  shared.finished.assign(std::size_t(programs.steps), 0);
  shared.loss_sum.assign(std::size_t(programs.steps), 0.0);
  shared.on_step = on_step;
  std::vector<std::unique_ptr<detail::Worker>> workers;
  for (int r = 0; r < plan.ranks(); ++r)
    workers.push_back(std::make_unique<detail::Worker>(shared, r));
  shared.start = detail::Clock::now();
  std::vector<std::exception_ptr> errors(workers.size());
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < workers.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        workers[r]->run();
      } catch (...) {
        errors[r] = std::current_exception();
        shared.transport.abort();
      }
    });
  for (auto& t : threads)
    t.join();
  // The first real failure, not the aborts it caused elsewhere.
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      if (std::string(err.what()).rfind("transport aborted", 0) == 0) continue;
      throw;
    }
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  TrainResult result;
  result.first_step = first_step;
  result.programs = programs;
  result.steps = shared.logs;
  result.wall_s = std::chrono::duration<double>(detail::Clock::now() - shared.start).count();
  for (const auto& w : workers)
    result.ranks.push_back(w->result());
  return result;
}

}  // namespace pw::exec
