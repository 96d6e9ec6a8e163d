// Options shared by several subcommands and the human formatting of figures.
#include "cli/options.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <unistd.h>

#include "traces/analytic.hpp"

namespace pw::cli {

CLI::Validator finite_range(double lo, double hi, bool lo_open) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double v = 0;
        try {
          std::size_t used = 0;
          v = std::stod(text, &used);
          if (used != text.size()) return "\"" + text + "\" is not a number";
        } catch (const std::exception&) {
          // std::stod throws out_of_range for 1e400: a number, but not a finite one.
          return "\"" + text + "\" is not a finite number";
        }
        if (!std::isfinite(v)) return "\"" + text + "\" is not a finite number";
        if (v < lo || v > hi || (lo_open && v == lo))
          return fmt::format("{} is not in {}{}, {}]", text, lo_open ? "(" : "[", lo, hi);
        return std::string();
      },
      fmt::format("FLOAT in {}{}, {}]", lo_open ? "(" : "[", lo, hi));
}

void ClusterOptions::add(CLI::App& app, const std::string& default_cluster) {
  cluster = default_cluster;
  app.add_option("--cluster,-c", cluster,
                 "cluster preset (p3.16xlarge, dgx-a100, ...), NAME:NODES, or a JSON file")
      ->capture_default_str();
  app.add_option("--nodes", nodes, "number of nodes (overrides NAME:NODES and the file)")
      ->check(count_range());
  app.add_option("--set", sets,
                 "override a cluster field, e.g. --set network.bandwidth_bytes_per_s=1.25e10 "
                 "(repeatable)");
}

clusters::Cluster ClusterOptions::load() const {
  return clusters::load_cluster(cluster, nodes, sets);
}

void PlanOptions::add(CLI::App& app) {
  app.add_option("--plan,-p", plan_file, "plan JSON file (instead of the plan flags)");
  app.add_option("--schedule,-s", schedule, "gpipe, 1f1b, 2bw, interleaved or dp")
      ->capture_default_str();
  app.add_option("-w,--width", w, "data-parallel width (default: devices / d)")
      ->check(count_range());
  app.add_option("-d,--depth", d, "pipeline depth (default 1)")->check(count_range());
  app.add_option("-m,--microbatches", m, "microbatches per optimizer step (default d)")
      ->check(count_range());
  app.add_option("-b,--microbatch-size", b, "samples per microbatch")
      ->capture_default_str()
      ->check(count_range());
  app.add_option("-v,--chunks", v, "model chunks per device (interleaved)")->check(count_range());
  app.add_option("--tp", t, "tensor-parallel size (Megatron; a TP group stays inside a node)")
      ->capture_default_str()
      ->check(count_range());
  app.add_flag("--sp", sp, "sequence parallelism (needs --tp > 1)");
  app.add_option("--recompute", recompute,
                 "recompute activations on every stage: none, selective (attention core; not "
                 "with offload activations in train), full "
                 "(each stage keeps its input and re-makes its whole stash before a backward) or "
                 "block (each layer keeps its input and is re-made alone before its own backward: "
                 "Megatron's full recompute; not with the cuda backend in train); a bare "
                 "--recompute means full")
      ->expected(0, 1);
  app.add_flag("--distributed-optimizer", distributed_optimizer,
               "shard optimizer state and fp32 master weights over the data-parallel replicas "
               "(Megatron's distributed optimizer, ZeRO-1)");
  app.add_flag("--overlap-param-gather", overlap_param_gather,
               "with --distributed-optimizer: all-gather the new parameters behind the next "
               "step's forward, in pieces (Megatron's --overlap-param-gather; simulate, estimate "
               "and plan only)");
  app.add_option(
         "--offload", offload,
         "what lives in host memory: none; optimizer (ZeRO-Offload: gradients to host "
         "memory, CPU Adam, fp16 parameters back; with t > 1 each GPU its shard; with w > 1 "
         "sharded over the replicas, "
         "implying --distributed-optimizer); activations (KARMA: per "
         "stage, stashed activations swapped to the host or recomputed); or "
         "optimizer,activations; or chunks (PatrickStar: all model data in fixed-size chunks "
         "that move between host and device; each pipeline stage, and with t > 1 each GPU of "
         "its TP group, its own chunks, their optimizer state sharded over w > 1 replicas; "
         "interleaved: each device over its model chunks' layers; the cpu backend trains "
         "chunks, the cuda backend with w = 1 and m > 1, compile-checked only)")
      ->capture_default_str();
  app.add_option("--chunk-size", chunk_size,
                 "with --offload chunks: bytes of one parameter chunk in the model's dtype "
                 "(default: 64 Mi elements, 128 MiB for fp16, or the largest tensor rounded up "
                 "to a MiB; on a device too small for a layer at that size, the largest halving "
                 "of it that fits)")
      ->check(CLI::Range(std::int64_t{1}, common::kMaxBytes));
  app.add_flag("--chunk-shard", chunk_shard,
               "with --offload chunks and w > 1: each replica's host keeps only "
               "its part of each chunk's parameters (PatrickStar's data-parallel chunks): a chunk "
               "without a gradient yet is dropped instead of copied down and comes up as the "
               "replica's part and an all-gather; at the optimizer step only the replica's part "
               "of the reduce-scattered gradient goes down");
  app.add_option("--stage-blocks", stage_blocks,
                 "blocks per stage, comma-separated (default: balanced)")
      ->delimiter(',')
      ->check(count_range());
  app.add_option("--ranks-per-gpu", ranks_per_gpu,
                 "put this many ranks on each GPU (e.g. a 4-stage plan on one GPU)")
      ->capture_default_str()
      ->check(count_range());
}

bool PlanOptions::given_as_flags(const CLI::App& app) const {
  for (const char* name : {"--schedule", "-w", "-d", "-m", "-b", "-v", "--tp", "--sp",
                           "--recompute", "--distributed-optimizer", "--overlap-param-gather",
                           "--stage-blocks", "--offload", "--chunk-size", "--chunk-shard"})
    if (app.count(name) > 0) return true;
  return false;
}

planner::Plan PlanOptions::build(std::int64_t layers, int devices) const {
  planner::Plan p;
  if (!plan_file.empty()) {
    p = planner::load_plan(plan_file);
  } else {
    p.schedule = planner::parse_schedule(schedule);
    p.d = d.value_or(1);
    p.v = v.value_or(1);
    p.b = b;
    p.m = m.value_or(p.d);
    p.t = t;
    p.sp = sp;
    p.distributed_optimizer = distributed_optimizer;
    p.overlap_param_gather = overlap_param_gather;
    const planner::OffloadModes modes = planner::parse_offload_modes(offload);
    p.offload = modes.optimizer;
    p.offload_activations = modes.activations;
    p.chunk_bytes = chunk_size;
    p.chunk_shard = chunk_shard;
    const std::int64_t groups = std::int64_t(devices) * ranks_per_gpu / std::max(t, 1);
    // Clamped past the limit so that check() refuses it (an int must not wrap).
    p.w = w.value_or(p.d > 0 && groups % p.d == 0
                         ? int(std::clamp<std::int64_t>(groups / p.d, 1, common::kMaxCount + 1))
                         : 1);
    // Optimizer offload over w > 1 replicas shards the host optimizer (ZeRO-Offload): the
    // distributed optimizer, implied here (a plan file says it).
    if (p.offload == planner::Offload::optimizer && p.w > 1) p.distributed_optimizer = true;
    if (recompute) {
      const auto mode =
          recompute->empty() ? planner::Recompute::full : planner::parse_recompute(*recompute);
      if (mode != planner::Recompute::none) p.recompute.assign(std::size_t(std::max(p.d, 0)), mode);
    }
    p.stage_blocks = stage_blocks;
  }
  if (layers > 0)
    planner::resolve_stages(p, layers);
  else
    planner::check(p);
  return p;
}

void ScenarioOptions::add(CLI::App& app) {
  app.add_option("--model", model, "model preset or JSON file")->capture_default_str();
  app.add_option("--seq-len", seq_len, "override the model's sequence length (tokens per sample)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24));
  cluster.add(app, "p3.16xlarge:8");
  plan.add(app);
  app.add_option("--trace,-t", trace, "trace JSON (default: analytic for the cluster's device)");
  app.add_option("--out,-o", out, "write the run report (JSON) here");
  app.add_flag("--allow-oom", allow_oom,
               "exit 0 and write the report even when a device runs out of memory");
}

Scenario ScenarioOptions::resolve(const CLI::App& app) {
  const bool defaults = app.count("--model") == 0 && app.count("--cluster") == 0 &&
                        app.count("--nodes") == 0 && plan.plan_file.empty() &&
                        !plan.given_as_flags(app);
  if (defaults) {
    plan.schedule = "2bw";
    plan.d = 8;
    plan.m = 64;
    plan.b = 1;
    fmt::print("(default scenario: {} on {}, 2bw, w=8 d=8 b=1 m=64; see --help)\n", model,
               cluster.cluster);
  }
  Scenario sc{load_model_with(model, seq_len), cluster.load(), {}, {}};
  sc.plan = plan.build(sc.model.layers, sc.cluster.devices());
  planner::place(sc.plan, {sc.cluster.nodes, sc.cluster.gpus_per_node}, plan.ranks_per_gpu);
  sc.trace = load_or_make_trace(trace, sc.model, sc.cluster.device, sc.plan.b,
                                models::Sharding{sc.plan.t, sc.plan.sp});
  return sc;
}

common::Json ScenarioOptions::inputs(const Scenario& sc) const {
  common::Json j = {{"model", model},
                    {"cluster", cluster.cluster},
                    {"sets", cluster.sets},
                    {"device", sc.cluster.device.name},
                    {"device_spec", clusters::to_json(sc.cluster.device)},
                    {"trace", trace.empty() ? "analytic" : trace}};
  j["nodes"] = cluster.nodes ? common::Json(*cluster.nodes) : common::Json(nullptr);
  j["seq_len"] = seq_len ? common::Json(*seq_len) : common::Json(nullptr);
  return j;
}

std::string activation_list(const planner::Plan& p) {
  std::string out;
  for (std::size_t s = 0; s < p.activations.size(); ++s)
    out += (s ? "," : "") + (p.mixed_activations(int(s))
                                 ? fmt::format("{} swap+{} recompute", p.swapped_layers(int(s)),
                                               p.recomputed_layers(int(s)))
                                 : planner::to_string(p.activations[s]));
  return out;
}

std::string plan_summary(const planner::Plan& p) {
  return fmt::format("{}{} w={} d={} b={} m={}{}{}{}{}{}", to_string(p.schedule),
                     p.t > 1 ? fmt::format(" t={}{}", p.t, p.sp ? " sp" : "") : "", p.w, p.d, p.b,
                     p.m, p.v > 1 ? fmt::format(" v={}", p.v) : "",
                     p.distributed_optimizer ? " distributed-optimizer" : "",
                     p.overlap_param_gather ? " overlap-param-gather" : "",
                     p.any_offload() ? " offload=" + planner::offload_name(p) : "",
                     p.activations.empty() ? "" : " activations=" + activation_list(p));
}

std::string offload_summary(const planner::RunReport& r) {
  if (r.hosts.empty() || !r.extra.contains("offload")) return "";
  const common::Json& o = r.extra["offload"];
  std::string out;
  for (const auto& h : r.hosts)
    out +=
        fmt::format("  host (offload {}): node {} {} of {}, pinned {} of {}{}\n",
                    o["mode"].get<std::string>(), h.node, human_bytes(double(h.peak_memory_bytes)),
                    human_bytes(double(h.capacity_bytes)), human_bytes(double(h.pinned_bytes)),
                    human_bytes(double(h.pinned_capacity_bytes)), h.fits() ? "" : "  DOES NOT FIT");
  out += fmt::format("  moved per step: {} to the host, {} back to the devices{}\n",
                     human_bytes(o["copy_out_bytes_per_step"].get<double>()),
                     human_bytes(o["copy_in_bytes_per_step"].get<double>()),
                     o.value("activation_bytes_per_step", std::int64_t{0}) > 0
                         ? fmt::format(" ({} each way swapped activations)",
                                       human_bytes(o["activation_bytes_per_step"].get<double>()))
                         : "");
  // Chunks (PatrickStar): the schedule's figures (docs/formulas.md section 9, chunks).
  // With d > 1 ranks, a line per rank (each stage its own chunks).
  for (std::size_t r = 0; o.contains("ranks") && r < o["ranks"].size(); ++r) {
    if (!o["ranks"][r].contains("chunks")) break;
    const common::Json& c = o["ranks"][r]["chunks"];
    // Sharded chunks: how many of the copies are the replica's parts, and the drops.
    const std::string sharded =
        c.contains("part_bytes")
            ? fmt::format(
                  " ({} sharded in parts of {}: {} of the uploads and {} of the downloads "
                  "parts, {} dropped{})",
                  c["sharded_chunks"].get<int>(), human_bytes(c["part_bytes"].get<double>()),
                  c["part_uploads_per_step"].get<std::int64_t>(),
                  c["part_downloads_per_step"].get<std::int64_t>(),
                  c["drops_per_step"].get<std::int64_t>(),
                  c.contains("zero_fills_per_step")
                      ? fmt::format(", {} gradients zero-filled",
                                    c["zero_fills_per_step"].get<std::int64_t>())
                      : "")
            : "";
    out += fmt::format(
        "  {}chunks: {} x {}{} (the optimizer state of {} of them on the device); {} up and {} "
        "down per step "
        "({} s of copies exposed), CPU Adam {} s, optimizer step {} s\n",
        o["ranks"].size() > 1 ? fmt::format("rank {} ", r) : "", c["chunks"].get<int>(),
        human_bytes(c["chunk_bytes"].get<double>()), sharded, c["device_adam_chunks"].get<int>(),
        c["uploads_per_step"].get<std::int64_t>(), c["downloads_per_step"].get<std::int64_t>(),
        fmt::format("{:.3f}", c["copy_stall_s"].get<double>()),
        fmt::format("{:.3f}", c["cpu_adam_s"].get<double>()),
        fmt::format("{:.3f}", c["optimizer_s"].get<double>()));
  }
  return out;
}

std::string oom_message(const planner::RunReport& r) {
  const bool devices_fit = std::all_of(r.devices.begin(), r.devices.end(),
                                       [](const planner::DeviceReport& d) { return d.fits; });
  return fmt::format("the plan does not fit: {}; {}, or --allow-oom to write the report anyway",
                     planner::describe_oom(r),
                     devices_fit ? "use a host with more memory (--set host.memory_bytes=... or "
                                   "host.pinned_memory_bytes=...) or a plan without --offload"
                                 : "use --recompute, a deeper pipeline or a smaller -b");
}

std::function<void(int, int)> progress_bar(const std::string& what) {
  if (::isatty(STDERR_FILENO) != 1) return {};
  return [what](int done, int total) {
    const int width = 30, filled = total > 0 ? width * done / total : width;
    fmt::print(stderr, "\r[{}{}] {}/{} {}", std::string(std::size_t(filled), '#'),
               std::string(std::size_t(width - filled), '.'), done, total, what);
    if (done == total) fmt::print(stderr, "\n");
    std::fflush(stderr);
  };
}

models::ModelSpec load_model_with(const std::string& name, std::optional<std::int64_t> seq_len) {
  models::ModelSpec m = models::load_model(name);
  if (seq_len) {
    m.seq_len = *seq_len;
    models::validate(m, fmt::format("{} with --seq-len {}", name, *seq_len));
  }
  return m;
}

traces::Trace load_or_make_trace(const std::string& trace_file, const models::ModelSpec& model,
                                 const clusters::DeviceSpec& device, std::int64_t b,
                                 std::optional<models::Sharding> sharding) {
  if (trace_file.empty())
    return traces::analytic_trace(model, device, {b}, sharding.value_or(models::Sharding{}));
  traces::Trace t = traces::read_trace(trace_file);
  if (t.model != model.name)
    throw InputError(fmt::format("{}: /model: trace is for model \"{}\", not \"{}\"", trace_file,
                                 t.model, model.name));
  if (t.dtype != model.dtype)
    throw InputError(fmt::format("{}: /dtype: trace is in {}, but model {} trains in {}",
                                 trace_file, models::to_string(t.dtype), model.name,
                                 models::to_string(model.dtype)));
  if (sharding) traces::check_sharding(t, *sharding);
  if (t.device != device.name)
    fmt::print("note: trace {} was made on {}; the cluster's device is {} (its timings are used)\n",
               trace_file, t.device, device.name);
  return t;
}

std::vector<std::int64_t> parse_int_list(const std::string& text, const std::string& option) {
  std::vector<std::int64_t> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(pos, end - pos);
    try {
      std::size_t used = 0;
      long long v = std::stoll(item, &used);
      if (used != item.size() || v < 1) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      throw InputError(fmt::format("{}: \"{}\" is not a positive integer", option, item));
    }
    pos = end + 1;
  }
  return out;
}

}  // namespace pw::cli
