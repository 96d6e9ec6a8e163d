// Sets up one simulation (engine, platform, one actor per rank), runs it, and turns the ranks'
// ledgers and events into the run report, per-link statistics and the timeline.
#include "sim/simulator.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>

#include <fmt/format.h>
#include <sys/resource.h>

#include "common/limits.hpp"
#include "sim/collectives.hpp"
#include "sim/engine.hpp"
#include "sim/observer.hpp"
#include "sim/timeline.hpp"
#include "sim/world.hpp"

namespace pw::sim {

using detail::RankState;
using detail::World;

namespace {

void setup_ranks(World& w, const models::ModelSpec& model, const traces::Trace& trace,
                 const clusters::Cluster& cluster, const Platform& platform) {
  const planner::Plan& p = w.plan();
  const models::ModelCosts mc = models::derive_costs(model, {p.t, p.sp});
  const std::int64_t e = models::dtype_bytes(model.dtype);
  std::map<std::pair<int, int>, int> per_gpu;
  std::map<std::pair<int, int>, std::int64_t> gpu_bound;
  std::vector<std::int64_t> host_parameters;  // offload: by rank, made once
  constexpr const char* kBytesWhat = "simulate: bytes per device";
  for (const auto& pl : p.placement)
    ++per_gpu[{pl.node, pl.gpu}];
  w.gpus.assign(std::size_t(platform.nodes * platform.gpus_per_node), {});
  w.dtype_bytes = e;
  w.bucket_bytes.assign(std::size_t(p.d * p.v), 0);
  for (int r = 0; r < p.ranks(); ++r) {
    RankState rs;
    rs.rank = r;
    rs.stage = p.stage_of(r);
    rs.replica = p.replica_of(r);
    rs.node = p.placement[std::size_t(r)].node;
    rs.gpu = p.placement[std::size_t(r)].gpu;
    rs.shares_gpu = per_gpu[{rs.node, rs.gpu}] > 1;
    rs.host = platform.gpu(rs.node, rs.gpu);
    for (int i = 0; i < p.t; ++i)
      rs.tp_hosts.push_back(platform.gpu(rs.node, rs.gpu + i));
    rs.tp_latency_s = planner::tp_link(cluster, p, r).latency_s;
    rs.recompute = p.recompute_of(rs.stage);
    if (p.offload == planner::Offload::chunks && p.t > 1)
      for (models::LayerKind k : traces::kLayerKinds)
        rs.layer_costs[k] = planner::layer_cost(mc, trace, p, k);
    planner::MemoryBreakdown fixed;
    std::int64_t parameters = 0, stash = 0;
    for (int c = 0; c < p.v; ++c) {
      rs.chunks.push_back(planner::chunk_cost(mc, trace, p, rs.stage, c));
      parameters = common::checked_add(parameters, rs.chunks.back().parameters, kBytesWhat,
                                       common::kMaxBytes);
      stash =
          common::checked_add(stash, rs.chunks.back().stash_bytes, kBytesWhat, common::kMaxBytes);
      fixed.workspace = std::max(fixed.workspace, rs.chunks.back().workspace_bytes);
      w.bucket_bytes[std::size_t(rs.stage * p.v + c)] =
          double(rs.chunks.back().parameters) * double(e) / w.programs->buckets;
    }
    rs.version_bytes = common::checked_mul(parameters, e, kBytesWhat, common::kMaxBytes);
    rs.tied_bytes = common::checked_mul(mc.tied_copy_parameters, e, kBytesWhat, common::kMaxBytes);
    const std::int64_t workspace = fixed.workspace;
    fixed = planner::static_memory(model, p, parameters);
    fixed.workspace = workspace;
    // The message buffers the executors hold beside the stashes at the peak, held all along:
    // the planner's count (planner::message_buffers).
    fixed.activations = planner::message_buffer_bytes(p, trace, rs.stage);
    rs.backward_message_drop =
        fixed.activations -
        common::checked_mul(planner::backward_message_buffers(p, rs.stage),
                            trace.at(p.b).layers[models::LayerKind::block].output_bytes, kBytesWhat,
                            common::kMaxBytes);
    if (p.offload == planner::Offload::chunks) {  // model data in the schedule's chunks
      const planner::ChunkSchedule& cs = (*w.programs->chunks)[std::size_t(rs.stage)];
      // The units a step starts with on the device (each step ends with them there): their
      // parameters and, with m > 1, their gradient halves (2bw: version slots and gradients).
      fixed.weights = fixed.gradients = 0;
      for (int u = 0; u < cs.layout.units(); ++u)
        if (cs.start_on_device[std::size_t(u)]) {
          fixed.weights += cs.layout.unit_weight_bytes(u);
          fixed.gradients += cs.layout.unit_gradient_bytes(u);
        }
      fixed.optimizer = std::int64_t(cs.device_adam_chunks) * cs.layout.os_chunk_bytes;
      fixed.workspace = cs.workspace_bytes;
      rs.offload.host_bytes = cs.host_peak_bytes;
      rs.offload.pinned_bytes = cs.host_chunk_peak_bytes;
      rs.cpu_adam_params_per_s = cluster.host.cpu_adam_params_per_s();
    }
    if (p.offload == planner::Offload::optimizer) {  // the same figures as the closed form
      if (host_parameters.empty()) host_parameters = planner::host_parameters_by_rank(mc, trace, p);
      rs.offload = planner::rank_offload(model, mc, cluster, p, r, rs.chunks, host_parameters);
      fixed.gradients = rs.offload.device_gradient_bytes;
      fixed.optimizer = 0;
      rs.cpu_adam_params_per_s = cluster.host.cpu_adam_params_per_s();
    }
    if (p.any_offload()) rs.cpu = platform.host_cpus[std::size_t(rs.node)];
    // What the replay can hold at once (every microbatch-chunk stashed, two weight versions, the
    // static memory), checked here, before any actor runs, so its running sums cannot overflow.
    // (Not a limit on the answer: only int64's range, with room to spare.)
    constexpr std::int64_t kRoom = INT64_MAX / 4;
    const std::int64_t held = common::checked_add(
        common::checked_mul(std::int64_t(p.m) * p.v, stash, kBytesWhat, kRoom),
        common::checked_add(common::checked_mul(rs.version_bytes, 2, kBytesWhat, kRoom),
                            fixed.total(), kBytesWhat, kRoom),
        kBytesWhat, kRoom);
    gpu_bound[{rs.node, rs.gpu}] =
        common::checked_add(gpu_bound[{rs.node, rs.gpu}], held, kBytesWhat, kRoom);
    rs.optimizer_end.assign(std::size_t(w.programs->steps), 0);
    w.ranks.push_back(std::move(rs));
    w.rank_static.push_back(fixed);
  }
}

// Steady state: the step in the middle of the run, between two moments when every rank had
// finished its optimizer step (2bw's fill and drain, and the first step's warm-up, stay out).
std::pair<double, double> steady_window(const std::vector<double>& step_end) {
  if (step_end.size() < 2) return {0, step_end.empty() ? 0 : step_end[0]};
  const std::size_t k = step_end.size() / 2;
  return {step_end[k - 1], step_end[k]};
}

double busy_in(const RankState& r, double a, double b) {
  double busy = 0;
  for (const auto& e : r.events)
    if (e.stream == detail::kCompute)
      busy += std::max(0.0, std::min(e.end, b) - std::max(e.start, a));
  return busy;
}

}  // namespace

// Bytes each link carries: every transfer adds its size to the links of its route (SimGrid's
// link-load plugin would also count the latency phase as traffic, and 3.32 exports no comm-start
// signal, so the senders report their transfers here).
void detail::LinkCounter::count(sg4::Host* src, sg4::Host* dst, double bytes) {
  auto [it, fresh] = routes_.try_emplace({src, dst});
  if (fresh) src->route_to(dst, it->second, nullptr);
  for (sg4::Link* l : it->second)
    bytes_[l] += bytes;
}

std::vector<LinkStat> detail::LinkCounter::stats(const Platform& platform,
                                                 double simulated_s) const {
  std::map<const sg4::Link*, const Platform::LinkInfo*> info;
  for (const auto& l : platform.links)
    info[l.link] = &l;
  std::vector<LinkStat> out;
  for (const auto& [link, bytes] : bytes_) {
    LinkStat s;
    s.name = link->get_name();
    auto it = info.find(link);
    s.kind = it != info.end() ? it->second->kind : "other";
    s.bandwidth_bytes_per_s = link->get_bandwidth();
    s.bytes = bytes;
    s.utilization = simulated_s > 0 ? bytes / (s.bandwidth_bytes_per_s * simulated_s) : 0;
    out.push_back(s);
  }
  std::sort(out.begin(), out.end(),
            [](const LinkStat& a, const LinkStat& b) { return a.name < b.name; });
  return out;
}

namespace {

// Host memory per node (the ranks' static offload figures: nothing on the host changes size
// during a step) and the bytes the replay moved, per step.
void add_offload_report(planner::RunReport& rep, const World& w, const clusters::Cluster& cluster) {
  std::map<int, planner::HostReport> hosts;
  common::Json ranks = common::Json::array();
  const std::int64_t steps = w.programs->steps;
  std::int64_t out = 0, in = 0, swapped = 0;
  // 2bw with chunks: a step's copies are a steady segment's (the run's first and last segments,
  // which fill and drain the pipeline, left out when there are others).
  const bool segments =
      w.programs->chunks && w.plan().schedule == planner::Schedule::two_bw && steps >= 3;
  const auto per_step = [&](std::int64_t all, std::int64_t edges) {
    return segments ? (all - edges) / (steps - 2) : all / steps;
  };
  for (const RankState& r : w.ranks) {
    planner::HostReport& h = hosts[r.node];
    h.node = r.node;
    // A rank's figures are one device's; with t > 1 the node and the totals have t of them.
    const std::int64_t t = std::int64_t(r.tp_hosts.size());
    h.peak_memory_bytes += t * (r.offload.host_bytes + r.swap_host_peak);
    h.pinned_bytes += t * (r.offload.pinned_bytes + r.swap_host_peak);
    h.capacity_bytes = cluster.host.memory_bytes;
    h.pinned_capacity_bytes = cluster.host.pinned_memory_bytes;
    const std::int64_t rank_out = per_step(r.copied_out_bytes, r.edge_out_bytes),
                       rank_in = per_step(r.copied_in_bytes, r.edge_in_bytes);
    out += t * rank_out;
    in += t * rank_in;
    common::Json rank = {{"rank", r.rank},
                         {"host_bytes", r.offload.host_bytes + r.swap_host_peak},
                         {"pinned_bytes", r.offload.pinned_bytes + r.swap_host_peak},
                         {"copy_out_bytes_per_step", rank_out},
                         {"copy_in_bytes_per_step", rank_in}};
    if (w.programs->chunks) {  // the schedule's figures; the bytes above are the flows'
      rank["chunks"] = planner::chunk_report((*w.programs->chunks)[std::size_t(r.stage)]);
      rank["chunks"]["uploads_per_step"] = per_step(r.chunk_uploads, r.edge_uploads);
      rank["chunks"]["downloads_per_step"] = per_step(r.chunk_downloads, r.edge_downloads);
      if (rank["chunks"].contains("part_bytes")) {  // sharded chunks (2bw: steady segments')
        rank["chunks"]["part_uploads_per_step"] = per_step(r.chunk_part_uploads, 0);
        rank["chunks"]["part_downloads_per_step"] = per_step(r.chunk_part_downloads, 0);
        rank["chunks"]["drops_per_step"] = per_step(r.chunk_drops, 0);
        if (segments) rank["chunks"]["zero_fills_per_step"] = per_step(r.chunk_zero_fills, 0);
      }
    }
    if (w.plan().offload_activations) {
      rank["activations"] = {
          {"choice", planner::to_string(w.plan().activations[std::size_t(r.stage)])},
          {"swapped_layers", w.plan().swapped_layers(r.stage)},
          {"recomputed_layers", w.plan().recomputed_layers(r.stage)},
          {"swapped_bytes_per_step", r.swapped_bytes / steps},
          {"host_bytes", r.swap_host_peak}};
      swapped += t * (r.swapped_bytes / steps);
    }
    ranks.push_back(rank);
  }
  for (const auto& [node, h] : hosts)
    rep.hosts.push_back(h);
  rep.extra["offload"] = {{"mode", planner::offload_name(w.plan())},
                          {"copy_out_bytes_per_step", out},
                          {"copy_in_bytes_per_step", in},
                          {"activation_bytes_per_step", swapped},
                          {"ranks", ranks}};
}

planner::RunReport make_report(const World& w, const models::ModelSpec& model,
                               const clusters::Cluster& cluster, const SimResult& result) {
  const planner::Plan& p = w.plan();
  planner::RunReport rep;
  rep.source = "simulated";
  rep.model = model.name;
  rep.cluster = fmt::format("{}:{}", cluster.name, cluster.nodes);
  rep.plan = p;
  const auto [a, b] = steady_window(result.step_end_s);
  rep.iteration_time_s = b - a;
  std::map<std::pair<int, int>, int> gpus;
  for (const auto& pl : p.placement)
    gpus[{pl.node, pl.gpu}] = 1;
  planner::set_throughput(rep, model, cluster, int(gpus.size()) * p.t);
  for (const RankState& r : w.ranks) {
    planner::DeviceReport d;
    d.rank = r.rank;
    d.node = r.node;
    d.gpu = r.gpu;
    d.stage = r.stage;
    d.replica = r.replica;
    d.memory = r.memory.at_peak;
    d.peak_memory_bytes = w.gpus[std::size_t(r.node * w.platform->gpus_per_node + r.gpu)].peak;
    d.capacity_bytes = cluster.device.memory_bytes;
    d.fits = d.peak_memory_bytes <= d.capacity_bytes;
    d.busy_s = busy_in(r, a, b);
    d.bubble_fraction = rep.iteration_time_s > 0 ? 1.0 - d.busy_s / rep.iteration_time_s : 0;
    rep.devices.push_back(d);
  }
  if (p.any_offload()) add_offload_report(rep, w, cluster);
  common::Json links = common::Json::array();
  for (const auto& l : result.links)
    links.push_back({{"name", l.name},
                     {"kind", l.kind},
                     {"bandwidth_bytes_per_s", l.bandwidth_bytes_per_s},
                     {"bytes", l.bytes},
                     {"utilization", l.utilization}});
  rep.extra["simulation"] = {{"steps", w.programs->steps},
                             {"gradient_buckets", w.programs->buckets},
                             {"steady_step", result.step_end_s.size() / 2},
                             {"simulated_s", result.simulated_s},
                             {"step_end_s", result.step_end_s},
                             {"activities", result.activities},
                             {"links", links}};
  return rep;
}

std::int64_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return std::int64_t(u.ru_maxrss) * 1024;
}

}  // namespace

SimResult simulate_in_process(const models::ModelSpec& model, const traces::Trace& trace,
                              const clusters::Cluster& cluster, const planner::Plan& given,
                              const SimOptions& options) {
  planner::Plan plan = given;
  const auto wall_start = std::chrono::steady_clock::now();
  if (options.steps < 1) throw InputError("--steps must be at least 1");
  // The simulator's share of the limits (common/limits.hpp), refused before anything is built.
  using common::kMaxSimulatedGpus, common::kMaxSimulatedRanks;
  if (cluster.devices() > kMaxSimulatedGpus)
    throw InputError(fmt::format(
        "simulate: the cluster's {} x {} = {} GPUs are more than the {} a simulation takes "
        "(docs/formats.md, Limits); use a smaller --nodes",
        cluster.nodes, cluster.gpus_per_node, cluster.devices(), kMaxSimulatedGpus));
  if (plan.ranks() > kMaxSimulatedRanks)
    throw InputError(fmt::format(
        "simulate: w*d = {}*{} = {} pipeline ranks is more than the {} a simulation takes "
        "(docs/formats.md, Limits); estimate gives the closed form for up to {}",
        plan.w, plan.d, plan.ranks(), kMaxSimulatedRanks, common::kMaxRanks));
  traces::check_sharding(trace, {plan.t, plan.sp});
  planner::check_offload_cluster(cluster, plan);
  if (plan.offload_activations && plan.activations.empty())  // KARMA's choice, as estimate makes it
    planner::set_activation_layers(plan, planner::choose_activations(model, trace, cluster, plan));
  // Test hook: PIPEWRIGHT_TEST_NO_PREFLIGHT=1 lets SimGrid meet what it aborts on (to test how a
  // crashed child is reported).
  if (std::getenv("PIPEWRIGHT_TEST_NO_PREFLIGHT") == nullptr)
    check_simulable(model, trace, cluster, plan, options);
  planner::ProgramOptions po;
  if (plan.offload == planner::Offload::chunks)  // the eviction plan the programs carry
    po.chunks = std::make_shared<const std::vector<planner::ChunkSchedule>>(
        planner::chunk_schedules(model, trace, cluster, plan));
  po.steps = options.steps;
  po.gradient_buckets = options.gradient_buckets;
  po.tied_embeddings = model.tied_embeddings;
  const planner::Programs programs = planner::generate_programs(plan, po);
  auto engine = make_engine();
  const Platform platform = build_platform(cluster);
  World w;
  w.programs = &programs;
  w.platform = &platform;
  w.options = options;
  w.network = cluster.network;
  setup_ranks(w, model, trace, cluster, platform);
  if (options.device_turns) {  // one mutex per shared GPU (SimGrid's mutexes queue FIFO)
    std::map<std::pair<int, int>, sg4::MutexPtr> turns;
    for (RankState& rs : w.ranks)
      if (rs.shares_gpu) {
        sg4::MutexPtr& m = turns[{rs.node, rs.gpu}];
        if (!m) m = sg4::Mutex::create();
        rs.turn = m;
      }
  }
  set_transfer_observer(
      [&w](sg4::Host* from, sg4::Host* to, double bytes) { w.links.count(from, to, bytes); });
  for (int r = 0; r < plan.ranks(); ++r)
    sg4::Actor::create(fmt::format("rank{}", r), w.ranks[std::size_t(r)].host,
                       [&w, r] { detail::replay(w, r); });
  start_flow_service(w.ranks[0].host);
  std::int64_t transfers = 0;
  sg4::Activity::on_completion_cb([&transfers](const sg4::Activity&) {
    if (!in_flow_service()) ++transfers;
  });
  engine->run();
  stop_flow_service();

  SimResult result;
  result.simulated_s = sg4::Engine::get_clock();
  result.step_end_s.assign(std::size_t(options.steps), 0);
  for (const RankState& r : w.ranks)
    for (int s = 0; s < options.steps; ++s)
      result.step_end_s[std::size_t(s)] =
          std::max(result.step_end_s[std::size_t(s)], r.optimizer_end[std::size_t(s)]);
  result.activities = w.timed_ops + transfers;
  result.links = w.links.stats(platform, result.simulated_s);
  set_transfer_observer(nullptr);
  result.report = make_report(w, model, cluster, result);
  if (options.timeline) result.timeline = detail::chrome_trace(w);
  result.wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  result.peak_rss_bytes = peak_rss_bytes();
  return result;
}

}  // namespace pw::sim
