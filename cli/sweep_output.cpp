// `pipewright sweep` outputs: the rows as a JSON document ("pipewright.sweep/1"), as CSV (the same
// fields, per-stage peaks spread over columns) and as a short table for people.
#include <algorithm>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/sweep.hpp"

namespace pw::cli::sweep {

namespace {

using common::Json;

// A --vary value as JSON: a number or bool when it parses as one (as --set does), else a string.
Json typed(const std::string& text) {
  Json v = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!v.is_discarded() && (v.is_number() || v.is_boolean())) return v;
  return Json(text);
}

bool is_varied(const SweepSpec& spec, const std::string& key) {
  return std::any_of(spec.axes.begin(), spec.axes.end(),
                     [&](const Axis& a) { return a.key == key; });
}

// Peak memory per stage: the largest over the stage's replicas.
std::vector<std::int64_t> stage_peaks(const planner::RunReport& r) {
  std::vector<std::int64_t> peaks(std::size_t(r.plan.d), 0);
  for (const auto& d : r.devices)
    peaks[std::size_t(d.stage)] = std::max(peaks[std::size_t(d.stage)], d.peak_memory_bytes);
  return peaks;
}

void add_results(Json& j, const Row& row) {
  const auto& r = row.report;
  const bool sim = row.simulated;
  double bubble = 0;
  std::int64_t peak = 0;
  Json per_device = Json::array();
  for (const auto& d : r.devices) {
    bubble = std::max(bubble, d.bubble_fraction);
    peak = std::max(peak, d.peak_memory_bytes);
    per_device.push_back(d.peak_memory_bytes);
  }
  j["step_time_s"] = sim ? Json(r.iteration_time_s) : Json();
  j["samples_per_s"] = sim ? Json(r.samples_per_s) : Json();
  j["tokens_per_s"] = sim ? Json(r.tokens_per_s) : Json();
  j["mfu"] = sim ? Json(r.mfu) : Json();
  j["bubble_fraction"] = sim ? Json(bubble) : Json();
  j["peak_memory_bytes"] = sim ? Json(peak) : Json();
  j["peak_memory_bytes_per_stage"] = sim ? Json(stage_peaks(r)) : Json();
  j["peak_memory_bytes_per_device"] = sim ? per_device : Json();
  j["fits"] = row.error.empty() ? Json(row.fits) : Json();
  j["note"] = row.note;
  j["error"] = row.error;
}

// One row's fields, in column order (the per-device list last).
Json row_json(const SweepSpec& spec, const Row& row) {
  Json j = Json::object();
  for (std::size_t i = 0; i < spec.axes.size(); ++i)
    j[spec.axes[i].key] = typed(row.point[i]);
  const auto& p = row.plan;
  const std::pair<const char*, Json> plan_fields[] = {
      {"schedule", row.planned ? Json(planner::to_string(p.schedule)) : Json()},
      {"t", row.planned ? Json(p.t) : Json()},
      {"w", row.planned ? Json(p.w) : Json()},
      {"d", row.planned ? Json(p.d) : Json()},
      {"b", row.planned ? Json(p.b) : Json()},
      {"m", row.planned ? Json(p.m) : Json()},
      {"v", row.planned ? Json(p.v) : Json()},
      {"global_batch", row.planned ? Json(p.global_batch()) : Json()}};
  for (const auto& [name, value] : plan_fields)
    if (!is_varied(spec, name)) j[name] = value;
  add_results(j, row);
  return j;
}

std::string csv_cell(const Json& v) {
  if (v.is_null()) return "";
  if (!v.is_string()) return v.dump();
  const std::string s = v.get<std::string>();
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string quoted = "\"";
  for (char c : s)
    quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
  return quoted + "\"";
}

std::size_t max_stages(const std::vector<Row>& rows) {
  std::size_t n = 0;
  for (const auto& r : rows)
    if (r.simulated) n = std::max(n, std::size_t(r.report.plan.d));
  return n;
}

}  // namespace

Json to_json(const SweepSpec& spec, const std::vector<Row>& rows) {
  Json vary = Json::object();
  for (const auto& a : spec.axes) {
    vary[a.key] = Json::array();
    for (const auto& v : a.values)
      vary[a.key].push_back(typed(v));
  }
  Json out = {{"format", "pipewright.sweep/1"},
              {"model", spec.model},
              {"cluster", spec.cluster.cluster},
              {"sets", spec.cluster.sets},
              {"plan_best", spec.plan_best},
              {"steps", spec.steps},
              {"vary", vary},
              {"rows", Json::array()}};
  for (const auto& r : rows)
    out["rows"].push_back(row_json(spec, r));
  return out;
}

std::string to_csv(const SweepSpec& spec, const std::vector<Row>& rows) {
  const std::size_t stages = max_stages(rows);
  std::vector<Json> objects;
  for (const auto& r : rows)
    objects.push_back(row_json(spec, r));
  // The header from a row's keys (every row has the same keys), per-stage lists spread out.
  std::vector<std::string> header;
  Row blank;
  blank.point.resize(spec.axes.size());
  const Json fields = row_json(spec, blank);  // a named object: items() does not own it
  for (const auto& [k, v] : fields.items()) {
    if (k == "peak_memory_bytes_per_device") continue;
    if (k != "peak_memory_bytes_per_stage") {
      header.push_back(k);
      continue;
    }
    for (std::size_t s = 0; s < stages; ++s)
      header.push_back(fmt::format("peak_memory_bytes_stage{}", s));
  }
  std::string text = fmt::format("{}\n", fmt::join(header, ","));
  for (const auto& j : objects) {
    std::vector<std::string> cells;
    for (const auto& [k, v] : j.items()) {
      if (k == "peak_memory_bytes_per_device") continue;
      if (k != "peak_memory_bytes_per_stage") {
        cells.push_back(csv_cell(v));
        continue;
      }
      for (std::size_t s = 0; s < stages; ++s)
        cells.push_back(v.is_array() && s < v.size() ? v[s].dump() : "");
    }
    text += fmt::format("{}\n", fmt::join(cells, ","));
  }
  return text;
}

void print_table(const SweepSpec& spec, const std::vector<Row>& rows) {
  std::vector<std::vector<std::string>> table;
  std::vector<std::string> head;
  for (const auto& a : spec.axes)
    head.push_back(a.key);
  for (const char* h : {"plan", "step time", "samples/s", "MFU", "peak memory", ""})
    head.push_back(h);
  table.push_back(head);
  for (const auto& r : rows) {
    std::vector<std::string> line = r.point;
    const auto& p = r.plan;
    line.push_back(r.planned
                       ? fmt::format("{} w={} d={} b={} m={}{}", planner::to_string(p.schedule),
                                     p.w, p.d, p.b, p.m,
                                     p.any_offload() ? " offload=" + planner::offload_name(p) : "")
                       : "-");
    const auto& rep = r.report;
    std::int64_t peak = 0;
    for (const auto& d : rep.devices)
      peak = std::max(peak, d.peak_memory_bytes);
    line.push_back(r.simulated ? human_seconds(rep.iteration_time_s) : "-");
    line.push_back(r.simulated ? fmt::format("{:.2f}", rep.samples_per_s) : "-");
    line.push_back(r.simulated ? fmt::format("{:.1f}%", 100 * rep.mfu) : "-");
    line.push_back(r.simulated ? human_bytes(double(peak)) : "-");
    std::string status = !r.error.empty() ? "error: " + r.error : r.note;
    if (status.size() > 60) status = status.substr(0, 57) + "...";
    line.push_back(status);
    table.push_back(line);
  }
  std::vector<std::size_t> width(head.size(), 0);
  for (const auto& line : table)
    for (std::size_t c = 0; c < line.size(); ++c)
      width[c] = std::max(width[c], line[c].size());
  for (const auto& line : table) {
    std::string text = " ";
    for (std::size_t c = 0; c < line.size(); ++c)
      text += fmt::format(" {:<{}}", line[c], c + 1 == line.size() ? 0 : width[c]);
    while (!text.empty() && text.back() == ' ')
      text.pop_back();
    fmt::print("{}\n", text);
  }
}

}  // namespace pw::cli::sweep
