// A GPU's name to its device preset, its peaks, and the gpu-host cluster (see gpu_host.hpp).
#include "exec/gpu_host.hpp"

#include <algorithm>
#include <cctype>
#include <vector>

#include <fmt/format.h>

#include "common/error.hpp"

namespace pw::exec {

namespace {

// A preset and the words of the GPU names it is: the model word, and the memory word the name must
// have when it has one ("" where the model comes in one size). `example` is what
// cudaGetDeviceProperties says for it, for messages.
struct GpuRule {
  const char* model;
  const char* memory;
  const char* preset;
  const char* example;
};

constexpr GpuRule kRules[] = {
    {"H100", "80GB", "H100-SXM", "NVIDIA H100 80GB HBM3"},
    {"H200", "", "H200", "NVIDIA H200"},
    {"A100", "40GB", "A100-40GB", "NVIDIA A100-SXM4-40GB"},
    {"A100", "80GB", "A100-80GB", "NVIDIA A100-SXM4-80GB"},
    {"V100", "16GB", "V100-16GB", "Tesla V100-SXM2-16GB"},
    {"V100", "32GB", "V100-32GB", "Tesla V100-SXM2-32GB"},
};

// Words of other form factors, whose figures the (SXM) presets do not describe.
constexpr const char* kOtherParts[] = {"PCIE", "NVL"};

std::vector<std::string> upper_words(const std::string& name) {
  std::vector<std::string> words;
  std::string w;
  for (char c : name) {
    if (c == ' ' || c == '-' || c == '\t') {
      if (!w.empty()) words.push_back(w);
      w.clear();
    } else {
      w += char(std::toupper(static_cast<unsigned char>(c)));
    }
  }
  if (!w.empty()) words.push_back(w);
  return words;
}

// "80GB", "141GB": digits then GB.
bool is_memory_word(const std::string& w) {
  return w.size() > 2 && w.compare(w.size() - 2, 2, "GB") == 0 &&
         std::all_of(w.begin(), w.end() - 2, [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

void check_gpu_model(const models::ModelSpec& model) {
  if (models::dtype_bytes(model.dtype) != 2)
    throw InputError(fmt::format(
        "model {}: the CUDA backend runs 2-byte models (bf16; fp16 runs as bf16), the model says "
        "{}: use a model file with \"dtype\": \"bf16\" (or a preset such as gpt2-124m)",
        model.name, models::to_string(model.dtype)));
}

std::string gpu_device_preset(const std::string& gpu_name) {
  const std::vector<std::string> words = upper_words(gpu_name);
  const auto has = [&](const std::string& w) {
    return std::find(words.begin(), words.end(), w) != words.end();
  };
  for (const char* other : kOtherParts)
    if (has(other)) return "";
  const auto memory = std::find_if(words.begin(), words.end(), is_memory_word);
  for (const GpuRule& r : kRules) {
    if (!has(r.model)) continue;
    const std::string want = r.memory;
    if (memory == words.end() ? want.empty() : (want.empty() || *memory == want)) return r.preset;
  }
  return "";
}

clusters::DeviceSpec gpu_device_spec(const std::string& gpu_name) {
  const std::string preset = gpu_device_preset(gpu_name);
  if (preset.empty()) {
    std::string known;
    for (const GpuRule& r : kRules)
      known += fmt::format("{}\"{}\" ({})", known.empty() ? "" : ", ", r.example, r.preset);
    throw InputError(fmt::format(
        "GPU \"{}\" matches no device preset (known: {}; PCIe and NVL parts have lower peaks and "
        "match none)",
        gpu_name, known));
  }
  clusters::DeviceSpec d = clusters::load_device(preset);
  d.notes = fmt::format("{} as device preset {}: {}", gpu_name, preset, d.notes);
  d.name = gpu_name;
  return d;
}

double device_peak_flops(const std::string& gpu_name, models::DType dtype) {
  const clusters::DeviceSpec d = gpu_device_spec(gpu_name);
  return dtype == models::DType::fp32 ? d.peak_fp32_flops_per_s : d.peak_fp16_flops_per_s;
}

clusters::Cluster gpu_host_cluster(const std::string& gpu_name, std::int64_t gpu_memory_bytes,
                                   int ranks, const TransportFit& link,
                                   std::int64_t host_memory_bytes) {
  if (ranks < 1) throw InputError("gpu-host cluster: at least one rank");
  if (link.bandwidth_bytes_per_s <= 0 || gpu_memory_bytes <= 0)
    throw InputError(
        "gpu-host cluster: the transport bandwidth and the GPU's memory must be positive");
  const std::string preset = gpu_device_preset(gpu_name);
  clusters::Cluster c;
  c.name = "gpu-host";
  c.nodes = 1;
  c.gpus_per_node = ranks;
  c.device = gpu_device_spec(gpu_name);
  c.device.memory_bytes = gpu_memory_bytes;
  c.device.notes += fmt::format(
      " Here every one of the {} ranks is this one GPU: memory = the whole GPU's {} bytes per rank "
      "(checked per rank, though the ranks share it), and each rank computes at the full peak "
      "(though ranks computing at once share the GPU).",
      ranks, gpu_memory_bytes);
  c.intra_node.kind = ranks > 1 ? clusters::IntraKind::pcie : clusters::IntraKind::none;
  c.intra_node.bandwidth_bytes_per_s = link.bandwidth_bytes_per_s;
  c.intra_node.latency_s = link.latency_s;
  c.intra_node.efficiency = 1;
  c.host.memory_bytes = std::max<std::int64_t>(host_memory_bytes, 1);
  // The host's PCIe link, where a single-GPU preset of this device says it (offload plans use it).
  for (const std::string& name : clusters::cluster_preset_names()) {
    const clusters::Cluster p = clusters::load_cluster(name);
    if (p.nodes == 1 && p.gpus_per_node == 1 && p.device.name == preset) {
      c.host.pcie_bandwidth_bytes_per_s = p.host.pcie_bandwidth_bytes_per_s;
      c.host.pcie_latency_s = p.host.pcie_latency_s;
      break;
    }
  }
  c.notes = fmt::format(
      "this machine as measured by pipewright validate --backend cuda: {} ranks as threads on one "
      "{} (device preset {}); the intra-node link is the LocalTransport (device copies between "
      "the ranks' streams, ping-pong fit: {:.3g} us + bytes / {:.3g} GB/s), kind pcie for a port "
      "per device with no per-pair division",
      ranks, gpu_name, preset, link.latency_s * 1e6, link.bandwidth_bytes_per_s / 1e9);
  return c;
}

}  // namespace pw::exec
