// A trace: how long each layer kind (embedding, block, head) of one model takes on one device in
// one dtype, and how much memory it needs, per microbatch size. Format "pipewright.trace/1",
// measured (profiled) or analytic (roofline, traces/analytic.hpp); see docs/formats.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/json_reader.hpp"
#include "models/model.hpp"

namespace pw::traces {

// One value per layer kind.
template <class T>
struct ByLayer {
  T embedding{}, block{}, head{};
  const T& operator[](models::LayerKind k) const {
    return k == models::LayerKind::embedding ? embedding
                                             : (k == models::LayerKind::block ? block : head);
  }
  T& operator[](models::LayerKind k) {
    return const_cast<T&>(static_cast<const ByLayer&>(*this)[k]);
  }
  bool operator==(const ByLayer&) const = default;
};

inline constexpr models::LayerKind kLayerKinds[] = {
    models::LayerKind::embedding, models::LayerKind::block, models::LayerKind::head};

struct TraceSource {
  std::string kind;         // "analytic" or "measured"
  std::string device_name;  // what the device called itself (nvidia-smi / cudaGetDeviceProperties)
  std::string date;         // ISO 8601 date of the measurement ("" for analytic)
  std::string driver;       // driver / CUDA version ("" for analytic)
  std::string tool;         // what produced it ("pipewright 0.1.0 analytic roofline", a profiler)
  bool operator==(const TraceSource&) const = default;
};

// What does not depend on the microbatch size.
struct LayerStatic {
  std::int64_t parameters = 0;
  std::int64_t parameter_bytes = 0;  // weights in the compute dtype
  double optimizer_step_s = 0;       // AdamW over this layer's parameters
  bool operator==(const LayerStatic&) const = default;
};

// One layer for one microbatch of size b.
struct LayerTimes {
  double forward_s = 0;
  double backward_s = 0;              // backward_input_s + backward_weight_s (+ what neither holds)
  double backward_input_s = 0;        // dL/dx only
  double backward_weight_s = 0;       // dL/dW only
  double recompute_s = 0;             // re-running the forward before the backward
  double selective_recompute_s = 0;   // re-running the attention core before the backward
  std::int64_t activation_bytes = 0;  // stashed for backward without recompute
  std::int64_t activation_recompute_bytes = 0;  // stashed with recompute
  std::int64_t activation_selective_bytes = 0;  // stashed with selective recompute
  std::int64_t output_bytes = 0;                // handed to the next layer / stage
  std::int64_t workspace_bytes = 0;             // transient scratch
  bool operator==(const LayerTimes&) const = default;
};

struct Entry {
  std::int64_t microbatch_size = 0;
  ByLayer<LayerTimes> layers;
  bool operator==(const Entry&) const = default;
};

struct Trace {
  std::string model;   // model name
  std::string device;  // device spec name ("H100-SXM")
  models::DType dtype = models::DType::fp16;
  models::Sharding sharding;  // times and bytes are of one rank of a TP group of this shape
  TraceSource source;
  ByLayer<LayerStatic> statics;
  std::vector<Entry> entries;  // sorted by microbatch size, no duplicates
  std::string origin;          // the file it was read from, or a description; for errors only

  // The entry for microbatch size b; throws InputError
  // "trace <origin>: no entry for microbatch size 8 (has 1, 2, 4)".
  const Entry& at(std::int64_t b) const;
  std::vector<std::int64_t> microbatch_sizes() const;
  bool operator==(const Trace& o) const {  // ignores origin
    return model == o.model && device == o.device && dtype == o.dtype && sharding == o.sharding &&
           source == o.source && statics == o.statics && entries == o.entries;
  }
};

// Throws InputError "<origin>: /tensor_parallel: trace is for t = 4 with SP, but the plan has
// t = 2" unless the trace's times are those of a TP group of `sharding`'s shape.
void check_sharding(const Trace& t, const models::Sharding& sharding);

// The mean of traces of one model measured alike (validate's blocks: the same profile taken
// several times, between training runs): every time (the layers' forward, backward, recompute
// times and the statics' optimizer step) is the mean of the traces' times, the rest is the first
// trace's. Throws InputError unless the traces (at least one) have the same model, device, dtype,
// sharding, microbatch sizes, parameters and memory sizes.
Trace mean_of(const std::vector<Trace>& traces);

Trace parse_trace(const common::Json& json, const std::string& source);
common::Json to_json(const Trace& t);
Trace read_trace(const std::string& path);
void write_trace(const std::string& path, const Trace& t);  // atomic

}  // namespace pw::traces
