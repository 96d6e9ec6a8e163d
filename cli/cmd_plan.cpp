// `pipewright plan`: the fastest plan that fits, found by the closed form and proved by
// simulating the best candidates.
#include <map>
#include <memory>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "planner/search.hpp"
#include "sim/simulator.hpp"
#include "traces/analytic.hpp"

namespace pw::cli {

namespace {

struct PlanArgs {
  std::string model;
  ClusterOptions cluster;
  std::int64_t batch = 0;
  std::vector<std::string> schedules = {"2bw", "1f1b", "gpipe"};
  int top = 8;
  double within = 10;  // percent
  int max_simulated = 16;
  int steps = 3;
  int parallel = 0;
  std::string trace;
  std::string out;
  std::string ranked;
  std::vector<std::string> recompute_modes = {"none", "selective", "full", "block"};
  std::string sp = "both";
  std::string dopt = "both";
  planner::SearchOptions search;
};

std::vector<bool> on_off(const std::string& s) {
  if (s == "on") return {true};
  if (s == "off") return {false};
  return {false, true};
}

using TraceMap = std::map<std::pair<int, bool>, traces::Trace>;  // by (t, sp)

planner::SimulateFn simulate_fn(const Scenario& base, std::shared_ptr<const TraceMap> traces,
                                double headroom, int steps, int parallel) {
  return [=](const std::vector<planner::Plan>& plans) {
    std::vector<sim::SimJob> jobs;
    for (const auto& p : plans)
      jobs.push_back(
          {base.model, traces->at({p.t, p.sp}), base.cluster, p, sim::SimOptions{.steps = steps}});
    const auto outcomes = sim::simulate_batch(jobs, parallel, progress_bar("plans simulated"));
    const double usable = double(base.cluster.device.memory_bytes) * (1.0 - headroom);
    std::vector<planner::Simulated> out;
    for (const auto& o : outcomes) {
      planner::Simulated s;
      s.ok = o.ok;
      s.error = o.error;
      if (o.ok) {
        s.samples_per_s = o.result.report.samples_per_s;
        s.iteration_time_s = o.result.report.iteration_time_s;
        for (const auto& d : o.result.report.devices)
          s.peak_memory_bytes = std::max(s.peak_memory_bytes, d.peak_memory_bytes);
        s.fits = double(s.peak_memory_bytes) <= usable;
        for (const auto& h : o.result.report.hosts)
          s.fits = s.fits && h.fits();
      }
      out.push_back(s);
    }
    return out;
  };
}

// The schedule column: the schedule and what else sets plans of one shape apart (" by-time": the
// blocks split over the stages by time, planner::time_balanced_split, not evenly).
std::string plan_label(const planner::Plan& p) {
  std::int64_t layers = 0;
  for (std::int64_t blocks : p.stage_blocks)
    layers += blocks;
  const bool by_time =
      !p.stage_blocks.empty() &&
      p.stage_blocks != planner::balanced_split(layers, int(p.stage_blocks.size()));
  return fmt::format("{}{}{}{}{}{}", to_string(p.schedule),
                     p.v > 1 ? fmt::format(" v={}", p.v) : "",
                     p.distributed_optimizer ? " dopt" : "",
                     p.any_offload() ? " offload=" + planner::offload_name(p) : "",
                     p.chunk_shard ? " shard" : "", by_time ? " by-time" : "");
}

std::string tp_label(const planner::Plan& p) {
  return fmt::format("{}{}", p.t, p.sp ? "+sp" : "");
}

const char* rc_label(const planner::Plan& p) {
  switch (p.recompute_of(0)) {
    case planner::Recompute::full:
      return "full";
    case planner::Recompute::block:
      return "blk";
    case planner::Recompute::selective:
      return "sel";
    case planner::Recompute::none:
      break;
  }
  return "no";
}

void print_ranked(const std::vector<planner::Ranked>& ranked, std::size_t rows) {
  // The schedule column as wide as its longest label (offload modes make them long).
  std::size_t width = 20;
  for (std::size_t i = 0; i < std::min(rows, ranked.size()); ++i)
    width = std::max(width, plan_label(ranked[i].candidate.plan).size());
  fmt::print("  {:>4} {:<{}} {:>5} {:>4} {:>4} {:>4} {:>5} {:>4} {:>12} {:>12} {:>12} {:>5}\n",
             "rank", "schedule", width, "t", "w", "d", "b", "m", "rc", "est samp/s", "sim samp/s",
             "peak mem", "fits");
  for (std::size_t i = 0; i < std::min(rows, ranked.size()); ++i) {
    const auto& r = ranked[i];
    const auto& p = r.candidate.plan;
    const bool sim = r.simulated && r.simulated->ok;
    fmt::print(
        "  {:>4} {:<{}} {:>5} {:>4} {:>4} {:>4} {:>5} {:>4} {:>12.2f} {:>12} {:>12} {:>5}\n", i + 1,
        plan_label(p), width, tp_label(p), p.w, p.d, p.b, p.m, rc_label(p),
        r.candidate.samples_per_s(), sim ? fmt::format("{:.2f}", r.simulated->samples_per_s) : "-",
        human_bytes(double(sim ? r.simulated->peak_memory_bytes : r.candidate.peak_memory_bytes())),
        r.simulated ? (r.simulated->ok && r.simulated->fits ? "yes" : "NO") : "yes*");
  }
  if (ranked.size() > rows) fmt::print("  ... {} more that fit\n", ranked.size() - rows);
}

common::Json ranked_json(const PlanArgs& a, const Scenario& sc, const planner::SearchResult& res,
                         const std::vector<planner::Ranked>& ranked, int simulated) {
  common::Json rows = common::Json::array();
  for (std::size_t i = 0; i < ranked.size(); ++i) {
    const auto& r = ranked[i];
    common::Json row = {
        {"rank", i + 1},
        {"plan", planner::to_json(r.candidate.plan)},
        {"estimated_samples_per_s", r.candidate.samples_per_s()},
        {"estimated_iteration_time_s", r.candidate.estimate.report.iteration_time_s},
        {"estimated_peak_memory_bytes", r.candidate.peak_memory_bytes()},
        {"simulated", r.simulated.has_value()}};
    if (r.simulated) {
      row["simulation_ok"] = r.simulated->ok;
      if (r.simulated->ok) {
        row["simulated_samples_per_s"] = r.simulated->samples_per_s;
        row["simulated_iteration_time_s"] = r.simulated->iteration_time_s;
        row["simulated_peak_memory_bytes"] = r.simulated->peak_memory_bytes;
      } else {
        row["error"] = r.simulated->error;
      }
    }
    row["fits"] = !r.simulated || (r.simulated->ok && r.simulated->fits);
    rows.push_back(row);
  }
  common::Json j = {{"format", "pipewright.ranked/1"},
                    {"model", sc.model.name},
                    {"cluster", fmt::format("{}:{}", sc.cluster.name, sc.cluster.nodes)},
                    {"global_batch", a.batch},
                    {"memory_headroom", a.search.memory_headroom},
                    {"candidates_considered", res.considered},
                    {"candidates_fitting", res.fitting.size()},
                    {"simulated_top", a.top},
                    {"simulated_within_percent", a.within},
                    {"simulated", simulated},
                    {"rows", rows}};
  // Written only when the search went on to optimizer offload: why.
  if (!res.offload_reason.empty()) j["offload_reason"] = res.offload_reason;
  if (!res.swap_reason.empty()) j["swap_reason"] = res.swap_reason;
  return j;
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "plan", "find the fastest plan that fits: closed-form search, best candidates simulated");
  auto a = std::make_shared<PlanArgs>();
  cmd->add_option("--model", a->model, "model preset or JSON file")->required();
  a->cluster.add(*cmd, "p3.16xlarge:8");
  cmd->add_option("--batch,-B", a->batch, "global batch size B = w*m*b")
      ->required()
      ->check(CLI::Range(std::int64_t{1}, common::kMaxCount * common::kMaxCount));
  cmd->add_option("--schedules", a->schedules, "schedules to consider, comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--top", a->top,
                  "simulate at least this many of the best closed-form candidates (0: none)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, common::kMaxCount));
  cmd->add_option("--within", a->within,
                  "also simulate every candidate whose closed form is within this many percent "
                  "of the best's")
      ->capture_default_str()
      ->check(finite_range(0, 100));
  cmd->add_option("--max-simulated", a->max_simulated,
                  "simulate at most this many candidates (or --top, if larger)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, common::kMaxCount));
  cmd->add_option("--max-microbatch", a->search.max_microbatch, "largest microbatch size b")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--memory-headroom", a->search.memory_headroom,
                  "fraction of device memory to keep free, in [0, 1)")
      ->capture_default_str()
      ->check(finite_range(0, 0.999999));
  cmd->add_option("--depth,-d", a->search.depths,
                  "only plans with these pipeline depths (one or a comma-separated list)")
      ->delimiter(',')
      ->check(count_range());
  cmd->add_option("--width,-w", a->search.widths,
                  "only plans with these data-parallel widths (one or a list)")
      ->delimiter(',')
      ->check(count_range());
  cmd->add_option("--tp", a->search.tensor_parallel,
                  "only these tensor-parallel sizes (one or a list; default: every t that divides "
                  "the GPUs per node and the model)")
      ->delimiter(',')
      ->check(count_range());
  cmd->add_option(
         "--recompute", a->recompute_modes,
         "recompute modes to consider, comma-separated (none, selective, full, block); with "
         "fused attention selective equals none and is left out where none is listed")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--sp", a->sp, "sequence parallelism where t > 1: on, off or both")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off", "both"}));
  cmd->add_option("--distributed-optimizer", a->dopt,
                  "the distributed optimizer where w > 1: on, off or both")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off", "both"}));
  cmd->add_option("--chunks", a->search.chunks, "v values tried for interleaved")
      ->delimiter(',')
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--ranks-per-gpu", a->search.ranks_per_gpu, "ranks sharing each GPU")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--trace,-t", a->trace, "trace JSON (default: analytic, every b)");
  cmd->add_option("--steps", a->steps, "optimizer steps per simulation")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--parallel", a->parallel, "simulations at once (default: cores)")
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--out,-o", a->out, "write the winning plan (a plan file) here");
  cmd->add_option("--ranked", a->ranked, "write every fitting candidate, ranked, as JSON here");
  cmd->callback([a] {
    a->search.global_batch = a->batch;
    a->search.schedules.clear();
    for (const auto& s : a->schedules)
      a->search.schedules.push_back(planner::parse_schedule(s));
    a->search.recompute.clear();
    for (const auto& r : a->recompute_modes)
      a->search.recompute.push_back(planner::parse_recompute(r));
    a->search.sequence_parallel = on_off(a->sp);
    a->search.distributed_optimizer = on_off(a->dopt);
    Scenario sc{models::load_model(a->model), a->cluster.load(), {}, {}};
    std::vector<std::int64_t> sizes;
    for (int b = 1; b <= a->search.max_microbatch; b *= 2)
      sizes.push_back(b);
    // One trace per sharding the search tries (each simulation gets its plan's).
    auto traces = std::make_shared<TraceMap>();
    if (!a->trace.empty()) {
      traces::Trace t = load_or_make_trace(a->trace, sc.model, sc.cluster.device, 1);
      (*traces)[{t.sharding.t, t.sharding.sp}] = t;
      a->search.tensor_parallel = {t.sharding.t};
      a->search.sequence_parallel = {t.sharding.sp};
    }
    const planner::TraceFn trace_for = [&](const models::Sharding& s) {
      auto it = traces->find({s.t, s.sp});
      if (it == traces->end())
        it = traces
                 ->emplace(std::make_pair(s.t, s.sp),
                           traces::analytic_trace(sc.model, sc.cluster.device, sizes, s))
                 .first;
      return it->second;
    };
    const planner::SearchResult res =
        planner::search_plans(sc.model, trace_for, sc.cluster, a->search);
    fmt::print("{} on {} ({} x {} x {}), global batch {}: {} candidate plans, {} fit in memory\n",
               sc.model.name, sc.cluster.name, sc.cluster.nodes, sc.cluster.gpus_per_node,
               sc.cluster.device.name, a->batch, res.considered, res.fitting.size());
    if (!res.offload_reason.empty()) {
      // Said before anything else: the plans below keep the optimizer in host memory.
      fmt::print("without offload {}\n", res.offload_reason);
      fmt::print(
          "so the search tried --offload activations (KARMA: per stage, stashed activations "
          "swapped to host memory where the copies hide behind compute, recomputed elsewhere), "
          "optimizer (ZeRO-Offload: fp16 parameters on the GPU, optimizer state and CPU Adam "
          "in host memory; sharded over the replicas where w > 1), both (with t > 1 each GPU "
          "of a TP group its own shard), and "
          "chunks (PatrickStar: all model data "
          "in fixed-size chunks that move between host and device by an eviction plan, Adam on "
          "the host for the chunks whose state does not fit; each pipeline stage, and with "
          "t > 1 each GPU of its TP group, its own chunks, their optimizer state sharded over "
          "w > 1 replicas, and with w > 1 also the chunks' parameters (--chunk-shard, not with "
          "2bw); the default chunk size, or the largest halving of it at which every "
          "layer's working set fits): {} fit\n",
          res.fitting.size());
      if (!res.fitting.empty())
        fmt::print("the fastest that fits offloads {}\n",
                   planner::offload_name(res.fitting.front().plan));
    }
    if (!res.swap_reason.empty())
      fmt::print("{}; the fastest that fits {}\n", res.swap_reason,
                 res.fitting.front().plan.offload_activations
                     ? "swaps (activations " + activation_list(res.fitting.front().plan) + ")"
                     : "does not offload");
    if (res.fitting.empty())
      throw PlanError("plan: " + (res.offload_reason.empty()
                                      ? planner::explain_no_fit(res)
                                      : "with offload too, " + planner::explain_no_fit(res)));
    const int simulated =
        planner::simulated_count(res, a->top, a->within / 100.0, a->max_simulated);
    if (simulated > 0)
      fmt::print(
          "simulating {} candidates (the best {}, and those within {}% of the best's closed "
          "form, at most {})\n",
          simulated, a->top, a->within, std::max(a->top, a->max_simulated));
    const auto ranked = planner::rank_by_simulation(
        res, simulated, simulate_fn(sc, traces, a->search.memory_headroom, a->steps, a->parallel));
    print_ranked(ranked, std::size_t(std::max(simulated, 10)));
    const planner::Ranked& best = ranked.front();
    if (best.simulated && !best.simulated->ok)
      throw PlanError(fmt::format("plan: none of the {} simulated candidates ran: {}", simulated,
                                  best.simulated->error));
    if (best.simulated && !best.simulated->fits)
      throw PlanError(fmt::format(
          "plan: none of the {} simulated candidates ran within memory: over capacity", simulated));
    const planner::Plan& p = best.candidate.plan;
    fmt::print(
        "best: {} t={} w={} d={} b={} m={}{}{}: {:.2f} samples/s {}\n", plan_label(p), tp_label(p),
        p.w, p.d, p.b, p.m,
        p.any_offload()
            ? " --offload " + planner::offload_name(p) +
                  (p.activations.empty() ? "" : " (activations " + activation_list(p) + ")") +
                  (p.chunk_bytes > 0 ? fmt::format(" --chunk-size {}", p.chunk_bytes) : "") +
                  (p.chunk_shard ? " --chunk-shard" : "")
            : "",
        p.recompute_of(0) == planner::Recompute::none
            ? ""
            : fmt::format(" with {} recompute", to_string(p.recompute_of(0))),
        best.simulated ? best.simulated->samples_per_s : best.candidate.samples_per_s(),
        best.simulated ? "(simulated)" : "(closed form)");
    if (!a->out.empty()) {
      common::write_json_file(a->out, planner::to_json(p));
      fmt::print("wrote {}\n", a->out);
    }
    if (!a->ranked.empty()) {
      common::write_json_file(a->ranked, ranked_json(*a, sc, res, ranked, simulated));
      fmt::print("wrote {}\n", a->ranked);
    }
  });
}

}  // namespace pw::cli
