// `pipewright train`: run a plan for real — `--backend cpu`: one thread per rank (one process per
// rank under `mpirun -np N`), OpenBLAS, fp32;
// `--backend cuda`: bf16 on GPU 0 with every rank a thread, or one process per GPU under
// `mpirun -np N` — and write the run report with "source": "measured".
#include <algorithm>
#include <memory>
#include <mutex>
#include <numeric>

#include <fmt/format.h>

#include "cli/backend.hpp"
#include "cli/commands.hpp"
#include "cli/measured_report.hpp"
#include "cli/options.hpp"
#include "exec/checkpoint.hpp"
#include "exec/gpt_layout.hpp"
#include "exec/machine_load.hpp"
#include "exec/runtime.hpp"
#include "planner/cost_model.hpp"

namespace pw::cli {

namespace {

struct TrainArgs {
  std::string model = "gpt-tiny";
  PlanOptions plan;
  std::string backend = "cpu";
  exec::TrainOptions options;
  std::string out;
  std::string timeline;
  double comm_timeout_s = 300;
  bool pin_cores = false;
};

}  // namespace

void add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train",
                                 "train a plan for real: one log line per step, a "
                                 "measured run report");
  auto a = std::make_shared<TrainArgs>();
  cmd->add_option("--model", a->model,
                  "model preset or JSON file (fp32 for the CPU backend, fp16/bf16 for CUDA)")
      ->capture_default_str();
  a->plan.add(*cmd);
  cmd->add_option("--backend", a->backend,
                  "cpu (a thread per rank; under mpirun -np N, one process per rank), or cuda "
                  "(every rank on GPU 0; under mpirun -np N, one process per GPU"
#ifdef PW_HAVE_CUDA
                  "; --offload optimizer, activations or optimizer,activations on pinned host "
                  "memory and copy streams, not chunks; --tp t: t devices per rank (on GPU 0, or a "
                  "process each under mpirun), without offload (never run on a GPU yet)"
#endif
                  ")")
      ->capture_default_str();
  cmd->add_option("--steps", a->options.steps, "optimizer steps")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--data", a->options.data,
                  "token file (uint16 little-endian); default: a "
                  "synthetic corpus");
  cmd->add_option("--optimizer", a->options.optimizer, "adamw or sgd")->capture_default_str();
  cmd->add_option("--lr", a->options.lr, "learning rate, in (0, 1e6]")
      ->capture_default_str()
      ->check(finite_range(0, 1e6, /*lo_open=*/true));
  cmd->add_option("--weight-decay", a->options.weight_decay, "AdamW decoupled weight decay")
      ->capture_default_str()
      ->check(finite_range(0, 1e6));
  cmd->add_option("--seed", a->options.seed, "weights and synthetic data")->capture_default_str();
  cmd->add_option("--buckets", a->options.gradient_buckets, "all-reduce buckets per stage")
      ->capture_default_str()
      ->check(count_range());
  auto* dir = cmd->add_option("--checkpoint-dir", a->options.checkpoint_dir,
                              "write checkpoints here (atomically; the 2 newest are kept)");
  cmd->add_option("--checkpoint-every", a->options.checkpoint_every,
                  "steps between checkpoints (and one after the last step)")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_flag("--resume", a->options.resume,
                "continue from the newest intact checkpoint in --checkpoint-dir (from step 0 "
                "if there is none) up to --steps; bit-identical to an unbroken run. At the final "
                "checkpoint of a finished run: writes its report again")
      ->needs(dir);
  cmd->add_option("--comm-timeout", a->comm_timeout_s,
                  "seconds a rank waits for a peer (a message, the all-reduce) before the job ends "
                  "with an error naming the rank and op (mpirun jobs, --backend cuda; 0: forever)")
      ->capture_default_str()
      ->check(finite_range(0, 1e6));
  cmd->add_flag("--pin-cores,!--no-pin-cores", a->pin_cores,
                "CPU backend, one process: run rank r's thread on core r only (with more ranks "
                "than cores, neighbouring ranks share one); under mpirun, mpirun binds")
      ->capture_default_str();
  cmd->add_flag("--core-turns,!--no-core-turns", a->options.core_turns,
                "CPU backend, --pin-cores: ranks sharing a core take turns on it op by op, first "
                "ready first, as the simulator runs them, and send inline within their turn "
                "(--no-core-turns: the OS interleaves them); not with --tp > 1")
      ->capture_default_str();
  cmd->add_flag("--async-comm,!--no-async-comm", a->options.async_comm,
                "CPU backend, one process: sends and data-parallel gradient sums on each rank's "
                "communication threads, beside its compute (--no-async-comm: on the rank's "
                "thread, as under mpirun; the same losses)")
      ->capture_default_str();
  cmd->add_flag("--mpi-progress", a->options.mpi_progress,
                "CPU backend under mpirun: a progress thread per process moves MPI messages while "
                "the rank computes (default: MPI moves them only inside the rank's own transport "
                "calls); the same losses");
  cmd->add_option("--device-memory", a->options.device_memory,
                  "bytes of each rank's device: the CPU backend's emulated device (its tensors' "
                  "arena), the CUDA backend's counted tensors; a run that would exceed it stops "
                  "with one line naming the rank, what did not fit and by how much (default 0: "
                  "unlimited)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t(0), std::int64_t(1) << 50));
  cmd->add_option("--out,-o", a->out, "write the measured run report (JSON) here");
  cmd->add_option("--timeline", a->timeline,
                  "write a Chrome-trace timeline of what ran (Perfetto), laid out like simulate's");
  cmd->callback([a] {
    check_backend(a->backend);
    const models::ModelSpec model = exec::as_executed(models::load_model(a->model));
    // Without -w the width is 1 (build() checks the plan). Chunks: the chunk size the run takes
    // written in (its report and checkpoints name it), in the budget the backend schedules them in.
    const planner::Plan built = executed_plan(a->plan.build(model.layers, 1));
    const planner::Plan plan =
        built.offload == planner::Offload::chunks
            ? exec::with_chunk_size(model, built,
                                    exec::chunk_budget(a->backend, built, a->options.device_memory))
            : built;
    const bool lead = process_rank() == 0;  // under mpirun only rank 0 prints and writes
    const MeasuredOn on = measured_on(a->backend, model, plan);
    // The run's line, once its checks have passed (a refused plan prints only its error): before
    // the resume notes or the first step, whichever comes first.
    auto header = [lead, once = std::make_shared<std::once_flag>(), model, plan, on,
                   steps = a->options.steps] {
      if (!lead) return;
      std::call_once(*once, [&] {
        fmt::print("{}: {} {}w={} d={} b={} m={}, global batch {}, {} steps, {} rank{} on {}{}\n",
                   model.name, to_string(plan.schedule),
                   plan.t > 1 ? fmt::format("t={} ", plan.t) : "", plan.w, plan.d, plan.b, plan.m,
                   plan.global_batch(), steps, plan.gpus(), plan.gpus() == 1 ? "" : "s", on.cluster,
                   process_count() > 1 ? fmt::format(" ({} processes)", process_count()) : "");
      });
    };
    if (lead)
      a->options.on_resume = [dir = a->options.checkpoint_dir,
                              header](const exec::ResumeInfo& info) {
        header();
        for (const std::string& w : info.warnings)
          fmt::print(stderr, "{}\n", w);
        if (info.finished)
          fmt::print(
              "{} is the final checkpoint of a finished run of {} steps: nothing to run, "
              "its report is written again\n",
              info.checkpoint, info.step);
        else if (info.step > 0)
          fmt::print("resuming from {} (step {})\n", info.checkpoint, info.step);
        else
          fmt::print("no checkpoint in {}: starting from step 0\n", dir);
        std::fflush(stdout);
      };
    if (a->pin_cores && a->backend == "cpu" && process_count() == 1)
      a->options.cores = exec::cores_for_ranks(plan.gpus(), exec::allowed_cores());
    const exec::TrainResult r = train_on(
        a->backend, model, plan, a->options,
        [header](const exec::StepLog& s) {
          header();
          print_step(s);
        },
        a->comm_timeout_s);
    if (!lead) return;
    header();
    planner::RunReport report = measured_report(model, plan, r, on);
    if (on.peak_flops_per_s > 0)
      fmt::print("{}: {:.0f} tokens/s, {:.1f} model TFLOP/s, MFU {:.1f}% of {:.0f} TFLOP/s\n",
                 on.cluster, report.tokens_per_s, report.model_flops_per_s / 1e12, 100 * report.mfu,
                 on.peak_flops_per_s / 1e12);
    if (!a->timeline.empty() && r.from_checkpoint) {
      fmt::print(stderr,
                 "warning: --timeline {}: a finished run's checkpoint keeps no timeline; not "
                 "written\n",
                 a->timeline);
    } else if (!a->timeline.empty()) {
      std::vector<planner::RankTimeline> ranks;
      for (const auto& rank : r.ranks)
        ranks.push_back(rank.timeline);
      // With t > 1 each device ran its pipeline rank's program (device = rank * t + TP index).
      planner::Programs programs = r.programs;
      if (plan.t > 1) {
        programs.devices.clear();
        for (int device = 0; device < plan.gpus(); ++device)
          programs.devices.push_back(r.programs.devices[std::size_t(device / plan.t)]);
      }
      common::write_file_atomic(a->timeline, planner::chrome_trace(programs, ranks).dump() + "\n");
      report.timeline = a->timeline;
      fmt::print("wrote {}\n", a->timeline);
    }
    if (!a->out.empty()) {
      common::write_json_file(a->out, planner::to_json(report));
      fmt::print("wrote {}\n", a->out);
    }
  });
}

}  // namespace pw::cli
