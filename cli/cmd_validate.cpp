// `pipewright validate --backend cpu`: profile this machine, simulate the plan on a cluster
// description of it (its cores as devices, the in-process transport as the link; under
// `mpirun -np N` N one-core nodes joined by the MPI link, measured by a ping-pong), train the plan
// for real, and compare predicted with measured step time, busy time and peak memory per rank.
// `pipewright validate --predicted sim.json --measured measured.json` compares two reports.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/backend.hpp"
#include "cli/commands.hpp"
#include "cli/measured_report.hpp"
#include "cli/options.hpp"
#include "exec/gpt_layout.hpp"
#include "exec/gpu_host.hpp"
#include "exec/machine_load.hpp"
#include "exec/mpi/launch.hpp"
#include "exec/mpi/probe.hpp"
#include "exec/probe.hpp"
#include "exec/profile.hpp"
#include "exec/run_common.hpp"
#include "exec/runtime.hpp"
#ifdef PW_HAVE_CUDA
#include "exec/cuda/probe.hpp"
#include "exec/cuda/profile.hpp"
#endif
#include "planner/chunks.hpp"
#include "planner/validation.hpp"
#include "sim/simulator.hpp"

namespace pw::cli {

namespace {

struct ValidateArgs {
  std::string model = "gpt-tiny";
  PlanOptions plan;
  std::string backend = "cpu";
  exec::TrainOptions train;
  std::string microbatch;  // profiled sizes; default: the plan's b
  int repeats = 20;
  std::string statistic = "mean";
  int round_trips = 200;
  std::string trace;  // a trace to use instead of profiling
  std::string out, trace_out, simulated_out, measured_out, cluster_out;
  std::string predicted, measured;  // file mode
  bool pin_cores = true;            // threads: rank r's thread on the core it is simulated on
  int blocks = 3;                   // profile + train rounds, taking turns
};

std::string percent(double error) {
  return std::isnan(error) ? "n/a" : fmt::format("{:+.1f}%", 100 * error);
}

// " t=2+sp" for a tensor-parallel plan, "" at t = 1.
std::string tp_text(const planner::Plan& p) {
  return p.t > 1 ? fmt::format(" t={}{}", p.t, p.sp ? "+sp" : "") : "";
}

void print_validation(const planner::Validation& v) {
  const auto& p = v.plan;
  fmt::print("{} {}{} w={} d={} b={} m={}: {} vs {}, error = (predicted - measured) / measured\n",
             v.model, to_string(p.schedule), tp_text(p), p.w, p.d, p.b, p.m, v.predicted_source,
             v.measured_source);
  fmt::print("  {:<19} {:>11} {:>11} {:>8}\n", "", "predicted", "measured", "error");
  auto row = [](const char* what, const planner::Compared& c) {
    fmt::print("  {:<19} {:>11} {:>11} {:>8}\n", what, human_seconds(c.predicted),
               human_seconds(c.measured), percent(c.error));
  };
  row("step time", v.iteration_time_s);
  if (v.has_median_step) row("vs the median step", v.median_step_time_s);
  fmt::print("  {:<19} {:>11.1f} {:>11.1f} {:>8}\n", "samples/s", v.samples_per_s.predicted,
             v.samples_per_s.measured, percent(v.samples_per_s.error));
  if (v.has_copies)
    fmt::print("  {:<19} {:>11} {:>11} {:>8}\n", "copied per step",
               human_bytes(v.copy_bytes_per_step.predicted),
               human_bytes(v.copy_bytes_per_step.measured), percent(v.copy_bytes_per_step.error));
  if (v.measured_step_times_s.size() > 1) {
    const auto [lo, hi] =
        std::minmax_element(v.measured_step_times_s.begin() + 1, v.measured_step_times_s.end());
    fmt::print("  measured steps after the first: {} .. {}; the first: {}\n", human_seconds(*lo),
               human_seconds(*hi), human_seconds(v.measured_step_times_s.front()));
  }
  fmt::print("  {:>4} {:>5}  {:>10} {:>10} {:>7}  {:>6} {:>6}  {:>10} {:>10} {:>7}\n", "rank",
             "stage", "busy pred", "busy meas", "error", "bubble", "meas", "peak pred", "peak meas",
             "error");
  // t > 1: a row per GPU of each TP group, "rank.tp".
  const auto name = [&](const planner::DeviceValidation& d) {
    return p.t > 1 ? fmt::format("{}.{}", d.rank, d.tp) : fmt::format("{}", d.rank);
  };
  for (const auto& d : v.devices)
    fmt::print("  {:>4} {:>5}  {:>10} {:>10} {:>7}  {:>5.1f}% {:>5.1f}%  {:>10} {:>10} {:>7}\n",
               name(d), d.stage, human_seconds(d.busy_s.predicted),
               human_seconds(d.busy_s.measured), percent(d.busy_s.error),
               100 * d.bubble_fraction.predicted, 100 * d.bubble_fraction.measured,
               human_bytes(d.peak_memory_bytes.predicted),
               human_bytes(d.peak_memory_bytes.measured), percent(d.peak_memory_bytes.error));
  // Where the step time error comes from: the busiest rank's compute (the profile against the
  // run) and the rest of its step (waiting, transfers and the runtime's own work).
  const auto busiest = std::max_element(
      v.devices.begin(), v.devices.end(),
      [](const auto& a, const auto& b) { return a.busy_s.measured < b.busy_s.measured; });
  if (busiest != v.devices.end())
    fmt::print(
        "  busiest rank {}: compute {} predicted, {} measured ({}); the rest of the step {} "
        "predicted, {} measured\n",
        name(*busiest), human_seconds(busiest->busy_s.predicted),
        human_seconds(busiest->busy_s.measured), percent(busiest->busy_s.error),
        human_seconds(std::max(0.0, v.iteration_time_s.predicted - busiest->busy_s.predicted)),
        human_seconds(std::max(0.0, v.iteration_time_s.measured - busiest->busy_s.measured)));
  fmt::print(
      "  step time error {}, largest busy error {:.1f}%, largest peak memory error {:.1f}%\n",
      percent(v.iteration_time_s.error), 100 * v.max_abs_busy_error, 100 * v.max_abs_memory_error);
}

common::Json or_null(const std::string& path) {
  return path.empty() ? common::Json(nullptr) : common::Json(path);
}

// --predicted A --measured B: no run, just the subtraction.
void compare_files(const ValidateArgs& a) {
  const planner::RunReport predicted =
      planner::parse_report(common::read_json_file(a.predicted), a.predicted);
  const planner::RunReport measured =
      planner::parse_report(common::read_json_file(a.measured), a.measured);
  const planner::Validation v = planner::validate(predicted, measured, a.predicted, a.measured);
  print_validation(v);
  if (!a.out.empty()) {
    common::write_json_file(
        a.out,
        planner::to_json(v, nullptr, {{"predicted", a.predicted}, {"measured", a.measured}}));
    fmt::print("wrote {}\n", a.out);
  }
}

// Rank r on core r; with more ranks than cores, consecutive ranks (neighbouring stages) share a
// core, as evenly as the counts allow (exec::cores_for_ranks: the threads are pinned the same way).
std::vector<planner::Placement> place_on_cores(int ranks, int cores) {
  std::vector<int> indices(std::size_t(std::max(cores, 1)));
  for (std::size_t i = 0; i < indices.size(); ++i)
    indices[i] = int(i);
  std::vector<planner::Placement> out;
  for (int c : exec::cores_for_ranks(ranks, indices))
    out.push_back({0, c});
  return out;
}

// What validate measured about this machine to describe it as a cluster.
struct Machine {
  clusters::Cluster cluster;
  exec::TransportFit link;
  std::vector<planner::Placement> placement;
  int devices = 1, per_device = 1;  // devices of the cluster; the most ranks sharing one
  common::Json json;                // the validation file's "machine" entries of this backend
};

// cpu: its cores as devices, the in-process transport as their link, one core's GEMM rate.
Machine probe_cpu(const planner::Plan& plan, const std::vector<std::int64_t>& probe_sizes,
                  int round_trips) {
  Machine m;
  m.devices = exec::hardware_threads();
  fmt::print("probing the in-process transport ({} sizes up to {}, {} round trips each)...\n",
             probe_sizes.size(), human_bytes(double(probe_sizes.back())), round_trips);
  std::fflush(stdout);
  m.link = exec::measure_in_process_transport(probe_sizes, round_trips);
  const double gemm = exec::measure_sgemm_flops_per_s();
  m.cluster = exec::cpu_host_cluster(m.devices, m.link, gemm);
  fmt::print("  latency {}, bandwidth {}; fp32 GEMM {} per core\n", human_seconds(m.link.latency_s),
             human_rate(m.link.bandwidth_bytes_per_s, "B"), human_rate(gemm, "FLOP"));
  if (plan.t == 1) {
    m.placement = place_on_cores(plan.ranks(), m.devices);
  } else {
    // A TP group's t threads each on a core of its own (a group shares no GPU, planner::place;
    // run_and_compare checked that they fit), the groups one after the other: rank r on cores
    // r*t .. r*t + t - 1.
    for (int r = 0; r < plan.ranks(); ++r)
      m.placement.push_back({0, r * plan.t});
  }
  m.json = {{"cores", m.devices}, {"gemm_flops_per_s", gemm}};
  return m;
}

// cpu under `mpirun -np N` (one rank per process): N / t nodes of t one-core devices each (a TP
// group is a node's, as the planner places it), every link the MPI link as ranks 0 and 1 measure
// it with a ping-pong (latency and bandwidth: the network, and with t > 1 the nodes' own link,
// which the TP collectives take).
Machine probe_mpi(const planner::Plan& plan, const std::vector<std::int64_t>& probe_sizes,
                  int round_trips, const exec::MpiSession& job) {
  Machine m;
  m.devices = job.size();
  fmt::print(
      "probing the MPI link between ranks 0 and 1 ({} sizes up to {}, {} round trips each)...\n",
      probe_sizes.size(), human_bytes(double(probe_sizes.back())), round_trips);
  std::fflush(stdout);
  m.link = exec::measure_mpi_transport(job, probe_sizes, round_trips);
  const double gemm = exec::measure_sgemm_flops_per_s();
  m.cluster = exec::cpu_host_cluster(plan.t, m.link, gemm);
  m.cluster.name = fmt::format("mpi-{}-nodes", job.size() / plan.t);
  m.cluster.nodes = job.size() / plan.t;
  if (plan.t == 1) {
    m.cluster.intra_node = {};
    m.cluster.intra_node.kind = clusters::IntraKind::none;
  }
  m.cluster.network.nic_per = clusters::NicPer::node;
  m.cluster.network.bandwidth_bytes_per_s = m.link.bandwidth_bytes_per_s;
  m.cluster.network.latency_s = m.link.latency_s;
  m.cluster.network.oversubscription = 1;
  m.cluster.network.efficiency = 1;
  // The ranks send inline: a send holds the rank for as long as its call took in the ping-pong.
  m.cluster.network.send_overhead_s = m.link.send_overhead_s;
  m.cluster.network.send_overhead_bytes_per_s = m.link.send_overhead_bytes_per_s;
  m.cluster.notes = fmt::format(
      "the processes of an mpirun job as measured by pipewright validate: {} nodes of {} one-core "
      "devices (rank 0's single-threaded OpenBLAS sgemm rate) joined by the MPI link between "
      "ranks 0 and 1 (MpiTransport ping-pong fit: {:.3g} us + bytes / {:.3g} MB/s; a send holds "
      "its rank {:.3g} us + bytes / {:.3g} MB/s)",
      m.cluster.nodes, plan.t, m.link.latency_s * 1e6, m.link.bandwidth_bytes_per_s / 1e6,
      m.link.send_overhead_s * 1e6, m.link.send_overhead_bytes_per_s / 1e6);
  fmt::print(
      "  latency {}, bandwidth {}; a send holds its rank {} + bytes / {}; fp32 GEMM {} per "
      "core\n",
      human_seconds(m.link.latency_s), human_rate(m.link.bandwidth_bytes_per_s, "B"),
      human_seconds(m.link.send_overhead_s),
      m.link.send_overhead_bytes_per_s > 0 ? human_rate(m.link.send_overhead_bytes_per_s, "B")
                                           : std::string("(no per-byte part)"),
      human_rate(gemm, "FLOP"));
  for (int r = 0; r < plan.ranks(); ++r)
    m.placement.push_back({r, 0});
  m.json = {{"processes", job.size()}, {"gemm_flops_per_s", gemm}};
  return m;
}

// validate under mpirun, ranks other than 0: wait while rank 0 profiles, take part in the
// ping-pong, wait while it simulates, train (rank 0 compares and writes).
// The load other processes put on the machine during one phase (profiling, training). Under
// mpirun every rank sends rank 0 its machine's counters and its own CPU time; per machine (boot
// id), the job's CPU time is its ranks' sum, and the busiest machine is reported by host name.
// Every rank calls it at the same point.
struct PhaseLoad {
  exec::OtherLoad load;
  std::string host;
};

PhaseLoad phase_load(const exec::CpuCounters& before, const exec::MpiSession* job) {
  const exec::CpuCounters after = exec::read_cpu_counters();
  const double own = after.process_cpu_s - before.process_cpu_s;
  if (!job) return {exec::other_load(before, after, own), after.host};
  const common::Json mine = {
      {"host", after.host},
      {"machine", after.machine},
      {"cpus", after.cpus},
      {"tick_s", after.tick_s},
      {"own", own},
      {"before", {before.wall_s, before.busy_s, before.steal_s, before.total_s}},
      {"after", {after.wall_s, after.busy_s, after.steal_s, after.total_s}}};
  const std::vector<std::string> all = job->gather(mine.dump(), 0);
  PhaseLoad worst;
  if (job->rank() != 0) return worst;
  // By machine (ranks in network namespaces of one machine share it): first report, job CPU.
  std::map<std::string, std::pair<common::Json, double>> hosts;
  for (const std::string& text : all) {
    const common::Json j = common::Json::parse(text);
    auto [it, fresh] = hosts.try_emplace(j.at("machine").get<std::string>(), j, 0.0);
    it->second.second += j.at("own").get<double>();
  }
  for (const auto& [machine, entry] : hosts) {
    const common::Json& j = entry.first;  // (a structured binding: clang 14 cannot capture it)
    const double job_cpu = entry.second;
    auto counters = [&](const char* key) {
      exec::CpuCounters c;
      c.wall_s = j.at(key).at(0).get<double>();
      c.busy_s = j.at(key).at(1).get<double>();
      c.steal_s = j.at(key).at(2).get<double>();
      c.total_s = j.at(key).at(3).get<double>();
      c.cpus = j.at("cpus").get<int>();
      c.tick_s = j.at("tick_s").get<double>();
      return c;
    };
    const exec::OtherLoad l = exec::other_load(counters("before"), counters("after"), job_cpu);
    if (worst.host.empty() || l.others > worst.load.others)
      worst = {l, j.at("host").get<std::string>()};
  }
  return worst;
}

std::string load_text(const exec::OtherLoad& l) {
  if (!l.known) return "unknown";
  // /proc/stat counts whole ticks of every CPU: a short phase is known only this closely.
  return l.resolution > 0.02
             ? fmt::format("{:.0f}% (+-{:.0f}%)", 100 * l.others, 100 * l.resolution)
             : fmt::format("{:.0f}%", 100 * l.others);
}

common::Json load_json(const PhaseLoad& p) {
  if (!p.load.known) return nullptr;
  return {{"others", p.load.others},
          {"steal", p.load.steal},
          {"wall_s", p.load.wall_s},
          {"resolution", p.load.resolution},
          {"host", p.host}};
}

// Above this share of the machine taken by others, validate warns that its error includes them.
constexpr double kBusyMachine = 0.05;

// The phases of several blocks as one: others' and steal's shares weighted by each phase's wall
// time, the resolution that of the summed wall time, the busiest machine's name.
PhaseLoad combined(const std::vector<PhaseLoad>& phases) {
  PhaseLoad out;
  double wall = 0, others = 0, steal = 0, busiest = -1;
  bool known = !phases.empty();
  for (const PhaseLoad& p : phases) {
    known = known && p.load.known;
    wall += p.load.wall_s;
    others += p.load.others * p.load.wall_s;
    steal += p.load.steal * p.load.wall_s;
    if (p.load.others > busiest) {
      busiest = p.load.others;
      out.host = p.host;
    }
  }
  out.load.known = known;
  if (!known || wall <= 0) return out;
  out.load.wall_s = wall;
  out.load.others = others / wall;
  out.load.steal = steal / wall;
  double inverse = 0;  // resolution = tick / wall, so 1 / resolution adds up
  for (const PhaseLoad& p : phases)
    if (p.load.resolution > 0) inverse += 1 / p.load.resolution;
  out.load.resolution = inverse > 0 ? 1 / inverse : 0;
  return out;
}

// Appends one block's training run to the runs before it: its steps (the first marked as a
// warm-up, left out of the steady state as the first step of the first run is), the ranks' busy
// time and bytes moved summed, peaks the highest, weights and timeline the last block's.
void append_block(exec::TrainResult& all, exec::TrainResult&& block) {
  if (all.steps.empty()) {
    all = std::move(block);
    return;
  }
  for (std::size_t i = 0; i < block.steps.size(); ++i) {
    exec::StepLog s = block.steps[i];
    s.warm_up = i == 0;
    all.steps.push_back(std::move(s));
  }
  for (std::size_t r = 0; r < all.ranks.size() && r < block.ranks.size(); ++r) {
    exec::RankResult& to = all.ranks[r];
    exec::RankResult& from = block.ranks[r];
    if (from.peak_memory_bytes > to.peak_memory_bytes) {
      to.peak_memory_bytes = from.peak_memory_bytes;
      to.memory = from.memory;
    }
    to.busy_s += from.busy_s;
    to.host_peak_memory_bytes = std::max(to.host_peak_memory_bytes, from.host_peak_memory_bytes);
    to.copy_out_bytes += from.copy_out_bytes;
    to.copy_in_bytes += from.copy_in_bytes;
    to.activation_out_bytes += from.activation_out_bytes;
    to.activation_in_bytes += from.activation_in_bytes;
    to.edge_copy_out_bytes += from.edge_copy_out_bytes;  // each block fills and drains again
    to.edge_copy_in_bytes += from.edge_copy_in_bytes;
    to.edge_steps += from.edge_steps;
    to.weights = std::move(from.weights);
    to.timeline = std::move(from.timeline);
  }
  all.wall_s += block.wall_s;
}

// validate under mpirun, ranks other than 0: the phases of rank 0 in the same order (profile of
// the first block, the ping-pong, then each block's training and the next block's profile);
// rank 0 simulates and compares alone at the end.
void follow_validate(const ValidateArgs& a, const exec::MpiSession& job,
                     const models::ModelSpec& model, const planner::Plan& plan) {
  auto wait_profile = [&] {
    const exec::CpuCounters profile_start = exec::read_cpu_counters();
    exec::wait_for_all(job, "wait for rank 0's profile");
    phase_load(profile_start, &job);
  };
  wait_profile();
  std::int64_t sizes[4] = {};
  job.broadcast(sizes, int(sizeof sizes), 0);
  exec::measure_mpi_transport(job, {sizes[0], sizes[1], sizes[2], sizes[3]}, a.round_trips);
  for (int k = 0; k < a.blocks; ++k) {
    if (k > 0) wait_profile();
    const exec::CpuCounters train_start = exec::read_cpu_counters();
    train_on(a.backend, model, plan, a.train, print_step);
    phase_load(train_start, &job);
  }
}

#ifdef PW_HAVE_CUDA
// cuda: the one GPU as the only device, every rank on it (the simulator shares its compute and
// memory among them, as the ranks' streams do); the LocalTransport's copies between ranks as the
// same-device transfer rate (the simulator moves same-device messages at half the memory
// bandwidth, so that is set to twice the measured one, as on the CPU).
Machine probe_gpu(const planner::Plan& plan, const std::vector<std::int64_t>& probe_sizes,
                  int round_trips) {
  Machine m;
  const exec::cuda::GpuInfo gpu = exec::cuda::current_gpu();
  fmt::print("probing the local transport on {} ({} sizes up to {}, {} round trips each)...\n",
             gpu.name, probe_sizes.size(), human_bytes(double(probe_sizes.back())), round_trips);
  std::fflush(stdout);
  m.link = exec::cuda::measure_local_transport(probe_sizes, round_trips);
  m.cluster = exec::cuda::gpu_host_cluster(1, m.link);
  m.cluster.device.memory_bandwidth_bytes_per_s = 2 * m.link.bandwidth_bytes_per_s;
  fmt::print("  latency {}, bandwidth {}; {} peak {} (bf16)\n", human_seconds(m.link.latency_s),
             human_rate(m.link.bandwidth_bytes_per_s, "B"), gpu.name,
             human_rate(m.cluster.device.peak_fp16_flops_per_s, "FLOP"));
  m.placement.assign(std::size_t(plan.ranks()), planner::Placement{0, 0});
  m.json = {{"gpu", gpu.name}, {"versions", gpu.versions}, {"gpu_memory_bytes", gpu.memory_bytes}};
  return m;
}
#endif

void run_and_compare(const ValidateArgs& a) {
  check_backend(a.backend);
  const bool gpu = a.backend == "cuda";
  const models::ModelSpec model = exec::as_executed(models::load_model(a.model));
  if (!gpu && model.dtype != models::DType::fp32)
    throw InputError(fmt::format("model {}: the CPU backend runs fp32 (the model says {})",
                                 model.name, models::to_string(model.dtype)));
  if (gpu) exec::check_gpu_model(model);
  // Every rank is a thread here: without -w the width is 1 (build() checks the plan).
  // Chunks: the chunk size the run takes written in (the probes and the prediction use it), in
  // the budget the backend schedules them in (exec::chunk_budget).
  const planner::Plan built = executed_plan(a.plan.build(model.layers, 1));
  const bool chunks = built.offload == planner::Offload::chunks;
  const std::int64_t chunk_memory =
      chunks ? exec::chunk_budget(a.backend, built, a.train.device_memory) : 0;
  const planner::Plan plan = chunks ? exec::with_chunk_size(model, built, chunk_memory) : built;
  // What the executor would refuse (an offload it does not run, a budget the chunks do not fit),
  // before the profile and the probes take their minutes.
  (void)exec::detail::prepare_run(model, plan, a.train, a.backend);  // host-only, both backends
  // Selective recompute: the profile times a selective block's backward too (both profilers).
  const bool selective = std::find(plan.recompute.begin(), plan.recompute.end(),
                                   planner::Recompute::selective) != plan.recompute.end();
  if (plan.t > 1 && gpu)
    throw InputError(fmt::format(
        "plan: t: validate --backend cuda does not model a TP group's devices on its one GPU yet "
        "(t = {}); validate it with --backend cpu, or train --backend cuda and simulate",
        plan.t));
  const models::Sharding sharding{plan.t, plan.sp};
  // Under mpirun: one rank per process; rank 0 profiles, simulates, compares and prints.
  const exec::MpiSession* job = process_count() > 1 ? mpi_session() : nullptr;
  if (job) {
    if (gpu) throw InputError("validate under mpirun: --backend cpu only (one rank per process)");
    exec::check_world_size(
        job->size(), plan.gpus(),
        fmt::format("{}{} w={} d={}", to_string(plan.schedule), tp_text(plan), plan.w, plan.d));
    if (job->rank() != 0) return follow_validate(a, *job, model, plan);
  }
  if (plan.t > 1) {                               // before anything runs
    (void)models::derive_costs(model, sharding);  // t against the heads, FFN and vocabulary
    if (!gpu && plan.gpus() > exec::hardware_threads())
      throw InputError(fmt::format(
          "plan: t: validate with t = {} runs t*w*d = {} threads, each on a core of its own (a "
          "TP group shares no device), but this machine has {} cores",
          plan.t, plan.gpus(), exec::hardware_threads()));
  }
  std::vector<std::int64_t> sizes = a.microbatch.empty()
                                        ? std::vector<std::int64_t>{}
                                        : parse_int_list(a.microbatch, "--microbatch");
  if (std::find(sizes.begin(), sizes.end(), std::int64_t(plan.b)) == sizes.end())
    sizes.push_back(plan.b);
  traces::Trace trace;
  if (!a.trace.empty()) {  // read and checked before anything runs
    clusters::DeviceSpec device;
    device.name = "cpu";  // what profile writes on the CPU; a GPU trace names its GPU
    trace = load_or_make_trace(a.trace, model, device, plan.b, sharding);
    trace.at(plan.b);
  }
  const MeasuredOn on = measured_on(a.backend, model, plan);
  fmt::print("{}: {}{} w={} d={} b={} m={}, global batch {}, {} steps, {} rank{} on {}\n",
             model.name, to_string(plan.schedule), tp_text(plan), plan.w, plan.d, plan.b, plan.m,
             plan.global_batch(), a.train.steps,
             plan.t > 1 ? fmt::format("{} x t = {}", plan.ranks(), plan.gpus())
                        : fmt::format("{}", plan.ranks()),
             plan.gpus() == 1 ? "" : "s",
             gpu   ? on.device
             : job ? fmt::format("{} processes (mpirun)", job->size())
                   : fmt::format("{} cores", exec::hardware_threads()));

  // 1. Profile the per-layer trace (or use the one given): the first of the blocks' profiles.
  const int blocks = a.blocks;
  const exec::ProfileStatistic statistic =
      a.statistic == "mean" ? exec::ProfileStatistic::mean : exec::ProfileStatistic::median;
  std::vector<traces::Trace> profiles;
  std::vector<PhaseLoad> profile_loads, train_loads;
  auto profile_block = [&](int k) {
    const exec::CpuCounters start = exec::read_cpu_counters();
    if (a.trace.empty()) {
      fmt::print("profiling {} at b={} ({} of {} round-robin runs{})...\n", model.name,
                 fmt::join(sizes, ","), a.statistic, a.repeats,
                 blocks > 1 ? fmt::format(", block {} of {}", k + 1, blocks) : "");
      std::fflush(stdout);
#ifdef PW_HAVE_CUDA
      if (gpu)
        profiles.push_back(
            exec::cuda::profile_cuda(model, sizes, a.repeats, statistic, sharding, selective));
      else
#endif
        profiles.push_back(
            exec::profile_cpu(model, sizes, a.repeats, statistic, sharding, selective));
    }
    if (job) exec::wait_for_all(*job, "wait for rank 0's profile");
    profile_loads.push_back(phase_load(start, job));
  };
  profile_block(0);
  if (a.trace.empty()) trace = profiles.front();
  {
    const auto& block = trace.at(plan.b).layers[models::LayerKind::block];
    fmt::print("  block forward {}, backward {}, recompute {}\n", human_seconds(block.forward_s),
               human_seconds(block.backward_s), human_seconds(block.recompute_s));
  }

  // 2. This machine as a cluster: the transport's latency and bandwidth at the plan's message
  // sizes, and its devices.
  const std::int64_t message =
      std::max<std::int64_t>(trace.at(plan.b).layers[models::LayerKind::block].output_bytes, 4096);
  const std::vector<std::int64_t> probe_sizes = {4, message / 4, message, 4 * message};
  std::int64_t shared_sizes[4] = {probe_sizes[0], probe_sizes[1], probe_sizes[2], probe_sizes[3]};
  if (job) job->broadcast(shared_sizes, int(sizeof shared_sizes), 0);
#ifdef PW_HAVE_CUDA
  Machine machine_probe = gpu   ? probe_gpu(plan, probe_sizes, a.round_trips)
                          : job ? probe_mpi(plan, probe_sizes, a.round_trips, *job)
                                : probe_cpu(plan, probe_sizes, a.round_trips);
#else
  Machine machine_probe = job ? probe_mpi(plan, probe_sizes, a.round_trips, *job)
                              : probe_cpu(plan, probe_sizes, a.round_trips);
#endif
  // Offload: the copies between the device (the CPU's emulated one; the GPU) and the host (pool;
  // pinned memory), and CPU Adam, measured; each device as large as the executor's
  // (--device-memory; the CUDA chunks' budget), so that both plan the same chunks.
  if (plan.any_offload()) {
    const std::int64_t chunk =
        plan.offload == planner::Offload::chunks
            ? (plan.chunk_bytes > 0 ? plan.chunk_bytes : planner::default_chunk_bytes(model))
            : 4 * message;
    fmt::print("probing the host side of offload (copies up to {}, the optimizer update)...\n",
               human_bytes(double(2 * chunk)));
    std::fflush(stdout);
    const std::vector<std::int64_t> copies = {4096, chunk, 2 * chunk};
#ifdef PW_HAVE_CUDA
    const exec::HostFit host =
        gpu ? exec::cuda::measure_host(copies, a.train) : exec::measure_host(copies, a.train);
#else
    const exec::HostFit host = exec::measure_host(copies, a.train);
#endif
    // CPU: one engine thread per rank (one per process under mpirun); CUDA: host functions.
    exec::add_host(machine_probe.cluster, host, gpu || job ? 1 : plan.ranks());
    if (a.train.device_memory > 0)
      machine_probe.cluster.device.memory_bytes = chunks ? chunk_memory : a.train.device_memory;
    fmt::print("  copy {} + bytes / {}; {} {} parameters/s per core\n",
               human_seconds(host.copy.latency_s), human_rate(host.copy.bandwidth_bytes_per_s, "B"),
               a.train.optimizer, fmt::format("{:.3g}", host.optimizer_params_per_s));
    machine_probe.json["host"] = {{"copy_latency_s", host.copy.latency_s},
                                  {"copy_bandwidth_bytes_per_s", host.copy.bandwidth_bytes_per_s},
                                  {"optimizer_params_per_s", host.optimizer_params_per_s}};
  }
  const clusters::Cluster& cluster = machine_probe.cluster;
  const exec::TransportFit& link = machine_probe.link;

  // 3. Place the plan on it.
  planner::Plan placed = plan;
  placed.placement = machine_probe.placement;
  planner::place(placed, {cluster.nodes, cluster.gpus_per_node});
  int per_core = 1;
  for (int c = 0; c < cluster.gpus_per_node; ++c)
    per_core =
        std::max<int>(per_core, int(std::count(placed.placement.begin(), placed.placement.end(),
                                               planner::Placement{0, c})));
  // Ranks sharing a pinned core take turns on it op by op (the executor's --core-turns), and the
  // simulator runs them so; otherwise it shares the core fairly, as the OS roughly does.
  const bool turns = !gpu && !job && a.pin_cores && a.train.core_turns && plan.t == 1;
  if (per_core > 1 && !gpu)
    fmt::print("note: {} ranks on {} cores: up to {} ranks share a core ({})\n", plan.ranks(),
               cluster.gpus_per_node, per_core,
               turns ? "they take turns on it op by op, first ready first, in training and in "
                       "the simulation (--core-turns)"
                     : "the simulator gives each a fair share of it, as the OS scheduler roughly "
                       "does");

  // 4. Train for real (threads: each rank on the core the simulation puts it on), block after
  // block with a profile between them, so that a slow spell of the machine falls on the profile
  // and on the run alike; the trace is the mean of the blocks' profiles and the measured steps
  // those of every block after its first (docs/formulas.md, section 10).
  exec::TrainOptions train = a.train;
  if (!gpu && !job && a.pin_cores) {
    const std::vector<int> cores = exec::allowed_cores();
    for (const planner::Placement& p : placed.placement)  // a TP group's devices on its t cores
      for (int k = 0; k < plan.t; ++k)
        train.cores.push_back(cores[std::size_t(p.gpu + k) % cores.size()]);
  }
  exec::TrainResult r;
  for (int k = 0; k < blocks; ++k) {
    if (k > 0) profile_block(k);
    fmt::print("training {} steps on {} ranks{}{}...\n", a.train.steps, plan.ranks(),
               train.cores.empty()
                   ? ""
                   : fmt::format(" (threads on cores {})", fmt::join(train.cores, ",")),
               blocks > 1 ? fmt::format(", block {} of {}", k + 1, blocks) : "");
    std::fflush(stdout);
    const exec::CpuCounters train_start = exec::read_cpu_counters();
    exec::TrainResult block = train_on(a.backend, model, plan, train, print_step);
    train_loads.push_back(phase_load(train_start, job));
    append_block(r, std::move(block));
  }
  if (a.trace.empty()) trace = traces::mean_of(profiles);
  const PhaseLoad profile_load = combined(profile_loads), train_load = combined(train_loads);
  if (blocks > 1 && a.trace.empty()) {
    const auto& block = trace.at(plan.b).layers[models::LayerKind::block];
    fmt::print("  the mean of the {} profiles: block forward {}, backward {}, recompute {}\n",
               blocks, human_seconds(block.forward_s), human_seconds(block.backward_s),
               human_seconds(block.recompute_s));
  }
  const planner::RunReport measured = measured_report(model, plan, r, on);

  // 5. Simulate on this machine's cluster.
  fmt::print("simulating {} steps on {} ({} {} as devices)...\n", a.train.steps, cluster.name,
             cluster.gpus_per_node, gpu ? "GPU" : "cores");
  std::fflush(stdout);
  sim::SimOptions so;
  so.steps = a.train.steps;
  so.gradient_buckets = a.train.gradient_buckets;
  so.device_turns = turns;
  sim::SimResult sim = sim::simulate(model, trace, cluster, placed, so);
  if (!sim.report.fits()) throw PlanError(oom_message(sim.report));

  // 6. Subtract.
  const planner::Validation v = planner::validate(sim.report, measured, "simulated", "measured");
  print_validation(v);
  if (per_core > 1 && !gpu && !turns)
    fmt::print(
        "  (ranks share cores: the simulator runs their compute at a fair share of the core, so "
        "its busy times stretch; the OS mostly runs one op at a time, so the measured ones do "
        "not: compare the step times)\n");
  if (!gpu) {
    const exec::OtherLoad& pl = profile_load.load;
    const exec::OtherLoad& tl = train_load.load;
    fmt::print(
        "  machine: other processes used {} of {}'s CPU time while profiling, {} while training "
        "(hypervisor steal {:.0f}%, {:.0f}%)\n",
        load_text(pl), train_load.host, load_text(tl), 100 * pl.steal, 100 * tl.steal);
    if (std::max(pl.others + pl.steal, tl.others + tl.steal) > kBusyMachine)
      fmt::print(
          "  warning: the machine was busy with other work (above {:.0f}%): the profile and the "
          "run were slowed unequally, and the error above includes that; rerun on a quiet "
          "machine\n",
          100 * kBusyMachine);
  }

  common::Json samples = common::Json::array();
  for (const auto& s : link.samples)
    samples.push_back({{"bytes", s.bytes}, {"one_way_s", s.one_way_s}});
  common::Json machine = machine_probe.json;
  machine["backend"] = a.backend;
  machine[gpu ? "ranks_per_gpu" : "ranks_per_core"] = per_core;
  machine["transport"] = {{"kind", gpu   ? "local (one GPU)"
                                   : job ? "MPI (ranks 0 and 1)"
                                         : "in-process"},
                          {"latency_s", link.latency_s},
                          {"bandwidth_bytes_per_s", link.bandwidth_bytes_per_s},
                          {"round_trips", a.round_trips},
                          {"samples", samples}};
  if (!link.send_samples.empty()) {
    common::Json sends = common::Json::array();
    for (const auto& s : link.send_samples)
      sends.push_back({{"bytes", s.bytes}, {"send_s", s.one_way_s}});
    machine["transport"]["send_samples"] = sends;
    machine["transport"]["send_overhead_s"] = link.send_overhead_s;
    machine["transport"]["send_overhead_bytes_per_s"] = link.send_overhead_bytes_per_s;
  }
  machine["trace"] = a.trace.empty() ? common::Json({{"profiled", true},
                                                     {"microbatch_sizes", sizes},
                                                     {"repeats", a.repeats},
                                                     {"blocks", a.blocks},
                                                     {"statistic", a.statistic}})
                                     : common::Json({{"profiled", false}, {"file", a.trace}});
  machine["blocks"] = a.blocks;
  machine["cluster"] = clusters::to_json(cluster);
  machine["other_load"] = {{"profile", load_json(profile_load)}, {"train", load_json(train_load)}};
  const common::Json files = {{"trace", or_null(a.trace_out.empty() ? a.trace : a.trace_out)},
                              {"predicted", or_null(a.simulated_out)},
                              {"measured", or_null(a.measured_out)},
                              {"cluster", or_null(a.cluster_out)}};
  // Everything ran: now the files (each atomic), so a failure above leaves none behind.
  if (!a.trace_out.empty()) {
    traces::write_trace(a.trace_out, trace);
    fmt::print("wrote {}\n", a.trace_out);
  }
  if (!a.cluster_out.empty()) {
    common::write_json_file(a.cluster_out, clusters::to_json(cluster));
    fmt::print("wrote {}\n", a.cluster_out);
  }
  if (!a.simulated_out.empty()) {
    common::write_json_file(a.simulated_out, planner::to_json(sim.report));
    fmt::print("wrote {}\n", a.simulated_out);
  }
  if (!a.measured_out.empty()) {
    common::write_json_file(a.measured_out, planner::to_json(measured));
    fmt::print("wrote {}\n", a.measured_out);
  }
  if (!a.out.empty()) {
    common::write_json_file(a.out, planner::to_json(v, machine, files));
    fmt::print("wrote {}\n", a.out);
  }
}

}  // namespace

// Options only a run uses: given with --predicted and --measured, they are an error.
constexpr const char* kRunOnly =
    "--plan --schedule -w -d -m -b -v --recompute --stage-blocks --ranks-per-gpu --model "
    "--backend --steps --microbatch --repeats --profile-statistic --round-trips --trace --seed "
    "--buckets --trace-out --simulated-out --measured-out --cluster-out --pin-cores --async-comm "
    "--core-turns --blocks";

void add_validate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "validate",
      "profile, simulate on a model of this machine, train, and compare predicted with measured "
      "step time and memory (or compare two run reports)");
  auto a = std::make_shared<ValidateArgs>();
  a->train.steps = 10;
  cmd->add_option("--model", a->model, "model preset or JSON file (fp32 for the CPU backend)")
      ->capture_default_str();
  a->plan.add(*cmd);
  cmd->add_option("--backend", a->backend, "cpu, or cuda (see --help of the CUDA build)")
      ->capture_default_str();
  cmd->add_option("--steps", a->train.steps,
                  "optimizer steps, simulated, and trained in each block (each block's first is "
                  "left out of the measured step time)")
      ->capture_default_str()
      ->check(CLI::Range(2, 1000000));
  cmd->add_option("--blocks", a->blocks,
                  "profile and train in this many blocks taking turns (each profiling --repeats "
                  "runs and training --steps steps), so that a slow spell of the machine falls "
                  "on both alike; the trace is the mean of the profiles, the measured step the "
                  "mean of every block's steps after its first")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  cmd->add_option("--microbatch", a->microbatch,
                  "microbatch sizes to profile, comma-separated (default: the plan's b; b is "
                  "always profiled)");
  cmd->add_option("--repeats", a->repeats,
                  "timed runs per profiled measurement (see --profile-statistic)")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--profile-statistic", a->statistic,
                  "mean (what a run's mean step time averages) or median of the profiled runs")
      ->capture_default_str()
      ->check(CLI::IsMember({"mean", "median"}));
  cmd->add_option("--round-trips", a->round_trips,
                  "ping-pong round trips per message size when probing the transport")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--trace,-t", a->trace, "use this measured trace instead of profiling");
  cmd->add_option("--seed", a->train.seed, "weights and synthetic data")->capture_default_str();
  cmd->add_option("--buckets", a->train.gradient_buckets,
                  "all-reduce buckets per stage (simulated and trained)")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_flag("--async-comm,!--no-async-comm", a->train.async_comm,
                "CPU threads: sends and data-parallel gradient sums on each rank's communication "
                "threads, beside its compute (--no-async-comm: on the rank's thread)")
      ->capture_default_str();
  cmd->add_flag("--mpi-progress", a->train.mpi_progress,
                "CPU backend under mpirun: a progress thread per process moves MPI messages while "
                "the rank computes (train --mpi-progress)");
  cmd->add_flag("--core-turns,!--no-core-turns", a->train.core_turns,
                "CPU threads, pinned: ranks sharing a core take turns on it op by op, first ready "
                "first, as the simulator runs them (--no-core-turns: the OS interleaves them)")
      ->capture_default_str();
  cmd->add_flag("--pin-cores,!--no-pin-cores", a->pin_cores,
                "CPU threads: run each rank's thread on the core the simulation puts it on "
                "(under mpirun, mpirun binds)")
      ->capture_default_str();
  cmd->add_option("--device-memory", a->train.device_memory,
                  "bytes of each rank's emulated device (train --device-memory; the simulation "
                  "plans on devices of this size; --offload chunks needs it)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t(0), std::int64_t(1) << 50));
  cmd->add_option("--out,-o", a->out, "write the validation report (JSON) here");
  cmd->add_option("--trace-out", a->trace_out, "keep the profiled trace here");
  cmd->add_option("--simulated-out", a->simulated_out, "keep the simulated run report here");
  cmd->add_option("--measured-out", a->measured_out, "keep the measured run report here");
  cmd->add_option("--cluster-out", a->cluster_out,
                  "keep the cluster description of this machine here (simulate --cluster FILE)");
  auto* predicted = cmd->add_option(
      "--predicted", a->predicted,
      "compare this simulated (or analytic) run report with --measured instead of running");
  auto* measured =
      cmd->add_option("--measured", a->measured, "a measured run report (train --out)");
  predicted->needs(measured);
  measured->needs(predicted);
  cmd->callback([a, cmd] {
    if (!a->predicted.empty()) {
      std::istringstream names(kRunOnly);
      for (std::string run_only; names >> run_only;)
        if (cmd->count(run_only) > 0)
          throw InputError(fmt::format(
              "{}: comparing --predicted with --measured runs nothing (the plan and model come "
              "from the reports)",
              run_only));
      return compare_files(*a);
    }
    if (cmd->count("--ranks-per-gpu") > 0)
      throw InputError(
          "--ranks-per-gpu: validate places the ranks itself (on the cores, or all on the one "
          "GPU)");
    run_and_compare(*a);
  });
}

}  // namespace pw::cli
