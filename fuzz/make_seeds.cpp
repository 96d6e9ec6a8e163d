// The fuzz targets' seed corpus, made from the repository: pw_fuzz_seeds <source dir> <out dir>
// writes <out dir>/<target>/<seed> for every target of fuzz/CMakeLists.txt. Readers of files the
// repository holds (models, HF configs, devices, clusters, plans) start from those files; the rest
// (traces, reports, validations, checkpoints, scenarios) from what pipewright's own writers make
// of the presets, so the seeds follow the formats as they change.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "clusters/cluster.hpp"
#include "exec/checkpoint.hpp"
#include "fuzz/fuzz_util.hpp"
#include "models/model.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "planner/report.hpp"
#include "traces/analytic.hpp"
#include "traces/trace.hpp"

namespace fs = std::filesystem;
using pw::common::Json;

namespace {

fs::path g_out;
int g_count = 0;

void put(const std::string& target, const std::string& name, const std::string& bytes) {
  const fs::path dir = g_out / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
  ++g_count;
}

void put_json(const std::string& target, const std::string& name, const Json& j) {
  put(target, name, j.dump(2) + "\n");
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Copies every *.json of `dir` (sorted) whose name starts with `prefix` into the target's seeds.
void copy_files(const std::string& target, const fs::path& dir, const std::string& prefix = "") {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".json" && e.path().filename().string().rfind(prefix, 0) == 0)
      files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files)
    put(target, f.filename().string(), slurp(f));
}

pw::planner::Plan plan_of(const std::string& schedule, int w, int d, int b, int m, int v = 1,
                          int t = 1) {
  pw::planner::Plan p;
  p.schedule = pw::planner::parse_schedule(schedule);
  p.w = w;
  p.d = d;
  p.b = b;
  p.m = m;
  p.v = v;
  p.t = t;
  return p;
}

struct Scenario {
  std::string name, model, cluster;
  pw::planner::Plan plan;
};

std::vector<Scenario> scenarios() {
  std::vector<Scenario> s = {
      {"gpt-tiny-1f1b", "gpt-tiny", "dgx-a100", plan_of("1f1b", 4, 2, 2, 4)},
      {"gpt2-124m-2bw", "gpt2-124m", "p3.16xlarge", plan_of("2bw", 2, 4, 1, 8)},
      {"gpt3-1.3b-interleaved", "gpt3-1.3b", "dgx-a100:2", plan_of("interleaved", 4, 4, 1, 8, 2)},
      {"bert-large-gpipe", "bert-large", "dgx-a100", plan_of("gpipe", 2, 4, 4, 8)},
      {"llama3-8b-tp", "llama3-8b", "dgx-h100:2", plan_of("1f1b", 2, 4, 1, 8, 1, 2)},
      {"gpt2-355m-dp", "gpt2-355m", "dgx-a100", plan_of("dp", 8, 1, 4, 2)},
  };
  s[1].plan.recompute = {pw::planner::Recompute::none, pw::planner::Recompute::full,
                         pw::planner::Recompute::none, pw::planner::Recompute::selective};
  s[4].plan.sp = true;
  s[4].plan.distributed_optimizer = true;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: pw_fuzz_seeds SOURCE_DIR OUT_DIR\n";
    return 2;
  }
  const fs::path src = argv[1];
  g_out = argv[2];
  try {
    fs::remove_all(g_out);
    // Files of the repository.
    copy_files("model", src / "models/presets");
    copy_files("model", src / "tests/data", "hf-");
    copy_files("hf_config", src / "tests/data", "hf-");
    copy_files("device", src / "clusters/devices");
    copy_files("cluster", src / "clusters/presets");
    copy_files("plan", src / "tests/data", "plan-");
    if (fs::is_directory(src / "traces/data")) copy_files("trace", src / "traces/data");

    // The presets as pipewright writes them back (clusters with the device inline).
    for (const auto& name : pw::clusters::cluster_preset_names())
      put_json("cluster", "written-" + name + ".json",
               pw::clusters::to_json(pw::clusters::load_cluster(name)));

    // Plans, reports, validations, scenarios and traces of a few scenarios.
    for (const auto& sc : scenarios()) {
      const auto model = pw::models::load_model(sc.model);
      const auto cluster = pw::clusters::load_cluster(sc.cluster);
      pw::planner::Plan plan = sc.plan;
      pw::planner::resolve_stages(plan, model.layers);
      put_json("plan", sc.name + ".json", pw::planner::to_json(plan));
      const Json scenario = {{"model", pw::models::to_json(model)},
                             {"cluster", pw::clusters::to_json(cluster)},
                             {"plan", pw::planner::to_json(plan)}};
      put_json("estimate", sc.name + ".json", scenario);
      pw::planner::place(plan, {cluster.nodes, cluster.gpus_per_node});
      put_json("plan", sc.name + "-placed.json", pw::planner::to_json(plan));
      const auto trace = pw::traces::analytic_trace(model, cluster.device, {plan.b, 2 * plan.b},
                                                    {plan.t, plan.sp});
      put_json("trace", sc.name + ".json", pw::traces::to_json(trace));
      const auto est = pw::planner::estimate(model, trace, cluster, plan);
      Json report = pw::planner::to_json(est.report);
      put_json("report", sc.name + ".json", report);
      Json measured = report;
      measured["source"] = "measured";
      measured.erase("estimate");
      measured["step_times_s"] = {1.5 * est.report.iteration_time_s,
                                  1.1 * est.report.iteration_time_s,
                                  1.05 * est.report.iteration_time_s};
      put_json("report", sc.name + "-measured.json", measured);
      put_json("validation", sc.name + ".json", Json::array({report, measured}));
    }
    // A Hugging Face config inside a scenario.
    {
      const fs::path hf = src / "tests/data/hf-llama-config.json";
      if (fs::exists(hf))
        put_json("estimate", "hf-llama.json",
                 {{"model", Json::parse(slurp(hf))},
                  {"cluster", pw::clusters::to_json(pw::clusters::load_cluster("dgx-a100"))},
                  {"plan", pw::planner::to_json(plan_of("1f1b", 2, 4, 1, 8))}});
    }

    // Checkpoints, written by exec/checkpoint.cpp into a scratch directory.
    const std::string dir = pw::fuzz::scratch_dir() + "/seeds";
    for (int step : {pw::fuzz::kManifestStep, pw::fuzz::kManifestStep + 1})
      fs::create_directories(pw::exec::checkpoint_path(dir, step));
    pw::exec::write_manifest(dir, pw::fuzz::kManifestStep, pw::fuzz::kManifestRanks,
                             pw::fuzz::run_identity());
    const std::string ckpt = pw::exec::checkpoint_path(dir, pw::fuzz::kManifestStep);
    put("ckpt_manifest", "manifest.json", slurp(fs::path(ckpt) / "manifest.json"));
    Json other = pw::fuzz::run_identity();
    other["optimizer"]["lr"] = 0.002;
    pw::exec::write_manifest(dir, pw::fuzz::kManifestStep + 1, 4, other);
    put("ckpt_manifest", "manifest-other-run.json",
        slurp(fs::path(pw::exec::checkpoint_path(dir, pw::fuzz::kManifestStep + 1)) /
              "manifest.json"));
    std::vector<std::vector<float>> buffers;
    std::vector<pw::exec::ShardTensor> tensors;
    for (const auto& t : pw::fuzz::shard_layout()) {
      buffers.emplace_back();
      for (std::int64_t i = 0; i < t.floats; ++i)
        buffers.back().push_back(0.25f * float(i + 1) * float(buffers.size()));
    }
    for (std::size_t i = 0; i < buffers.size(); ++i)
      tensors.push_back({pw::fuzz::shard_layout()[i].name, buffers[i].data(),
                         pw::fuzz::shard_layout()[i].floats});
    const std::string shard = pw::exec::shard_path(ckpt, 0);
    pw::exec::write_shard(shard, pw::fuzz::shard_header(), tensors);
    put("ckpt_shard", "rank-00000.bin", slurp(shard));
    tensors.pop_back();
    pw::exec::write_shard(shard, pw::fuzz::shard_header(), tensors);
    put("ckpt_shard", "rank-00000-short.bin", slurp(shard));
  } catch (const std::exception& e) {
    std::cerr << "pw_fuzz_seeds: " << e.what() << "\n";
    return 1;
  }
  std::cout << fmt::format("pw_fuzz_seeds: {} seeds in {}\n", g_count, g_out.string());
  return 0;
}
