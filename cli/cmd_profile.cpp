// `pipewright profile --backend cpu|cuda`: measured per-layer times and memory, in the trace
// format. The CUDA profiler is linked only in builds with CUDA.
#include <fmt/format.h>

#include "cli/backend.hpp"
#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "exec/gpt_layout.hpp"
#include "exec/profile.hpp"

#ifdef PW_HAVE_CUDA
#include "exec/cuda/profile.hpp"
#endif

namespace pw::cli {

namespace {

// After check_backend: "cuda" only reaches here in a build with CUDA and a device.
traces::Trace profile_on([[maybe_unused]] const std::string& backend,
                         const models::ModelSpec& model, const std::vector<std::int64_t>& sizes,
                         int repeats, const models::Sharding& sharding, bool selective) {
#ifdef PW_HAVE_CUDA
  if (backend == "cuda")
    return exec::cuda::profile_cuda(model, sizes, repeats, exec::ProfileStatistic::median, sharding,
                                    selective);
#endif
  return exec::profile_cpu(model, sizes, repeats, exec::ProfileStatistic::median, sharding,
                           selective);
}

}  // namespace

void add_profile_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "profile", "measure per-layer forward, backward and recompute times into a trace");
  struct Args {
    std::string model = "gpt-tiny";
    std::string backend = "cpu";
    std::string microbatch = "1,2,4";
    int repeats = 3;
    int t = 1;
    bool sp = false;
    bool selective = false;
    std::string out;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model,
                  "model preset or JSON file (fp32 for the CPU backend; fp16 or bf16 for cuda, "
                  "which computes in bf16)")
      ->capture_default_str();
  cmd->add_option("--backend", a->backend, "cpu, or cuda (see --help of the CUDA build)")
      ->capture_default_str();
  cmd->add_option("--microbatch", a->microbatch, "microbatch sizes, comma-separated")
      ->capture_default_str();
  cmd->add_option("--repeats", a->repeats, "timed runs per measurement (the median is kept)")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_option("--tp", a->t,
                  "time one GPU of a tensor-parallel group of this size (TP rank 0's shard, its "
                  "collectives left to the simulator; the trace's tensor_parallel)")
      ->capture_default_str()
      ->check(count_range());
  cmd->add_flag("--sp", a->sp, "with --tp: sequence parallelism");
  cmd->add_flag("--selective", a->selective,
                "also time selective recompute: a block that keeps no attention "
                "probabilities, its backward against the plain one's (the trace's "
                "selective_recompute_s and activation_selective_bytes)");
  cmd->add_option("--out,-o", a->out, "output trace (default: standard output)");
  cmd->callback([a] {
    check_backend(a->backend);
    if (a->sp && a->t == 1) throw InputError("--sp: sequence parallelism needs --tp 2 or more");
    const std::vector<std::int64_t> sizes = parse_int_list(a->microbatch, "--microbatch");
    const traces::Trace t =
        profile_on(a->backend, exec::as_executed(models::load_model(a->model)), sizes, a->repeats,
                   models::Sharding{a->t, a->sp}, a->selective);
    if (a->out.empty()) {
      fmt::print("{}\n", traces::to_json(t).dump(2));
      return;
    }
    traces::write_trace(a->out, t);
    for (const auto& e : t.entries) {
      const auto& bl = e.layers[models::LayerKind::block];
      fmt::print(
          "b={:<3} block forward {} backward {} recompute {}{}\n", e.microbatch_size,
          human_seconds(bl.forward_s), human_seconds(bl.backward_s), human_seconds(bl.recompute_s),
          a->selective
              ? fmt::format(" selective recompute {}", human_seconds(bl.selective_recompute_s))
              : "");
    }
    fmt::print("wrote {}\n", a->out);
  });
}

}  // namespace pw::cli
