// `pipewright profile --backend cpu`: measured per-layer times and memory, in the trace format.
#include <fmt/format.h>

#include "cli/backend.hpp"
#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "exec/profile.hpp"

namespace pw::cli {

void add_profile_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "profile", "measure per-layer forward, backward and recompute times into a trace");
  struct Args {
    std::string model = "gpt-tiny";
    std::string backend = "cpu";
    std::string microbatch = "1,2,4";
    int repeats = 3;
    std::string out;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "model preset or JSON file (fp32 for the CPU backend)")
      ->capture_default_str();
  cmd->add_option("--backend", a->backend, "cpu, or cuda (see --help of the CUDA build)")
      ->capture_default_str();
  cmd->add_option("--microbatch", a->microbatch, "microbatch sizes, comma-separated")
      ->capture_default_str();
  cmd->add_option("--repeats", a->repeats, "timed runs per measurement (the median is kept)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--out,-o", a->out, "output trace (default: standard output)");
  cmd->callback([a] {
    check_backend(a->backend);
    const std::vector<std::int64_t> sizes = parse_int_list(a->microbatch, "--microbatch");
    const traces::Trace t = exec::profile_cpu(models::load_model(a->model), sizes, a->repeats);
    if (a->out.empty()) {
      fmt::print("{}\n", traces::to_json(t).dump(2));
      return;
    }
    traces::write_trace(a->out, t);
    for (const auto& e : t.entries) {
      const auto& bl = e.layers[models::LayerKind::block];
      fmt::print("b={:<3} block forward {} backward {} recompute {}\n", e.microbatch_size,
                 human_seconds(bl.forward_s), human_seconds(bl.backward_s),
                 human_seconds(bl.recompute_s));
    }
    fmt::print("wrote {}\n", a->out);
  });
}

}  // namespace pw::cli
