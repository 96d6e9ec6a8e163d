// `pipewright sweep`: --vary parsing and checks, the cross product, planning each point and
// simulating the points in child processes.
#include "cli/sweep.hpp"

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>

#include "common/limits.hpp"
#include "planner/search.hpp"
#include "sim/simulator.hpp"
#include "traces/analytic.hpp"

namespace pw::cli::sweep {

namespace {

const std::map<std::string, KeyKind>& plan_keys() {
  static const std::map<std::string, KeyKind> keys = {
      {"model", KeyKind::model}, {"schedule", KeyKind::schedule},
      {"b", KeyKind::b},         {"m", KeyKind::m},
      {"B", KeyKind::B},         {"w", KeyKind::w},
      {"d", KeyKind::d},         {"recompute", KeyKind::recompute},
      {"t", KeyKind::t}};
  return keys;
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  for (;;) {
    const std::size_t end = text.find(',', pos);
    out.push_back(text.substr(pos, end == std::string::npos ? end : end - pos));
    if (end == std::string::npos) return out;
    pos = end + 1;
  }
}

std::int64_t parse_positive(const std::string& text) {
  std::size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || v < 1)
    throw InputError(fmt::format("\"{}\" is not a positive integer", text));
  if (v > common::kMaxCount)  // the limit of the plan flags and files
    throw InputError(fmt::format("{} is more than {}", text, common::kMaxCount));
  return v;
}

// A recompute value: a mode (none, selective, full, block), or true / false for full / none.
planner::Recompute parse_recompute_value(const std::string& text) {
  if (text == "true") return planner::Recompute::full;
  if (text == "false") return planner::Recompute::none;
  try {
    return planner::parse_recompute(text);
  } catch (const InputError&) {
    throw InputError(fmt::format(
        "\"{}\" is not a recompute mode (none, selective, full, block, true or false)", text));
  }
}

// The sets that make a point's cluster: the base --set list, then the point's cluster axes.
std::vector<std::string> cluster_sets(const SweepSpec& spec, const Point& pt) {
  std::vector<std::string> sets = spec.cluster.sets;
  for (std::size_t i = 0; i < spec.axes.size(); ++i)
    if (spec.axes[i].kind == KeyKind::cluster) sets.push_back(spec.axes[i].key + "=" + pt[i]);
  return sets;
}

// apply_set's messages start with "--set KEY=VALUE: "; the sweep names the key itself.
std::string strip_set_prefix(const std::string& message, const std::string& set) {
  const std::string prefix = "--set " + set + ": ";
  return message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
}

void check_value(const SweepSpec& spec, const Axis& axis, const std::string& value) {
  switch (axis.kind) {
    case KeyKind::model:
      models::load_model(value);
      return;
    case KeyKind::schedule:
      planner::parse_schedule(value);
      return;
    case KeyKind::recompute:
      parse_recompute_value(value);
      return;
    case KeyKind::cluster: {
      std::vector<std::string> sets = spec.cluster.sets;
      sets.push_back(axis.key + "=" + value);
      try {
        clusters::load_cluster(spec.cluster.cluster, spec.cluster.nodes, sets);
      } catch (const InputError& e) {
        std::string msg = strip_set_prefix(e.what(), sets.back());
        if (msg.find("unknown key") != std::string::npos)
          throw InputError(
              fmt::format("sweep: --vary {}: {}; or a plan key: model, schedule, b, "
                          "m, B, t, w, d, recompute",
                          axis.key, msg));
        throw InputError(fmt::format("sweep: --vary {}={}: {}", axis.key, value, msg));
      }
      return;
    }
    default:
      parse_positive(value);
      return;
  }
}

bool varies(const SweepSpec& spec, KeyKind kind) {
  return std::any_of(spec.axes.begin(), spec.axes.end(),
                     [&](const Axis& a) { return a.kind == kind; });
}

void check_combination(const SweepSpec& spec) {
  std::set<std::string> seen;
  for (const auto& a : spec.axes)
    if (!seen.insert(a.key).second)
      throw InputError(fmt::format("sweep: --vary {}: given twice", a.key));
  const bool has_batch = spec.batch.has_value() || varies(spec, KeyKind::B);
  if (has_batch && (varies(spec, KeyKind::m) || spec.plan.m))
    throw InputError("sweep: --vary m (or -m) and a global batch (--batch, --vary B) both set m");
  if (!spec.plan_best) return;
  if (!has_batch) throw InputError("sweep: --plan-best needs --batch B or --vary B=...");
  for (KeyKind k : {KeyKind::b, KeyKind::m, KeyKind::recompute})
    if (varies(spec, k))
      throw InputError(
          "sweep: --plan-best chooses b, m and recompute itself; vary B, w, d, schedule, the "
          "model or the cluster instead");
}

}  // namespace

Axis parse_vary(const std::string& text) {
  const std::size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size())
    throw InputError(fmt::format("sweep: --vary {}: expected KEY=v1,v2,...", text));
  Axis a;
  a.key = text.substr(0, eq);
  auto it = plan_keys().find(a.key);
  a.kind = it == plan_keys().end() ? KeyKind::cluster : it->second;
  a.values = split_commas(text.substr(eq + 1));
  for (const auto& v : a.values)
    if (v.empty()) throw InputError(fmt::format("sweep: --vary {}: empty value", text));
  return a;
}

std::vector<Point> cross_product(const std::vector<Axis>& axes) {
  std::vector<Point> points = {{}};
  for (const auto& axis : axes) {
    std::vector<Point> next;
    for (const auto& p : points)
      for (const auto& v : axis.values) {
        next.push_back(p);
        next.back().push_back(v);
      }
    points = std::move(next);
  }
  return points;
}

void validate(const SweepSpec& spec) {
  if (spec.axes.empty()) throw InputError("sweep: give at least one --vary KEY=v1,v2,...");
  std::int64_t points = 1;
  for (const auto& axis : spec.axes)
    points =
        common::checked_mul(points, std::int64_t(axis.values.size()),
                            "sweep: points of the --vary cross product", common::kMaxSweepPoints);
  check_combination(spec);
  models::load_model(spec.model);
  spec.cluster.load();
  if (!spec.plan.plan_file.empty()) planner::load_plan(spec.plan.plan_file);
  planner::parse_schedule(spec.plan.schedule);
  for (const auto& axis : spec.axes)
    for (const auto& value : axis.values) {
      try {
        check_value(spec, axis, value);
      } catch (const InputError& e) {
        const std::string msg = e.what();
        if (msg.rfind("sweep: ", 0) == 0) throw;
        throw InputError(fmt::format("sweep: --vary {}={}: {}", axis.key, value, msg));
      }
    }
}

namespace {

// The plan fields a point overrides.
struct Overrides {
  std::optional<std::string> schedule;
  std::optional<int> t, w, d, b, m;
  std::optional<planner::Recompute> recompute;
  std::optional<std::int64_t> batch;
};

Overrides overrides_of(const SweepSpec& spec, const Point& pt) {
  Overrides o;
  o.batch = spec.batch;
  for (std::size_t i = 0; i < spec.axes.size(); ++i) {
    const std::string& v = pt[i];
    switch (spec.axes[i].kind) {
      case KeyKind::schedule:
        o.schedule = v;
        break;
      case KeyKind::t:
        o.t = int(parse_positive(v));
        break;
      case KeyKind::w:
        o.w = int(parse_positive(v));
        break;
      case KeyKind::d:
        o.d = int(parse_positive(v));
        break;
      case KeyKind::b:
        o.b = int(parse_positive(v));
        break;
      case KeyKind::m:
        o.m = int(parse_positive(v));
        break;
      case KeyKind::B:
        o.batch = parse_positive(v);
        break;
      case KeyKind::recompute:
        o.recompute = parse_recompute_value(v);
        break;
      default:
        break;
    }
  }
  return o;
}

std::string model_of(const SweepSpec& spec, const Point& pt) {
  for (std::size_t i = 0; i < spec.axes.size(); ++i)
    if (spec.axes[i].kind == KeyKind::model) return pt[i];
  return spec.model;
}

int microbatches_for(std::int64_t batch, int w, int b) {
  if (batch % (std::int64_t(w) * b) != 0)
    throw PlanError(fmt::format("m = B/(w*b) = {}/({}*{}) is not an integer", batch, w, b));
  const std::int64_t m = batch / (std::int64_t(w) * b);
  if (m > common::kMaxCount)
    throw PlanError(fmt::format("m = B/(w*b) = {} is more than {}", m, common::kMaxCount));
  return int(m);
}

// A fixed plan (file or flags) with the point's overrides, resolved and placed.
planner::Plan fixed_plan(const SweepSpec& spec, const Overrides& o, std::int64_t layers,
                         const clusters::Cluster& c) {
  planner::Plan p;
  const int ranks = c.devices() * spec.plan.ranks_per_gpu;
  if (spec.plan.plan_file.empty()) {
    PlanOptions f = spec.plan;
    if (o.schedule) f.schedule = *o.schedule;
    if (o.d) f.d = o.d;
    if (o.w) f.w = o.w;
    if (o.b) f.b = *o.b;
    if (o.m) f.m = o.m;
    if (o.recompute) f.recompute = planner::to_string(*o.recompute);
    if (o.t) f.t = *o.t;
    const int d = f.d.value_or(1);
    const int groups = ranks / std::max(f.t, 1);
    const int w = f.w.value_or(d > 0 && groups % d == 0 ? std::max(1, groups / d) : 1);
    if (o.batch) f.m = microbatches_for(*o.batch, w, f.b);
    p = f.build(layers, c.devices());
  } else {
    p = planner::load_plan(spec.plan.plan_file);
    if (o.schedule) p.schedule = planner::parse_schedule(*o.schedule);
    if (o.d && *o.d != p.d) {
      p.d = *o.d;
      p.stage_blocks.clear();  // a new depth is balanced
      if (!p.recompute.empty())
        p.recompute.assign(std::size_t(p.d), planner::Recompute(p.recompute.front()));
    }
    if (o.t && *o.t != p.t) {
      p.t = *o.t;
      p.placement.clear();  // TP groups of another size: placed anew
    }
    if (o.w) p.w = *o.w;
    if (o.b) p.b = *o.b;
    if (o.m) p.m = *o.m;
    if (o.recompute) p.recompute.assign(std::size_t(p.d), *o.recompute);
    if (o.batch) p.m = microbatches_for(*o.batch, p.w, p.b);
    planner::resolve_stages(p, layers);
  }
  planner::place(p, {c.nodes, c.gpus_per_node}, spec.plan.ranks_per_gpu);
  return p;
}

// The planner's best fitting plan for the point's batch; nullopt (and a note) when none fits.
std::optional<planner::Plan> best_plan(const SweepSpec& spec, const Overrides& o,
                                       const models::ModelSpec& model, const clusters::Cluster& c,
                                       std::string& note) {
  planner::SearchOptions opt;
  opt.global_batch = *o.batch;
  opt.ranks_per_gpu = spec.plan.ranks_per_gpu;
  if (o.schedule) opt.schedules = {planner::parse_schedule(*o.schedule)};
  opt.width = o.w;
  opt.depth = o.d;
  if (o.t) opt.tensor_parallel = {*o.t};
  std::vector<std::int64_t> sizes;
  for (std::int64_t b = 1; b <= opt.max_microbatch; b *= 2)
    sizes.push_back(b);
  const auto result = planner::search_plans(
      model,
      [&](const models::Sharding& s) { return traces::analytic_trace(model, c.device, sizes, s); },
      c, opt);
  if (result.fitting.empty()) {
    note = "no plan fits: " + planner::explain_no_fit(result);
    return std::nullopt;
  }
  return result.fitting.front().plan;
}

std::string no_fit_note(const planner::RunReport& r) {
  for (const auto& d : r.devices)
    if (!d.fits)
      return fmt::format("does not fit: rank {} (stage {}) needs {} of {}", d.rank, d.stage,
                         human_bytes(double(d.peak_memory_bytes)),
                         human_bytes(double(d.capacity_bytes)));
  // The devices fit: a host (offload) does not.
  const std::string why = planner::describe_oom(r);
  return why.empty() ? "" : "does not fit: " + why;
}

// Plans one point; returns the simulation job, or nullopt when the row is already final.
std::optional<sim::SimJob> prepare(const SweepSpec& spec, Row& row, sim::SimOptions options) {
  try {
    const Overrides o = overrides_of(spec, row.point);
    models::ModelSpec model = models::load_model(model_of(spec, row.point));
    clusters::Cluster c = clusters::load_cluster(spec.cluster.cluster, spec.cluster.nodes,
                                                 cluster_sets(spec, row.point));
    std::optional<planner::Plan> plan;
    if (spec.plan_best)
      plan = best_plan(spec, o, model, c, row.note);
    else
      plan = fixed_plan(spec, o, model.layers, c);
    if (!plan) return std::nullopt;
    row.planned = true;
    row.plan = *plan;
    traces::Trace trace = traces::analytic_trace(model, c.device, {plan->b}, {plan->t, plan->sp});
    return sim::SimJob{std::move(model), std::move(trace), std::move(c), *plan, options};
  } catch (const Error& e) {
    row.error = e.what();
    return std::nullopt;
  }
}

}  // namespace

std::vector<Row> run_sweep(const SweepSpec& spec, const std::function<void(int, int)>& progress) {
  std::vector<Row> rows;
  std::vector<sim::SimJob> jobs;
  std::vector<std::size_t> job_row;
  sim::SimOptions options;
  options.steps = spec.steps;
  for (auto& pt : cross_product(spec.axes)) {
    rows.push_back(Row{});
    rows.back().point = std::move(pt);
    if (auto job = prepare(spec, rows.back(), options)) {
      jobs.push_back(std::move(*job));
      job_row.push_back(rows.size() - 1);
    }
  }
  const int total = int(rows.size());
  const int settled = total - int(jobs.size());
  if (progress) progress(settled, total);
  auto outcomes = sim::simulate_batch(jobs, spec.parallel, [&](int done, int) {
    if (progress) progress(settled + done, total);
  });
  for (std::size_t j = 0; j < outcomes.size(); ++j) {
    Row& row = rows[job_row[j]];
    if (!outcomes[j].ok) {
      row.error = outcomes[j].error;
      continue;
    }
    row.simulated = true;
    row.report = std::move(outcomes[j].result.report);
    row.fits = row.report.fits();
    if (!row.fits) row.note = no_fit_note(row.report);
  }
  return rows;
}

}  // namespace pw::cli::sweep
