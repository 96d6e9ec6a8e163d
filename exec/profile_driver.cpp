// The profilers' shared parts: statistic, dates, the trace's statics and entries (see
// profile_driver.hpp).
#include "exec/profile_driver.hpp"

#include <algorithm>
#include <ctime>
#include <numeric>

#include "common/error.hpp"
#include "exec/data.hpp"

namespace pw::exec::profiling {

double summarize(std::vector<double> samples, ProfileStatistic statistic) {
  if (samples.empty()) throw Error("profile: no timed runs to summarise");
  if (statistic == ProfileStatistic::mean)
    return std::accumulate(samples.begin(), samples.end(), 0.0) / double(samples.size());
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

const char* statistic_name(ProfileStatistic statistic) {
  return statistic == ProfileStatistic::mean ? "mean" : "median";
}

std::vector<std::int64_t> distinct_sorted(std::vector<std::int64_t> sizes) {
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  return sizes;
}

std::string today_utc() {
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  return date;
}

StageSpec single_block_stage(const models::ModelSpec& model, bool embedding, bool head,
                             const models::Sharding& sharding) {
  StageSpec spec;
  spec.model = model;
  spec.t = sharding.t;
  spec.sp = sharding.sp;
  spec.blocks = 1;
  spec.has_embedding = embedding;
  spec.has_head = head;
  spec.first_block = head ? model.layers - 1 : 0;  // the head's stage ends the model
  return spec;
}

Batch synthetic_batch(const models::ModelSpec& model, int b) {
  const int T = int(model.seq_len);
  Batch batch;
  batch.tokens.resize(std::size_t(b) * T);
  batch.targets.resize(batch.tokens.size());
  const TokenSource data("", model.vocab, 1);
  for (int i = 0; i < b; ++i)
    data.sample(i, T, batch.tokens.data() + std::size_t(i) * T,
                batch.targets.data() + std::size_t(i) * T);
  return batch;
}

traces::Trace measured_trace(const models::ModelSpec& model, const std::string& device,
                             models::DType dtype, const std::string& device_name,
                             const std::string& driver, const std::string& tool,
                             int bytes_per_parameter,
                             const std::function<double(std::int64_t)>& optimizer_step_s,
                             const models::Sharding& sharding) {
  const models::ModelCosts mc = models::derive_costs(model, sharding);
  traces::Trace t;
  t.model = model.name;
  t.sharding = sharding;
  t.device = device;
  t.dtype = dtype;
  t.source.kind = "measured";
  t.source.device_name = device_name;
  t.source.date = today_utc();
  t.source.driver = driver;
  t.source.tool = tool;
  for (models::LayerKind k : traces::kLayerKinds) {
    t.statics[k].parameters = mc.layer(k).parameters;
    t.statics[k].parameter_bytes = bytes_per_parameter * mc.layer(k).parameters;
    t.statics[k].optimizer_step_s = optimizer_step_s(mc.layer(k).parameters);
  }
  return t;
}

namespace {

traces::LayerTimes difference(const StageTimes& with, const StageTimes& block) {
  traces::LayerTimes l;
  l.forward_s = std::max(0.0, with.forward_s - block.forward_s);
  l.backward_s = std::max(0.0, with.backward_s - block.backward_s);
  l.recompute_s = std::max(0.0, with.recompute_s - block.recompute_s);
  return l;
}

}  // namespace

traces::Entry measured_entry(const models::ModelCosts& costs, std::int64_t b,
                             const std::array<StageTimes, 3>& timed, double selective_s) {
  const auto& [block, emb, head] = timed;
  traces::Entry e;
  e.microbatch_size = b;
  auto& bl = e.layers[models::LayerKind::block];
  bl.forward_s = block.forward_s;
  bl.backward_s = block.backward_s;
  bl.recompute_s = block.recompute_s;
  e.layers[models::LayerKind::embedding] = difference(emb, block);
  e.layers[models::LayerKind::head] = difference(head, block);
  for (models::LayerKind k : traces::kLayerKinds) {
    const auto& l = costs.layer(k);
    auto& x = e.layers[k];
    x.activation_bytes = b * l.activation_bytes;
    x.activation_recompute_bytes = b * l.activation_recompute_bytes;
    // Selective recompute timed (the CPU profiler, when asked): the block's stash without the
    // scores and its backward's extra time; else nothing dropped, nothing re-run (as an old trace
    // without these fields reads).
    const bool timed_selective = selective_s >= 0;
    x.activation_selective_bytes =
        timed_selective ? b * l.activation_selective_bytes : x.activation_bytes;
    x.selective_recompute_s = timed_selective && k == models::LayerKind::block ? selective_s : 0.0;
    x.output_bytes = b * l.output_bytes;
    x.workspace_bytes = b * l.workspace_bytes;
  }
  return e;
}

}  // namespace pw::exec::profiling
