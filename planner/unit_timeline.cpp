// Unit-time timeline: max-plus timing over the checker's execution order, plus text rendering.
#include "planner/unit_timeline.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "planner/checker.hpp"

namespace pw::planner {

DurationFn duration_fn(const Plan& plan, const Durations& t) {
  const double scale = t.chunk_scale ? 1.0 / plan.v : 1.0;
  return [t, scale](const Program&, const Op& op) {
    switch (op.kind) {
      case OpKind::forward:
        return t.forward * scale;
      case OpKind::backward:
        return t.backward * scale;
      case OpKind::recompute:
        return t.recompute * scale;
      case OpKind::all_reduce:
        return t.all_reduce;
      case OpKind::optimizer_step:
        return t.optimizer;
      case OpKind::free_version:
        return t.free_version;
      default:
        return t.comm;
    }
  };
}

Timeline run_timeline(const Programs& programs, const DurationFn& duration) {
  const Execution ex = execute(programs);
  const std::size_t ranks = programs.devices.size();
  std::vector<int> rank_of(std::size_t(ex.offset.back()));
  for (std::size_t r = 0; r < ranks; ++r) {
    std::fill(rank_of.begin() + ex.offset[r], rank_of.begin() + ex.offset[r + 1], int(r));
  }
  std::vector<OpTime> times(rank_of.size());
  std::vector<double> ready(ranks, 0.0);
  std::vector<char> group_timed(ex.groups.size(), 0);
  Timeline tl;
  tl.busy.assign(ranks, 0.0);
  auto run_op = [&](std::int64_t id, double earliest) {
    const int r = rank_of[std::size_t(id)];
    const Program& device = programs.devices[std::size_t(r)];
    const double dt = duration(device, device.ops[std::size_t(id - ex.offset[std::size_t(r)])]);
    const double start = std::max(ready[std::size_t(r)], earliest);
    times[std::size_t(id)] = {start, start + dt};
    ready[std::size_t(r)] = start + dt;
    tl.busy[std::size_t(r)] += dt;
  };
  for (std::int64_t id : ex.order) {
    const int r = rank_of[std::size_t(id)];
    const Op& op =
        programs.devices[std::size_t(r)].ops[std::size_t(id - ex.offset[std::size_t(r)])];
    if (is_recv(op.kind)) {
      run_op(id, times[std::size_t(ex.match[std::size_t(id)])].end);
    } else if (is_collective(op.kind)) {
      const std::size_t g = std::size_t(ex.match[std::size_t(id)]);
      if (group_timed[g]) continue;
      group_timed[g] = 1;
      double start = 0;
      for (std::int64_t member : ex.groups[g]) {
        start = std::max(start, ready[std::size_t(rank_of[std::size_t(member)])]);
      }
      for (std::int64_t member : ex.groups[g])
        run_op(member, start);
    } else {
      run_op(id, 0.0);
    }
  }
  tl.ops.resize(ranks);
  for (std::size_t r = 0; r < ranks; ++r) {
    tl.ops[r].assign(times.begin() + ex.offset[r], times.begin() + ex.offset[r + 1]);
    tl.makespan = std::max(tl.makespan, ready[r]);
  }
  return tl;
}

Timeline run_unit_timeline(const Programs& programs, const Durations& durations) {
  return run_timeline(programs, duration_fn(programs.plan, durations));
}

std::vector<double> optimizer_times(const Programs& programs, const Timeline& timeline, int rank) {
  std::vector<double> out;
  const auto& ops = programs.devices[std::size_t(rank)].ops;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].kind == OpKind::optimizer_step)
      out.push_back(timeline.ops[std::size_t(rank)][i].end);
  }
  return out;
}

StepTiming step_timing(const Programs& programs, const Timeline& timeline, int step) {
  StepTiming st;
  st.start = std::numeric_limits<double>::infinity();
  st.end = 0;
  for (std::size_t r = 0; r < programs.devices.size(); ++r) {
    const auto& ops = programs.devices[r].ops;
    double busy = 0;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].step != step) continue;
      const OpTime& t = timeline.ops[r][i];
      st.start = std::min(st.start, t.start);
      st.end = std::max(st.end, t.end);
      busy += t.end - t.start;
    }
    st.compute = std::max(st.compute, busy);
  }
  if (st.start > st.end) st.start = st.end;
  st.time = st.end - st.start;
  st.bubble = st.time - st.compute;
  return st;
}

double bubble_fraction(const Programs& programs, const Timeline& timeline, int step) {
  return step_timing(programs, timeline, step).fraction();
}

namespace {

std::string rstrip(std::string s) {
  while (!s.empty() && s.back() == ' ')
    s.pop_back();
  return s;
}

std::string label(const Op& op, const Plan& plan) {
  switch (op.kind) {
    case OpKind::send_activation:
      return "sA";
    case OpKind::recv_activation:
      return "rA";
    case OpKind::send_gradient:
      return "sG";
    case OpKind::recv_gradient:
      return "rG";
    case OpKind::all_reduce:
      return "AR";
    case OpKind::optimizer_step:
      return "OPT";
    case OpKind::free_version:
      return "X";
    default:
      return format_op(op, plan);
  }
}

bool drawn(const Op& op, const OpTime& t, const RenderOptions& options) {
  return t.end > t.start && (is_compute(op.kind) || options.show_comm);
}

std::string format_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

struct Scale {
  double unit = 1;  // time of one grid unit (the shortest drawn op)
  int chars = 1;    // characters per grid unit
  int x(double t) const { return int(std::lround(t / unit * chars)); }
};

// A whole number of characters per grid unit, wide enough for every label unless that would pass
// max_columns (0: no limit); then labels are cut to their spans.
Scale choose_scale(const Programs& p, const Timeline& tl, const RenderOptions& o, int avail) {
  Scale s;
  double shortest = std::numeric_limits<double>::infinity();
  std::size_t widest = 2;
  for (std::size_t r = 0; r < p.devices.size(); ++r) {
    for (std::size_t i = 0; i < p.devices[r].ops.size(); ++i) {
      const Op& op = p.devices[r].ops[i];
      if (!drawn(op, tl.ops[r][i], o)) continue;
      shortest = std::min(shortest, tl.ops[r][i].end - tl.ops[r][i].start);
      widest = std::max(widest, label(op, p.plan).size());
    }
  }
  s.unit = std::isfinite(shortest) ? shortest : 1.0;
  s.chars = int(widest) + 1;
  const double units = tl.makespan / s.unit;
  if (o.max_columns > 0 && units * s.chars > avail) {
    s.chars = std::max(1, int(std::floor(avail / std::max(units, 1.0))));
  }
  return s;
}

std::string render_row(const Programs& p, const Timeline& tl, std::size_t r, const Scale& s,
                       const RenderOptions& o, int width) {
  std::string row(std::size_t(width), ' ');
  for (double t = 0; s.x(t) < width; t += s.unit)
    row[std::size_t(s.x(t))] = '.';
  for (std::size_t i = 0; i < p.devices[r].ops.size(); ++i) {
    const Op& op = p.devices[r].ops[i];
    const OpTime& t = tl.ops[r][i];
    if (!drawn(op, t, o)) continue;
    const int begin = s.x(t.start), end = std::max(s.x(t.end), begin + 1);
    const std::string text = label(op, p.plan);
    for (int x = begin; x < end && x < width; ++x) {
      const std::size_t k = std::size_t(x - begin);
      row[std::size_t(x)] = k < text.size() && x + 1 < end ? text[k] : (x + 1 == end ? ' ' : '-');
    }
  }
  return row;
}

std::string time_axis(const Scale& s, double makespan, int width, std::size_t indent) {
  std::string axis(std::size_t(width), ' ');
  const double min_gap = 6.0 * s.unit / s.chars;  // keep tick labels apart
  const double steps[3] = {2, 2.5, 2};            // 1, 2, 5, 10, 20, 50 ... grid units
  double tick = s.unit;
  for (int i = 0; tick < min_gap; ++i)
    tick *= steps[i % 3];
  for (double t = 0; t <= makespan + 1e-9; t += tick) {
    const std::string text = format_number(t);
    const int x = s.x(t);
    for (std::size_t k = 0; k < text.size() && x + int(k) < width; ++k) {
      axis[std::size_t(x) + k] = text[k];
    }
  }
  return std::string(indent, ' ') + axis;
}

}  // namespace

std::string render_timeline(const Programs& p, const Timeline& tl, const RenderOptions& o) {
  std::vector<std::string> names;
  std::size_t indent = 0;
  for (const Program& device : p.devices) {
    names.push_back("rank " + std::to_string(device.rank) + " s" + std::to_string(device.stage) +
                    (p.plan.w > 1 ? " r" + std::to_string(device.replica) : "") + " |");
    indent = std::max(indent, names.back().size());
  }
  const int avail = std::max(20, o.max_columns - int(indent));
  const Scale s = choose_scale(p, tl, o, avail);
  const int width = std::max(1, s.x(tl.makespan));
  std::string out = "time" + rstrip(time_axis(s, tl.makespan, width, indent - 4)) + "\n";
  for (std::size_t r = 0; r < p.devices.size(); ++r) {
    std::string pad(indent - names[r].size(), ' ');
    out += pad + names[r] + rstrip(render_row(p, tl, r, s, o, width)) + "\n";
  }
  out += "F<k>/B<k>/R<k>: forward/backward/recompute of microbatch k (1-based over all steps)";
  if (p.plan.v > 1) out += ", .c = chunk c";
  out += "; '.' idle, one per " + format_number(s.unit) + " time units; makespan " +
         format_number(tl.makespan) + "\n";
  return out;
}

std::string print_programs(const Programs& p, int columns) {
  std::string out;
  const bool versions = p.plan.schedule == Schedule::two_bw;
  for (const Program& device : p.devices) {
    std::string line = "rank " + std::to_string(device.rank) + " (stage " +
                       std::to_string(device.stage) + ", replica " +
                       std::to_string(device.replica) + "):";
    for (const Op& op : device.ops) {
      std::string token = format_op(op, p.plan);
      if (versions && is_compute(op.kind)) token += "@" + std::to_string(op.version);
      if (int(line.size() + 1 + token.size()) > columns) {
        out += line + "\n";
        line = "   ";
      }
      line += " " + token;
    }
    out += line + "\n";
  }
  return out;
}

}  // namespace pw::planner
