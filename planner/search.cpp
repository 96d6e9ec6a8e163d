// Plan search: enumerate (w, d, b, recompute, schedule), estimate each in closed form, keep what
// fits, rank by throughput (PipeDream-2BW's planner, extended to more schedules).
#include "planner/search.hpp"

#include <algorithm>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "common/format.hpp"
#include "common/limits.hpp"

namespace pw::planner {

std::int64_t Candidate::peak_memory_bytes() const {
  std::int64_t peak = 0;
  for (const auto& d : estimate.report.devices)
    peak = std::max(peak, d.peak_memory_bytes);
  return peak;
}

namespace {

int schedule_rank(Schedule s) {
  switch (s) {
    case Schedule::dp:
      return 0;
    case Schedule::gpipe:
      return 1;
    case Schedule::one_f_one_b:
      return 2;
    case Schedule::two_bw:
      return 3;
    case Schedule::interleaved:
      return 4;
  }
  return 5;
}

bool any_recompute(const Plan& p) {
  return std::any_of(p.recompute.begin(), p.recompute.end(),
                     [](Recompute r) { return r != Recompute::none; });
}

int recompute_rank(const Plan& p) {
  int worst = 0;
  for (Recompute r : p.recompute)
    worst = std::max(worst, r == Recompute::block       ? 3
                            : r == Recompute::full      ? 2
                            : r == Recompute::selective ? 1
                                                        : 0);
  return worst;
}

bool allowed(const std::vector<int>& list, int x) {
  return list.empty() || std::find(list.begin(), list.end(), x) != list.end();
}

// Candidate shapes (w, d) for n ranks.
std::vector<std::pair<int, int>> shapes(int n, std::int64_t layers, const SearchOptions& o) {
  std::vector<std::pair<int, int>> out;
  for (int d = 1; d <= n; ++d) {
    if (n % d != 0 || d > layers) continue;
    if (o.depth && d != *o.depth) continue;
    if (o.width && n / d != *o.width) continue;
    if (!allowed(o.depths, d) || !allowed(o.widths, n / d)) continue;
    out.emplace_back(n / d, d);
  }
  return out;
}

// The plans one (w, d, b) gives: each schedule (and v for interleaved) and recompute mode. With
// fused attention selective recompute drops nothing (the cores are not stashed) and is none in
// every figure: not a candidate of its own where none is one (`selective_differs` false).
std::vector<Plan> plans_for(int w, int d, int b, std::int64_t layers, const SearchOptions& o,
                            bool selective_differs) {
  const bool none_listed =
      std::find(o.recompute.begin(), o.recompute.end(), Recompute::none) != o.recompute.end();
  std::vector<Plan> out;
  if (o.global_batch % (std::int64_t(w) * b) != 0) return out;
  const std::int64_t m = o.global_batch / (std::int64_t(w) * b);
  if (m < 1 || m > 1'000'000) return out;
  for (Schedule s : o.schedules) {
    std::vector<int> vs = {1};
    if (s == Schedule::interleaved) vs = o.chunks;
    for (int v : vs) {
      if (s == Schedule::two_bw && m < d) continue;
      if (s == Schedule::dp && d != 1) continue;
      if (s == Schedule::interleaved &&
          (d < 2 || v < 2 || m % d != 0 || std::int64_t(d) * v > layers))
        continue;
      for (Recompute rc : o.recompute) {
        if (rc == Recompute::selective && !selective_differs && none_listed) continue;
        Plan p;
        p.schedule = s;
        p.w = w;
        p.d = d;
        p.b = b;
        p.m = int(m);
        p.v = v;
        if (rc != Recompute::none) p.recompute.assign(std::size_t(d), rc);
        out.push_back(p);
      }
    }
  }
  return out;
}

}  // namespace

std::vector<std::int64_t> time_balanced_split(const Plan& p, std::int64_t layers,
                                              const traces::Trace& trace) {
  const traces::Entry& e = trace.at(p.b);
  const bool rc = p.recomputes(0);
  auto cost = [&](models::LayerKind k) {
    const traces::LayerTimes& t = e.layers[k];
    return t.forward_s + t.backward_s + (rc ? t.recompute_s : 0.0);
  };
  const int parts = p.virtual_stages();
  if (parts < 1 || layers < parts)
    throw PlanError(
        fmt::format("plan: d: d*v = {} stages but the model has only {} blocks", parts, layers));
  const double block = cost(models::LayerKind::block);
  std::vector<double> fixed(std::size_t(parts), 0.0);
  fixed.front() += cost(models::LayerKind::embedding);
  fixed.back() += cost(models::LayerKind::head);
  std::vector<std::int64_t> blocks(std::size_t(parts), 1);
  for (std::int64_t left = layers - parts; left > 0; --left) {
    std::size_t best = 0;
    double best_time = 0;
    for (std::size_t s = 0; s < blocks.size(); ++s) {
      const double t = fixed[s] + double(blocks[s] + 1) * block;
      if (s == 0 || t < best_time) {
        best = s;
        best_time = t;
      }
    }
    ++blocks[best];
  }
  return blocks;
}

bool better(double ta, const Plan& a, double tb, const Plan& b) {
  if (ta != tb) return ta > tb;
  if (a.d != b.d) return a.d < b.d;
  if (a.t != b.t) return a.t < b.t;
  if (a.b != b.b) return a.b < b.b;
  if (recompute_rank(a) != recompute_rank(b)) return recompute_rank(a) < recompute_rank(b);
  if (a.sp != b.sp) return !a.sp;
  if (a.distributed_optimizer != b.distributed_optimizer) return !a.distributed_optimizer;
  // Fewer offload modes first: none, then one (activations before optimizer), then both.
  auto offload_rank = [](const Plan& x) {
    return (x.offload == Offload::chunks ? 4
            : x.offload != Offload::none ? 2
                                         : 0) +
           (x.offload_activations ? 1 : 0);
  };
  if (offload_rank(a) != offload_rank(b)) return offload_rank(a) < offload_rank(b);
  if (a.schedule != b.schedule) return schedule_rank(a.schedule) < schedule_rank(b.schedule);
  return a.v < b.v;
}

SearchResult search_plans(const models::ModelSpec& model, const traces::Trace& trace,
                          const clusters::Cluster& cluster, const SearchOptions& options) {
  SearchOptions o = options;
  o.tensor_parallel = {trace.sharding.t};
  o.sequence_parallel = {trace.sharding.sp};
  return search_plans(
      model, [&trace](const models::Sharding&) { return trace; }, cluster, o);
}

SearchResult search_plans(const models::ModelSpec& model, const TraceFn& trace_for,
                          const clusters::Cluster& cluster, const SearchOptions& o) {
  if (o.global_batch < 1) throw InputError("plan search: --batch must be at least 1");
  if (!(o.memory_headroom >= 0 && o.memory_headroom < 1))
    throw InputError(fmt::format("plan search: --memory-headroom must be in [0, 1), found {}",
                                 o.memory_headroom));
  std::vector<int> tps;
  for (int t = 1; t <= cluster.gpus_per_node; ++t) {
    if (cluster.gpus_per_node % t != 0 || !allowed(o.tensor_parallel, t)) continue;
    if (t > 1 && o.ranks_per_gpu > 1) continue;
    try {
      models::check_sharding(model, {t, false}, model.name);
    } catch (const InputError&) {
      if (!o.tensor_parallel.empty()) throw;  // asked for explicitly: say why not
      continue;
    }
    tps.push_back(t);
  }
  const double usable = double(cluster.device.memory_bytes) * (1.0 - o.memory_headroom);
  SearchResult result;
  std::int64_t too_many_ranks = 0;  // the smallest rank count skipped for passing kMaxRanks
  // One pass over every shape with the given offload modes; optimizer offload plans with w > 1 are
  // sharded (with the distributed optimizer); activation offload plans have their swap/recompute
  // choices made by the choice rule (choose_activations) in place of the recompute options; chunks
  // plans have v = 1 (any t and w).
  auto enumerate = [&](OffloadModes modes) {
    const Offload offload = modes.optimizer;
    for (int t : tps)
      // SP splits a TP group's work: t = 1 runs without it whatever the list says.
      for (bool sp : t == 1 ? std::vector<bool>{false} : o.sequence_parallel) {
        const traces::Trace trace = trace_for({t, sp});
        const std::vector<std::int64_t> have = trace.microbatch_sizes();
        const std::set<std::int64_t> traced(have.begin(), have.end());
        // Pipeline ranks (TP groups), in int64: devices and ranks per GPU are each up to 10^6.
        const std::int64_t ranks = std::int64_t(cluster.devices()) * o.ranks_per_gpu / t;
        if (ranks > common::kMaxRanks) {
          too_many_ranks = too_many_ranks == 0 ? ranks : std::min(too_many_ranks, ranks);
          continue;
        }
        for (auto [w, d] : shapes(int(ranks), model.layers, o))
          for (int b = 1; b <= o.max_microbatch; b *= 2) {
            if (!traced.count(b)) continue;
            // Optimizer offload over w > 1 replicas is sharded (ZeRO-Offload): the distributed
            // optimizer, on the host; w = 1 without it.
            const std::vector<bool> dopts =
                offload == Offload::optimizer ? std::vector<bool>{w > 1} : o.distributed_optimizer;
            for (const Plan& shape :
                 plans_for(w, d, b, model.layers, o, model.attention == models::Attention::unfused))
              for (bool dopt : dopts) {
                if (dopt && (w == 1 || offload == Offload::chunks)) continue;
                if (modes.activations && any_recompute(shape)) continue;  // the rule chooses
                // Chunks: every schedule (each stage its own chunks; interleaved: over its model
                // chunks' layers).
                Plan p = shape;
                p.t = t;
                p.sp = sp;
                p.distributed_optimizer = dopt;
                p.offload = offload;
                try {
                  resolve_stages(p, model.layers);
                  place(p, {cluster.nodes, cluster.gpus_per_node}, o.ranks_per_gpu);
                } catch (const PlanError&) {
                  continue;  // e.g. more virtual stages than blocks
                }
                // The evenly split plan, and the split balanced by time when it differs (the
                // head-heavy last stage gets fewer blocks; it may need more memory elsewhere).
                std::vector<Plan> shapes_of = {p};
                if (p.d > 1) {
                  Plan q = p;
                  q.stage_blocks = time_balanced_split(p, model.layers, trace);
                  if (q.stage_blocks != p.stage_blocks) shapes_of.push_back(q);
                }
                // Activation offload: the rule's choices, with the stages where nothing can swap
                // keeping their stash (faster) or recomputing (smaller) when that differs.
                std::vector<Plan> splits;
                for (Plan& x : shapes_of) {
                  if (!modes.activations) {
                    splits.push_back(x);
                    continue;
                  }
                  x.offload_activations = true;
                  // Swaps that would pass the usable memory (--memory-headroom) recompute.
                  const auto keep = choose_activations(model, trace, cluster, x, true, usable);
                  const auto small = choose_activations(model, trace, cluster, x, false, usable);
                  set_activation_layers(x, keep);
                  splits.push_back(x);
                  if (small != keep) {
                    set_activation_layers(x, small);
                    splits.push_back(x);
                  }
                }
                // Chunks over w > 1 replicas: whole on every replica, and sharded (PatrickStar's
                // data-parallel chunks): the estimate picks.
                if (offload == Offload::chunks && p.w > 1)
                  for (std::size_t i = 0, n = splits.size(); i < n; ++i) {
                    Plan x = splits[i];
                    x.chunk_shard = true;
                    splits.push_back(std::move(x));
                  }
                for (Plan& x : splits) {
                  Candidate c{x, {}, true, ""};
                  if (x.offload == Offload::chunks) {
                    // The default chunk size, or where a layer's working set passes the device
                    // with it, the largest smaller one that fits (chunk_schedules; none: not a
                    // candidate). The plan names the size it took.
                    x.chunk_bytes = 0;
                    try {
                      c.estimate = estimate(model, trace, cluster, x);
                    } catch (const InputError&) {
                      ++result.considered;
                      continue;
                    }
                    x.chunk_bytes = c.estimate.chunks->front().layout.chunk_bytes;
                    c.plan = x;
                  } else {
                    c.estimate = estimate(model, trace, cluster, x);
                  }
                  for (auto& dev : c.estimate.report.devices) {
                    dev.fits = double(dev.peak_memory_bytes) <= usable;
                    c.fits = c.fits && dev.fits;
                  }
                  for (const auto& host : c.estimate.report.hosts)
                    c.fits = c.fits && host.fits();
                  if (!c.fits) c.memory_note = describe_oom(c.estimate.report);
                  ++result.considered;
                  (c.fits ? result.fitting : result.rejected).push_back(std::move(c));
                }
              }
          }
      }
  };
  enumerate({Offload::none, false});
  // Nothing fits on the devices alone: KARMA's activation swapping (stashes in host memory),
  // ZeRO-Offload's fp16-parameters-only device memory, or both may.
  const bool host_link = cluster.host.pcie_bandwidth_bytes_per_s > 0 &&
                         cluster.host.uplink_bandwidth_bytes_per_s > 0 &&
                         std::find(tps.begin(), tps.end(), 1) != tps.end();
  const bool cpu_adam = cluster.host.cpu_adam_params_per_s() > 0;
  if (o.offload_when_nothing_fits && result.fitting.empty() && result.considered > 0 && host_link) {
    SearchResult without = std::move(result);
    result = SearchResult{};
    enumerate({Offload::none, true});
    if (cpu_adam) {
      enumerate({Offload::optimizer, false});
      enumerate({Offload::optimizer, true});
      enumerate({Offload::chunks, false});  // PatrickStar: all model data in moving chunks
    }
    result.offload_reason = explain_no_fit(without);
    result.considered += without.considered;
    if (result.fitting.empty() && result.rejected.empty())
      result.rejected = std::move(without.rejected);
  }
  // Everything that fits recomputes: KARMA's point is that swapping the stash to the host can
  // be cheaper than recomputing it where the copies hide behind compute. Try it beside them.
  const bool all_recompute = !result.fitting.empty() && result.offload_reason.empty() &&
                             std::all_of(result.fitting.begin(), result.fitting.end(),
                                         [](const Candidate& c) { return any_recompute(c.plan); });
  if (o.offload_when_nothing_fits && all_recompute && host_link) {
    const std::size_t before = result.fitting.size();
    enumerate({Offload::none, true});
    if (cpu_adam) enumerate({Offload::optimizer, true});
    std::size_t swapping = 0;  // plans that move activations to the host
    for (std::size_t i = before; i < result.fitting.size(); ++i) {
      const common::Json& rep = result.fitting[i].estimate.report.extra;
      if (rep.contains("offload") && rep["offload"].value("activation_bytes_per_step", 0.0) > 0)
        ++swapping;
    }
    result.swap_reason = fmt::format(
        "every plan that fits recomputes activations, so the search also tried --offload "
        "activations{} (KARMA: swap a stage's stash to host memory where the copies hide behind "
        "compute): {} of {} such plans fit and swap somewhere",
        cpu_adam ? " and optimizer,activations" : "", swapping, result.fitting.size() - before);
  }
  if (result.considered == 0 && too_many_ranks > 0)
    throw InputError(fmt::format(
        "plan search: {} GPUs x {} ranks per GPU make {} pipeline ranks or more, more than the "
        "limit of {} (docs/formats.md, Limits)",
        cluster.devices(), o.ranks_per_gpu, too_many_ranks, common::kMaxRanks));
  if (result.considered == 0)
    throw InputError(fmt::format(
        "plan search: no valid plan for global batch {} on {} GPUs (B must be a multiple of w*b "
        "for some w dividing the GPUs / t and b a power of two <= {} in the trace)",
        o.global_batch, std::int64_t(cluster.devices()) * o.ranks_per_gpu, o.max_microbatch));
  auto order = [](const Candidate& a, const Candidate& b) {
    return better(a.samples_per_s(), a.plan, b.samples_per_s(), b.plan);
  };
  std::stable_sort(result.fitting.begin(), result.fitting.end(), order);
  std::stable_sort(result.rejected.begin(), result.rejected.end(), order);
  return result;
}

std::string explain_no_fit(const SearchResult& r) {
  if (r.rejected.empty()) return "no candidate plan";
  // The candidate that comes closest: smallest peak relative to its capacity.
  const Candidate* best = &r.rejected.front();
  for (const auto& c : r.rejected)
    if (c.peak_memory_bytes() < best->peak_memory_bytes()) best = &c;
  const Plan& p = best->plan;
  return fmt::format(
      "nothing fits in memory ({} candidates); the smallest, {} w={} d={} b={} m={}{}, "
      "still needs more: {}",
      r.considered, to_string(p.schedule), p.w, p.d, p.b, p.m,
      any_recompute(p) ? " with recompute" : "", best->memory_note);
}

}  // namespace pw::planner

namespace pw::planner {

int simulated_count(const SearchResult& result, int top, double within, int cap) {
  const int n = int(result.fitting.size());
  if (top <= 0 || n == 0) return 0;
  const int most = std::min(n, std::max(top, cap));
  const double floor = result.fitting.front().samples_per_s() * (1.0 - within);
  int k = std::min(top, n);
  while (k < most && result.fitting[std::size_t(k)].samples_per_s() >= floor)
    ++k;
  return k;
}

std::vector<Ranked> rank_by_simulation(const SearchResult& result, int top_k,
                                       const SimulateFn& simulate) {
  const std::size_t k =
      std::min<std::size_t>(std::size_t(std::max(top_k, 0)), result.fitting.size());
  std::vector<Plan> plans;
  for (std::size_t i = 0; i < k; ++i)
    plans.push_back(result.fitting[i].plan);
  const std::vector<Simulated> sims = k > 0 ? simulate(plans) : std::vector<Simulated>{};
  if (sims.size() != k)
    throw Error("plan search: the simulation function returned too few results");
  // Sorted by index (no optional moved around: GCC 12 warns about its copies in stable_sort).
  std::vector<std::size_t> order(k);
  for (std::size_t i = 0; i < k; ++i)
    order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const bool ga = sims[a].ok && sims[a].fits;
    const bool gb = sims[b].ok && sims[b].fits;
    if (ga != gb) return ga;
    if (!ga) return false;  // keep closed-form order among the failures
    return better(sims[a].samples_per_s, result.fitting[a].plan, sims[b].samples_per_s,
                  result.fitting[b].plan);
  });
  std::vector<Ranked> top;
  for (std::size_t i : order)
    top.push_back({result.fitting[i], sims[i]});
  for (std::size_t i = k; i < result.fitting.size(); ++i)
    top.push_back({result.fitting[i], std::nullopt});
  return top;
}

namespace {

std::vector<double> ranks_of(const std::vector<double>& x) {
  std::vector<std::size_t> idx(x.size());
  for (std::size_t i = 0; i < idx.size(); ++i)
    idx[i] = i;
  std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return x[a] < x[b]; });
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < idx.size();) {
    std::size_t j = i;
    while (j + 1 < idx.size() && x[idx[j + 1]] == x[idx[i]])
      ++j;
    for (std::size_t t = i; t <= j; ++t)
      r[idx[t]] = (double(i) + double(j)) / 2.0 + 1.0;
    i = j + 1;
  }
  return r;
}

}  // namespace

double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size() || a.size() < 2)
    throw Error("spearman: need two lists of equal size >= 2");
  const std::vector<double> ra = ranks_of(a), rb = ranks_of(b);
  const double n = double(a.size()), mean = (n + 1) / 2;
  double cov = 0, va = 0, vb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    cov += (ra[i] - mean) * (rb[i] - mean);
    va += (ra[i] - mean) * (ra[i] - mean);
    vb += (rb[i] - mean) * (rb[i] - mean);
  }
  return va > 0 && vb > 0 ? cov / std::sqrt(va * vb) : 1.0;
}

}  // namespace pw::planner
