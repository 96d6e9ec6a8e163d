// `pipewright models [NAME]` and `pipewright clusters [NAME]`: list the presets or show one.
#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "clusters/cluster.hpp"
#include "models/model.hpp"

namespace pw::cli {

namespace {

void print_model(const models::ModelSpec& s) {
  const models::ModelCosts c = models::derive_costs(s);
  fmt::print("{}: {}\n", s.name, s.description);
  fmt::print("  {} x {} blocks, hidden {}, heads {}, ffn {}, seq_len {}, vocab {}, dtype {}\n",
             to_string(s.arch), s.layers, s.hidden, s.heads, s.ffn, s.seq_len, s.vocab,
             to_string(s.dtype));
  fmt::print("  kv_heads {}, attention {}, dropout {}, vocab_multiple {}\n",
             models::key_value_heads(s), models::to_string(s.attention), s.dropout ? "yes" : "no",
             s.vocab_multiple);
  fmt::print("  parameters {} ({:.3f} B); model FLOPs per sample (fwd+bwd) {:.4g}\n",
             c.total_parameters, c.total_parameters / 1e9, c.flops_per_sample);
  fmt::print("  per sample          {:>14} {:>12} {:>12} {:>12} {:>12} {:>12}\n", "parameters",
             "fwd FLOPs", "bwd FLOPs", "stash", "stash(rc)", "output");
  for (models::LayerKind k :
       {models::LayerKind::embedding, models::LayerKind::block, models::LayerKind::head}) {
    const auto& l = c.layer(k);
    fmt::print("  {:<18} {:>14} {:>12.4g} {:>12.4g} {:>12} {:>12} {:>12}\n", to_string(k),
               l.parameters, l.forward_flops, l.backward_flops(), human_bytes(l.activation_bytes),
               human_bytes(l.activation_recompute_bytes), human_bytes(l.output_bytes));
  }
}

common::Json model_json(const models::ModelSpec& s) {
  const models::ModelCosts c = models::derive_costs(s);
  common::Json j = models::to_json(s);
  common::Json layers = common::Json::object();
  for (models::LayerKind k :
       {models::LayerKind::embedding, models::LayerKind::block, models::LayerKind::head}) {
    const auto& l = c.layer(k);
    layers[to_string(k)] = {{"parameters", l.parameters},
                            {"forward_flops", l.forward_flops},
                            {"backward_input_flops", l.backward_input_flops},
                            {"backward_weight_flops", l.backward_weight_flops},
                            {"elementwise_bytes", l.elementwise_bytes},
                            {"activation_bytes", l.activation_bytes},
                            {"activation_recompute_bytes", l.activation_recompute_bytes},
                            {"activation_selective_bytes", l.activation_selective_bytes},
                            {"selective_recompute_flops", l.selective_recompute_flops},
                            {"input_bytes", l.input_bytes},
                            {"output_bytes", l.output_bytes},
                            {"workspace_bytes", l.workspace_bytes}};
  }
  j["derived_per_sample"] = {{"total_parameters", c.total_parameters},
                             {"tied_copy_parameters", c.tied_copy_parameters},
                             {"flops_per_sample", c.flops_per_sample},
                             {"layers", layers}};
  return j;
}

}  // namespace

void add_models_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("models", "list the model presets, or show one with its costs");
  auto name = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  cmd->add_option("name", *name, "preset name or path to a model / Hugging Face config.json");
  cmd->add_flag("--json", *json, "machine-readable output");
  cmd->callback([name, json] {
    if (!name->empty()) {
      models::ModelSpec s = models::load_model(*name);
      if (*json)
        fmt::print("{}\n", model_json(s).dump(2));
      else
        print_model(s);
      return;
    }
    common::Json list = common::Json::array();
    for (const auto& n : models::preset_names()) {
      models::ModelSpec s = models::load_model(n);
      const auto c = models::derive_costs(s);
      if (*json) {
        list.push_back(model_json(s));
      } else {
        const double p = double(c.total_parameters);
        fmt::print("{:<16} {:>9} params  {:>3} x {:<5} T={:<5} {}\n", n,
                   p >= 1e9 ? fmt::format("{:.2f} B", p / 1e9) : fmt::format("{:.1f} M", p / 1e6),
                   s.layers, s.hidden, s.seq_len, s.description);
      }
    }
    if (*json) fmt::print("{}\n", list.dump(2));
  });
}

void add_clusters_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("clusters", "list the cluster presets, or show one");
  auto opts = std::make_shared<ClusterOptions>();
  auto json = std::make_shared<bool>(false);
  cmd->add_option("name", opts->cluster, "preset name, NAME:NODES or a cluster JSON file");
  cmd->add_option("--nodes", opts->nodes, "number of nodes")->check(count_range());
  cmd->add_option("--set", opts->sets, "override a field, e.g. --set network.latency_s=2e-6");
  cmd->add_flag("--json", *json, "machine-readable output");
  cmd->callback([opts, json] {
    if (!opts->cluster.empty()) {
      clusters::Cluster c = opts->load();
      if (*json)
        fmt::print("{}\n", clusters::to_json(c).dump(2));
      else
        fmt::print("{}", clusters::describe(c));
      return;
    }
    common::Json list = common::Json::array();
    for (const auto& n : clusters::cluster_preset_names()) {
      clusters::Cluster c = clusters::load_cluster(n);
      if (*json)
        list.push_back(clusters::to_json(c));
      else
        fmt::print("{:<14} {} x {} x {} ({} per GPU), {}\n", n, c.nodes, c.gpus_per_node,
                   c.device.name, human_bytes(double(c.device.memory_bytes)),
                   clusters::to_string(c.intra_node.kind));
    }
    if (*json) {
      common::Json devices = common::Json::array();
      for (const auto& n : clusters::device_preset_names())
        devices.push_back(clusters::to_json(clusters::load_device(n)));
      fmt::print("{}\n", common::Json{{"clusters", list}, {"devices", devices}}.dump(2));
    } else {
      fmt::print("devices: ");
      for (const auto& n : clusters::device_preset_names())
        fmt::print("{} ", n);
      fmt::print(
          "\n(a preset takes a node count: p3.16xlarge:8; see `pipewright clusters NAME`)\n");
    }
  });
}

}  // namespace pw::cli
