// `pipewright trace` (write an analytic trace) and `pipewright estimate` (closed-form step time
// and memory of a plan, written as a run report with "source": "analytic").
#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "planner/cost_model.hpp"
#include "traces/analytic.hpp"

namespace pw::cli {

namespace {

const char* rc_label(planner::Recompute r) {
  return r == planner::Recompute::full        ? "yes"
         : r == planner::Recompute::block     ? "block"
         : r == planner::Recompute::selective ? "sel"
                                              : "no";
}

void print_estimate(const planner::Estimate& est, const models::ModelSpec& model,
                    const clusters::Cluster& cluster) {
  const auto& r = est.report;
  const auto& p = r.plan;
  fmt::print("{} on {} ({} x {} x {}): {}, global batch {}\n", model.name, cluster.name,
             cluster.nodes, cluster.gpus_per_node, cluster.device.name, plan_summary(p),
             p.global_batch());
  fmt::print("  step time {} (pipeline {}, all-reduce {}, tied-embedding exchange {}, {} {})\n",
             human_seconds(r.iteration_time_s), human_seconds(est.pipeline_s),
             human_seconds(est.allreduce_s), human_seconds(est.tied_s),
             p.offload == planner::Offload::none ? "optimizer" : "host step (CPU Adam, uploads)",
             human_seconds(est.optimizer_s));
  fmt::print("  {:.2f} samples/s, {} , {}, MFU {:.1f}%\n", r.samples_per_s,
             human_rate(r.tokens_per_s, "tokens"), human_rate(r.model_flops_per_s, "FLOP"),
             100 * r.mfu);
  fmt::print("  {:>5} {:>6} {:>3} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6} {}\n",
             "stage", "blocks", "rc", "t_f", "t_b", "weights", "versions", "grads", "optimizer",
             "activ.", "stash", "peak / capacity");
  for (const auto& st : est.stages) {
    const auto& d = r.devices[p.rank_of(st.stage, 0)];
    fmt::print(
        "  {:>5} {:>6} {:>3} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6} {} / {}{}\n",
        st.stage, st.blocks, rc_label(st.recompute), human_seconds(st.forward_s),
        human_seconds(st.backward_s), human_bytes(st.memory.weights),
        human_bytes(st.memory.weight_versions), human_bytes(st.memory.gradients),
        human_bytes(st.memory.optimizer), human_bytes(st.memory.activations), st.in_flight,
        human_bytes(d.peak_memory_bytes), human_bytes(d.capacity_bytes),
        d.fits ? "" : "  DOES NOT FIT");
  }
  fmt::print("{}", offload_summary(r));
  // Activation offload: each stage's choice and the figures the rule compares (formulas.md §9).
  if (p.offload_activations)
    for (const auto& st : est.stages)
      fmt::print("  activations stage {}: {} layers swap, {} recompute{}\n", st.stage,
                 p.swapped_layers(st.stage), p.recomputed_layers(st.stage),
                 p.swaps(st.stage) && st.swap.units_per_step == 0
                     ? std::string(" (nothing can swap here: keeps its stash)")
                 : p.swaps(st.stage)
                     ? fmt::format(" ({} units/step; copy {} each way vs shortest op {}; stall {} "
                                   "per step; host {})",
                                   st.swap.units_per_step, human_seconds(st.swap.copy_s),
                                   human_seconds(st.swap.window_s), human_seconds(st.swap.stall_s),
                                   human_bytes(double(st.swap.host_bytes)))
                     : "");
}

}  // namespace

void add_estimate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "estimate", "closed-form step time, throughput and per-device memory of a plan");
  auto a = std::make_shared<ScenarioOptions>();
  a->add(*cmd);
  cmd->callback([a, cmd] {
    Scenario sc = a->resolve(*cmd);
    planner::Estimate est = planner::estimate(sc.model, sc.trace, sc.cluster, sc.plan);
    print_estimate(est, sc.model, sc.cluster);
    if (!est.report.fits() && !a->allow_oom) throw PlanError(oom_message(est.report));
    est.report.extra["inputs"] = a->inputs(sc);
    if (!a->out.empty()) {
      common::write_json_file(a->out, planner::to_json(est.report));
      fmt::print("wrote {}\n", a->out);
    }
  });
}

void add_trace_command(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("trace", "write the analytic (roofline) trace of a model on a device");
  auto model = std::make_shared<std::string>();
  auto device = std::make_shared<std::string>();
  auto micro = std::make_shared<std::string>("1,2,4");
  auto out = std::make_shared<std::string>();
  auto tp = std::make_shared<int>(1);
  auto sp = std::make_shared<bool>(false);
  cmd->add_option("--model", *model, "model preset or JSON file")->required();
  cmd->add_option("--tp", *tp, "tensor-parallel size: times and bytes of one GPU of a TP group")
      ->capture_default_str()
      ->check(CLI::Range(1, 1'000'000));
  cmd->add_flag("--sp", *sp, "with sequence parallelism");
  cmd->add_option("--device", *device,
                  "device preset (V100-16GB, A100-80GB, H100-SXM, ...) or file")
      ->required();
  cmd->add_option("--microbatch", *micro, "microbatch sizes, comma-separated")
      ->capture_default_str();
  cmd->add_option("--out,-o", *out, "output file (default: standard output)");
  cmd->callback([=] {
    std::vector<std::int64_t> sizes = parse_int_list(*micro, "--microbatch");
    if (*sp && *tp == 1)
      throw InputError(
          "--sp: sequence parallelism splits a tensor-parallel group's work and "
          "needs --tp > 1");
    const models::ModelSpec m = models::load_model(*model);
    traces::Trace t = traces::analytic_trace(m, clusters::load_device(*device), sizes, {*tp, *sp});
    common::Json j = traces::to_json(t);
    if (out->empty()) {
      fmt::print("{}\n", j.dump(2));
    } else {
      common::write_json_file(*out, j);
      fmt::print("wrote {} ({} microbatch sizes)\n", *out, sizes.size());
    }
  });
}

}  // namespace pw::cli
