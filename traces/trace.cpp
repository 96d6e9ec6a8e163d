// Trace documents ("pipewright.trace/1"): strict reading, canonical writing, lookup by b.
#include "traces/trace.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "common/limits.hpp"

namespace pw::traces {

namespace {

constexpr const char* kTraceFormat = "pipewright.trace/1";

using common::Json;
using common::JsonReader;

TraceSource parse_source(const JsonReader& r) {
  TraceSource s;
  s.kind = r.get_string("kind");
  if (s.kind != "analytic" && s.kind != "measured")
    r.fail_member("kind",
                  fmt::format("unknown kind \"{}\"; expected analytic or measured", s.kind));
  s.device_name = r.get_string("device_name");
  s.date = r.get_string("date");
  s.driver = r.get_string("driver");
  s.tool = r.get_string("tool");
  return s;
}

LayerStatic parse_static(const JsonReader& r) {
  LayerStatic s;
  s.parameters = r.get_int_in("parameters", 0, common::kMaxBytes);
  s.parameter_bytes = r.get_int_in("parameter_bytes", 0, common::kMaxBytes);
  s.optimizer_step_s = r.get_nonnegative("optimizer_step_s");
  return s;
}

LayerTimes parse_times(const JsonReader& r) {
  LayerTimes t;
  t.forward_s = r.get_nonnegative("forward_s");
  t.backward_s = r.get_nonnegative("backward_s");
  t.backward_input_s = r.get_nonnegative("backward_input_s");
  t.backward_weight_s = r.get_nonnegative("backward_weight_s");
  t.recompute_s = r.get_nonnegative("recompute_s");
  t.activation_bytes = r.get_int_in("activation_bytes", 0, common::kMaxBytes);
  t.activation_recompute_bytes = r.get_int_in("activation_recompute_bytes", 0, common::kMaxBytes);
  // Optional (traces written before selective recompute): nothing dropped, nothing re-run.
  t.activation_selective_bytes =
      r.has("activation_selective_bytes")
          ? r.get_int_in("activation_selective_bytes", 0, common::kMaxBytes)
          : t.activation_bytes;
  t.selective_recompute_s =
      r.has("selective_recompute_s") ? r.get_nonnegative("selective_recompute_s") : 0.0;
  t.output_bytes = r.get_int_in("output_bytes", 0, common::kMaxBytes);
  t.workspace_bytes = r.get_int_in("workspace_bytes", 0, common::kMaxBytes);
  return t;
}

template <class T, class F>
ByLayer<T> parse_by_layer(const JsonReader& r, F parse_one) {
  ByLayer<T> out;
  for (auto k : kLayerKinds)
    out[k] = parse_one(r.at(models::to_string(k)));
  return out;
}

Json static_json(const LayerStatic& s) {
  return {{"parameters", s.parameters},
          {"parameter_bytes", s.parameter_bytes},
          {"optimizer_step_s", s.optimizer_step_s}};
}

Json times_json(const LayerTimes& t) {
  return {{"forward_s", t.forward_s},
          {"backward_s", t.backward_s},
          {"backward_input_s", t.backward_input_s},
          {"backward_weight_s", t.backward_weight_s},
          {"recompute_s", t.recompute_s},
          {"selective_recompute_s", t.selective_recompute_s},
          {"activation_bytes", t.activation_bytes},
          {"activation_recompute_bytes", t.activation_recompute_bytes},
          {"activation_selective_bytes", t.activation_selective_bytes},
          {"output_bytes", t.output_bytes},
          {"workspace_bytes", t.workspace_bytes}};
}

template <class T, class F>
Json by_layer_json(const ByLayer<T>& v, F to_json_one) {
  Json j = Json::object();
  for (auto k : kLayerKinds)
    j[models::to_string(k)] = to_json_one(v[k]);
  return j;
}

std::vector<Entry> parse_entries(const JsonReader& r) {
  std::vector<Entry> entries;
  for (std::size_t i = 0; i < r.size(); ++i) {
    JsonReader e = r.at(i);
    Entry entry;
    entry.microbatch_size = e.get_int_in("microbatch_size", 1, common::kMaxCount);
    for (const auto& prev : entries)
      if (prev.microbatch_size == entry.microbatch_size)
        e.fail_member("microbatch_size",
                      fmt::format("microbatch size {} appears twice", entry.microbatch_size));
    entry.layers = parse_by_layer<LayerTimes>(e.at("layers"), parse_times);
    entries.push_back(std::move(entry));
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.microbatch_size < b.microbatch_size; });
  return entries;
}

}  // namespace

const Entry& Trace::at(std::int64_t b) const {
  for (const auto& e : entries)
    if (e.microbatch_size == b) return e;
  std::string has;
  for (const auto& e : entries)
    has += (has.empty() ? "" : ", ") + std::to_string(e.microbatch_size);
  throw InputError(fmt::format("trace {}: no entry for microbatch size {} (has {})", origin, b,
                               has.empty() ? "none" : has));
}

std::vector<std::int64_t> Trace::microbatch_sizes() const {
  std::vector<std::int64_t> out;
  for (const auto& e : entries)
    out.push_back(e.microbatch_size);
  return out;
}

Trace mean_of(const std::vector<Trace>& traces) {
  if (traces.empty()) throw InputError("the mean of no traces");
  // A layer's times: what differs between profiles of one model.
  static constexpr double LayerTimes::*kTimes[] = {
      &LayerTimes::forward_s,         &LayerTimes::backward_s,  &LayerTimes::backward_input_s,
      &LayerTimes::backward_weight_s, &LayerTimes::recompute_s, &LayerTimes::selective_recompute_s};
  // Calls f(field of `to`, the same field of `from`) for every time of the two traces.
  auto each_time = [](Trace& to, const Trace& from, auto&& f) {
    for (models::LayerKind k : kLayerKinds) {
      f(to.statics[k].optimizer_step_s, from.statics[k].optimizer_step_s);
      for (std::size_t e = 0; e < to.entries.size() && e < from.entries.size(); ++e)
        for (double LayerTimes::*time : kTimes)
          f(to.entries[e].layers[k].*time, from.entries[e].layers[k].*time);
    }
  };
  Trace out = traces.front();
  for (std::size_t i = 1; i < traces.size(); ++i) {
    // Same shape: the trace with the first's times must equal the first.
    Trace same = traces[i];
    each_time(same, out, [](double& to, double from) { to = from; });
    if (!(same == out))
      throw InputError(fmt::format("trace {}: differs from trace {} in more than its times",
                                   traces[i].origin, out.origin));
  }
  for (std::size_t i = 1; i < traces.size(); ++i)
    each_time(out, traces[i], [](double& sum, double time) { sum += time; });
  const double n = double(traces.size());
  each_time(out, out, [n](double& sum, double) { sum /= n; });
  return out;
}

void check_sharding(const Trace& t, const models::Sharding& sharding) {
  if (t.sharding == sharding) return;
  auto shape = [](const models::Sharding& s) {
    return fmt::format("t = {}{}", s.t, s.sp ? " with SP" : "");
  };
  throw InputError(fmt::format("{}: /tensor_parallel: trace is for {}, but the plan has {}",
                               t.origin, shape(t.sharding), shape(sharding)));
}

Trace parse_trace(const Json& json, const std::string& source) {
  JsonReader r(json, source);
  r.expect_format(kTraceFormat);
  Trace t;
  t.origin = source;
  t.model = r.get_string("model");
  t.device = r.get_string("device");
  try {
    t.dtype = models::parse_dtype(r.get_string("dtype"));
  } catch (const InputError& e) {
    r.fail_member("dtype", e.what());
  }
  // Optional (traces written before tensor parallelism): one rank holding everything.
  if (auto tp = r.find("tensor_parallel")) {
    t.sharding.t = int(tp->as_int_in(1, common::kMaxCount));
  }
  if (auto sp = r.find("sequence_parallel")) t.sharding.sp = sp->as_bool();
  t.source = parse_source(r.at("source"));
  t.statics = parse_by_layer<LayerStatic>(r.at("static"), parse_static);
  t.entries = parse_entries(r.at("entries"));
  if (t.entries.empty()) r.fail_member("entries", "needs at least one microbatch size");
  return t;
}

Json to_json(const Trace& t) {
  Json j = Json::object();
  j["format"] = kTraceFormat;
  j["model"] = t.model;
  j["device"] = t.device;
  j["dtype"] = models::to_string(t.dtype);
  j["tensor_parallel"] = t.sharding.t;
  j["sequence_parallel"] = t.sharding.sp;
  j["source"] = {{"kind", t.source.kind},
                 {"device_name", t.source.device_name},
                 {"date", t.source.date},
                 {"driver", t.source.driver},
                 {"tool", t.source.tool}};
  j["static"] = by_layer_json(t.statics, static_json);
  Json entries = Json::array();
  for (const auto& e : t.entries)
    entries.push_back(
        {{"microbatch_size", e.microbatch_size}, {"layers", by_layer_json(e.layers, times_json)}});
  j["entries"] = std::move(entries);
  return j;
}

Trace read_trace(const std::string& path) {
  return parse_trace(common::read_json_file(path), path);
}

void write_trace(const std::string& path, const Trace& t) {
  common::write_json_file(path, to_json(t));
}

}  // namespace pw::traces
