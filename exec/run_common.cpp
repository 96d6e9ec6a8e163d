// What every backend's workers share (see run_common.hpp).
#include "exec/run_common.hpp"

#include <malloc.h>

#include <algorithm>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "exec/checkpoint.hpp"
#include "exec/gpt_layout.hpp"
#include "exec/gpu_host.hpp"
#include "planner/chunks.hpp"
#include "traces/analytic.hpp"

namespace pw::exec {

common::Json run_identity(const models::ModelSpec& model, const planner::Plan& plan,
                          const TrainOptions& o, const std::string& backend) {
  // Floats as their shortest decimal (0.001, not 0.0010000000474974513).
  const auto num = [](float x) { return std::stod(fmt::format("{}", x)); };
  common::Json optimizer = {{"name", o.optimizer}, {"lr", num(o.lr)}};
  if (o.optimizer == "adamw") {
    optimizer["beta1"] = num(o.beta1);
    optimizer["beta2"] = num(o.beta2);
    optimizer["eps"] = num(o.eps);
    optimizer["weight_decay"] = num(o.weight_decay);
  } else {
    optimizer["momentum"] = num(o.momentum);
  }
  return {{"backend", backend},
          {"model", models::to_json(model)},
          {"plan", planner::to_json(plan)},
          {"optimizer", optimizer},
          {"seed", o.seed},
          {"data", o.data}};
}

clusters::Cluster chunk_cluster(std::int64_t device_memory, const planner::Plan& plan) {
  clusters::Cluster node = clusters::load_cluster("v100-32gb-ws");
  node.device.memory_bytes = device_memory;
  if (plan.t > 1) {
    // Every device its own GPU of the node, on PCIe (the times only; the moves do not use them).
    node.gpus_per_node = plan.gpus();
    node.intra_node = {clusters::IntraKind::pcie, node.host.pcie_bandwidth_bytes_per_s,
                       node.host.pcie_latency_s, 1};
  }
  return node;
}

planner::Plan chunk_placement(const planner::Plan& plan) {
  planner::Plan placed = plan;
  placed.placement.clear();
  // t = 1: every rank on the node's one GPU; t > 1: each device its own GPU (chunk_cluster's
  // node of t w d GPUs).
  if (plan.t > 1)
    planner::place(placed, {1, plan.gpus()});
  else
    planner::place(placed, {1, 1}, plan.ranks());
  return placed;
}

std::vector<planner::ChunkSchedule> executor_chunk_schedules(const models::ModelSpec& model,
                                                             const planner::Plan& plan,
                                                             std::int64_t device_memory) {
  const clusters::Cluster node = chunk_cluster(device_memory, plan);
  const traces::Trace trace =
      traces::analytic_trace(model, node.device, {plan.b}, models::Sharding{plan.t, plan.sp});
  return planner::chunk_schedules(model, trace, node, chunk_placement(plan));
}

std::int64_t chunk_budget(const std::string& backend, const planner::Plan& plan,
                          std::int64_t device_memory) {
  if (backend != "cuda" || device_memory <= 0) return device_memory;
  const std::int64_t kept =
      plan.v * (kCudaGemmWorkspaceBytes + kCudaStatusBytes) + 8 * std::int64_t(plan.m);
  if (device_memory <= kept)
    throw InputError(fmt::format(
        "--device-memory: {} B leaves nothing for offload chunks on the cuda backend, whose "
        "stages keep {} B (cuBLASLt workspace, status words, losses)",
        device_memory, kept));
  return device_memory - kept;
}

planner::Plan with_chunk_size(const models::ModelSpec& model, planner::Plan plan,
                              std::int64_t device_memory) {
  if (plan.offload != planner::Offload::chunks || plan.chunk_bytes > 0 || device_memory <= 0)
    return plan;  // prepare_run refuses a chunks plan without a device size
  const std::int64_t used =
      executor_chunk_schedules(model, plan, device_memory).front().layout.chunk_bytes;
  if (used != planner::default_chunk_bytes(model)) plan.chunk_bytes = used;
  return plan;
}

namespace detail {

void keep_freed_memory() {
  static std::once_flag once;
  std::call_once(once, [] {
    (void)mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
    (void)mallopt(M_TRIM_THRESHOLD, 1 << 30);
  });
}

PreparedRun prepare_run(const models::ModelSpec& model, const planner::Plan& plan,
                        const TrainOptions& options, const std::string& backend, bool tidy) {
  keep_freed_memory();
  if (options.optimizer != "adamw" && options.optimizer != "sgd")
    throw InputError(fmt::format("--optimizer: unknown \"{}\" (adamw or sgd)", options.optimizer));
  if (options.steps < 1) throw InputError("--steps must be at least 1");
  if (options.checkpoint_every < 1) throw InputError("--checkpoint-every must be at least 1");
  if (options.resume && options.checkpoint_dir.empty())
    throw InputError("--resume needs --checkpoint-dir");
  // What the executor does not run yet (issue 14): say so instead of running something else.
  if (plan.t > 1 && backend != "cpu" && backend != "cuda")
    throw InputError(
        fmt::format("plan: t: the {} executor does not run tensor parallelism yet "
                    "(t = {}; the cpu backend does); simulate or estimate it instead",
                    backend, plan.t));
  if (plan.overlap_param_gather)
    throw InputError(
        fmt::format("plan: overlap_param_gather: the {} executor all-gathers the parameters "
                    "before the next step (no overlap yet); simulate or estimate it instead",
                    backend));
  if (plan.sp && plan.t > 1 && backend != "cpu" && backend != "cuda")
    throw InputError(
        fmt::format("plan: sp: the {} executor does not run sequence parallelism yet; "
                    "simulate or estimate it instead",
                    backend));
  if (plan.offload_sharded() && backend != "cpu" && backend != "cuda")
    throw InputError(
        fmt::format("plan: offload: the {} executor does not shard optimizer offload over "
                    "replicas yet (w = {}; the cpu and cuda backends do); simulate or estimate it "
                    "instead",
                    backend, plan.w));
  if (plan.offload == planner::Offload::chunks && backend != "cpu" && backend != "cuda")
    throw InputError(
        fmt::format("plan: offload: the {} executor does not run offload chunks (PatrickStar) "
                    "yet (the cpu and cuda backends do); estimate or simulate it instead",
                    backend));
  // The CUDA worker's chunks (exec/cuda/worker_chunks.cpp) run a part of what the CPU's do.
  if (plan.offload == planner::Offload::chunks && backend == "cuda") {
    const auto refuse = [](const std::string& what) {
      throw InputError(fmt::format(
          "plan: offload: the cuda executor's offload chunks {} (the cpu backend runs it); "
          "estimate or simulate it instead",
          what));
    };
    if (plan.w > 1)
      refuse(fmt::format("run one replica per stage (w = {}: no chunk collectives yet)", plan.w));
    if (plan.m == 1)
      refuse(
          "need m > 1 (with m = 1 a bf16 gradient reuses its parameter's slot, which the cuda "
          "backward does not do)");
  }
  if (plan.offload == planner::Offload::chunks && options.device_memory <= 0)
    throw InputError(
        "--offload chunks needs --device-memory BYTES: the emulated device whose memory the "
        "chunks' eviction plan fills");
  if (plan.offload == planner::Offload::chunks && options.optimizer != "adamw")
    throw InputError(fmt::format(
        "--offload chunks runs AdamW (each chunk carries Adam's m and v); --optimizer {} with "
        "chunks is not supported",
        options.optimizer));
  // Offload runs on the CPU backend's emulated device and on the CUDA backend (pinned host
  // memory, copy streams; docs/formats.md, train); other backends are refused.
  if (plan.any_offload() && backend != "cpu" && backend != "cuda")
    throw InputError(
        fmt::format("plan: offload: the {} executor does not run --offload yet (the cpu and cuda "
                    "backends do); estimate or simulate it instead",
                    backend));
  if (plan.offload != planner::Offload::none && plan.offload != planner::Offload::optimizer &&
      plan.offload != planner::Offload::chunks)
    throw InputError(fmt::format(
        "plan: offload: the executor does not run --offload {} yet (optimizer and activations it "
        "does); estimate or simulate it instead",
        planner::offload_name(plan)));
  // The per-layer choices against the stages' blocks (a plan made in code has not been read
  // through from_json): the planner's one line naming the field, not a read past a list.
  if (plan.offload_activations && !plan.activation_layers.empty()) {
    planner::Plan resolved = plan;
    try {
      planner::resolve_stages(resolved, model.layers);
    } catch (const PlanError& e) {
      throw InputError(e.what());
    }
  }
  for (int s = 0; s < plan.d; ++s)
    if (plan.recompute_of(s) == planner::Recompute::block && backend != "cpu")
      throw InputError(fmt::format(
          "plan: recompute: block recompute (stage {}) runs on the cpu backend only (this is {}); "
          "use recompute full, or estimate or simulate it",
          s, backend));
  for (int s = 0; s < plan.d && backend != "cpu"; ++s)
    if (plan.mixed_activations(s))
      throw InputError(fmt::format(
          "plan: activation_layers[{}]: the {} executor swaps or recomputes whole stages, not a "
          "stage mixing both ({} blocks swap, {} recompute; the cpu backend runs it); estimate or "
          "simulate it instead",
          s, backend, plan.swapped_layers(s), plan.recomputed_layers(s)));
  // Unsharded, the gradients stream out layer by layer: one stage holding both tied ends would
  // add both ends' gradients into one layer's. Sharded (w > 1) they stay on the device, as
  // without offload, so d = 1 runs, but not both ends in two chunks of one device (interleaved,
  // d = 1: the head's copy is in no CPU Adam tile).
  if (plan.offload == planner::Offload::optimizer && model.tied_embeddings && plan.d == 1 &&
      !plan.offload_sharded())
    throw InputError(
        "plan: offload: the executor's optimizer offload needs the tied embedding and LM head on "
        "different stages (d > 1; here d = 1): one stage would add both ends' gradients into one "
        "layer's; use an untied model or d > 1");
  if (plan.offload_sharded() && model.tied_embeddings && plan.d == 1 && plan.v > 1)
    throw InputError(fmt::format(
        "plan: offload: the executor's sharded optimizer offload (w = {}) needs the tied embedding "
        "and LM head on one chunk or on different stages (here d = 1, v = {}); use v = 1, d > 1 "
        "or an untied model",
        plan.w, plan.v));
  if (options.device_memory < 0)
    throw InputError(fmt::format("--device-memory: {} is negative (bytes; 0: unlimited)",
                                 options.device_memory));
  // Selective recompute: both executors (the CUDA one compile-checked only), without activation
  // offload (whose choices are whole stashes swapped or recomputed: planner::check refuses it
  // with a recompute list).
  if (std::any_of(plan.recompute.begin(), plan.recompute.end(),
                  [](planner::Recompute r) { return r == planner::Recompute::selective; })) {
    if (backend != "cpu" && backend != "cuda")
      throw InputError(fmt::format(
          "plan: recompute: the {} executor recomputes whole stages (full), block by block "
          "(block) or nothing, not selective (the cpu and cuda executors run it)",
          backend));
    if (plan.offload_activations)
      throw InputError(fmt::format(
          "plan: recompute: the {} executor runs selective recompute without activation "
          "offload only; use full or block recompute with it",
          backend));
  }
  // Offload chunks: the eviction plan the programs carry, made before anything is written (a chunk
  // smaller than a tensor, a device smaller than a layer's working set: the planner's one line).
  std::shared_ptr<const std::vector<planner::ChunkSchedule>> chunks;
  if (plan.offload == planner::Offload::chunks)
    chunks = std::make_shared<const std::vector<planner::ChunkSchedule>>(
        executor_chunk_schedules(model, plan, chunk_budget(backend, plan, options.device_memory)));
  PreparedRun run;
  run.identity = run_identity(model, plan, options, backend);
  if (!options.checkpoint_dir.empty()) remove_incomplete_checkpoints(options.checkpoint_dir);
  if (!options.resume && !options.checkpoint_dir.empty()) {
    if (const auto step = latest_checkpoint(options.checkpoint_dir))
      throw InputError(fmt::format(
          "--checkpoint-dir {}: holds a checkpoint of step {}; pass --resume to continue from it "
          "or use an empty directory",
          options.checkpoint_dir, *step));
  }
  if (options.resume) {
    ResumeInfo info;
    const ResumePoint found = find_resume_point(options.checkpoint_dir, tidy);
    info.warnings = found.warnings;
    if (found.step) {
      const int step = *found.step;
      const Manifest m = read_manifest(options.checkpoint_dir, step);
      // One shard per device (t per pipeline rank): another t cannot read them.
      const common::Json* written =
          m.run.is_object() && m.run.contains("plan") ? &m.run["plan"] : nullptr;
      const int written_t =
          written && written->is_object() && written->contains("t") && (*written)["t"].is_number()
              ? int((*written)["t"].get<std::int64_t>())
              : 1;
      if (written_t != plan.t)
        throw InputError(fmt::format(
            "--resume: {} holds one shard per tensor-parallel rank of t = {}; this plan has t = {} "
            "(resume with the same --tp)",
            m.path, written_t, plan.t));
      check_manifest(m, plan.ranks() * plan.t, run.identity);
      info.step = step;
      info.checkpoint = checkpoint_path(options.checkpoint_dir, step);
      if (step == options.steps && !m.result.is_null()) {
        run.finished = result_from_record(m.result, m.path);
        if (int(run.finished->ranks.size()) != plan.ranks() * plan.t)
          throw InputError(fmt::format("{}: /result/ranks: {} ranks, the checkpoint has {}", m.path,
                                       run.finished->ranks.size(), plan.ranks() * plan.t));
        info.finished = true;
      } else if (step >= options.steps) {
        throw InputError(fmt::format(
            "--resume: {} is at step {}{}; --steps {} leaves nothing to run", info.checkpoint, step,
            m.result.is_null() ? " (written in the middle of a longer run)" : "", options.steps));
      }
      run.first_step = step;
    }
    if (options.on_resume) options.on_resume(info);
    if (run.finished) return run;
  }
  planner::ProgramOptions po;
  po.steps = options.steps - run.first_step;
  po.gradient_buckets = options.gradient_buckets;
  po.first_step = run.first_step;
  po.tied_embeddings = model.tied_embeddings;
  po.chunks = chunks;
  run.programs = planner::generate_programs(plan, po);
  return run;
}

void StepBook::init(const models::ModelSpec& m, const PreparedRun& run, const TrainOptions& o,
                    const TokenSource& tokens, int ranks) {
  model = &m;
  programs = &run.programs;
  options = &o;
  data = &tokens;
  first_step = run.first_step;
  identity = run.identity;
  ranks_here = ranks;
  finished.assign(std::size_t(run.programs.steps), 0);
  loss_sum.assign(std::size_t(run.programs.steps), 0.0);
}

void StepBook::add_loss(int step, double loss) {
  std::lock_guard<std::mutex> lock(mutex);
  loss_sum[std::size_t(step - first_step)] += loss;
}

bool StepBook::checkpoint_after(int step) const {
  return !options->checkpoint_dir.empty() &&
         ((step + 1) % options->checkpoint_every == 0 || step + 1 == options->steps);
}

StepLog StepBook::make_log(int step, double loss_sum_of_step, double now_s) {
  const planner::Plan& p = plan();
  StepLog log;
  log.step = step;
  log.loss = loss_sum_of_step / (double(p.m) * p.w);
  log.seconds = now_s - last_end_s;
  log.tokens_per_s = double(p.global_batch()) * double(model->seq_len) / log.seconds;
  if (checkpoint_after(step)) log.checkpoint = checkpoint_path(options->checkpoint_dir, step + 1);
  last_end_s = now_s;
  return log;
}

void StepBook::finish_step(int step) {
  std::lock_guard<std::mutex> lock(mutex);
  if (++finished[std::size_t(step - first_step)] < ranks_here) return;
  // Every rank has written its shard of this step: the manifest makes the checkpoint complete.
  if (checkpoint_after(step) && step + 1 < options->steps) {
    if (before_manifest) before_manifest();
    if (write_manifests) write_manifest(options->checkpoint_dir, step + 1, devices(), identity);
  }
  const double now = std::chrono::duration<double>(Clock::now() - start).count();
  logs.push_back(make_log(step, loss_sum[std::size_t(step - first_step)], now));
  if (on_step) on_step(logs.back());
}

void StepBook::write_final_manifest(const TrainResult& result) const {
  if (options->checkpoint_dir.empty() || !write_manifests) return;
  write_manifest(options->checkpoint_dir, options->steps, devices(), identity, 2,
                 result_record(result));
}

common::Json result_record(const TrainResult& r) {
  common::Json steps = common::Json::array(), ranks = common::Json::array();
  for (const StepLog& s : r.steps)
    steps.push_back({{"step", s.step},
                     {"loss", s.loss},
                     {"seconds", s.seconds},
                     {"tokens_per_s", s.tokens_per_s}});
  for (const RankResult& k : r.ranks) {
    const planner::MemoryBreakdown& m = k.memory;
    ranks.push_back({{"rank", k.rank},
                     {"peak_memory_bytes", k.peak_memory_bytes},
                     {"busy_s", k.busy_s},
                     {"memory_bytes",
                      {{"weights", m.weights},
                       {"weight_versions", m.weight_versions},
                       {"gradients", m.gradients},
                       {"optimizer", m.optimizer},
                       {"activations", m.activations},
                       {"workspace", m.workspace}}}});
  }
  return {{"first_step", r.first_step}, {"wall_s", r.wall_s}, {"steps", steps}, {"ranks", ranks}};
}

TrainResult result_from_record(const common::Json& record, const std::string& source) {
  const common::JsonReader r(record, source, "/result");
  TrainResult out;
  out.from_checkpoint = true;
  const auto small_int = [](const common::JsonReader& at, const std::string& key) {
    const std::int64_t v = at.get_nonnegative_int(key);
    if (v > std::numeric_limits<int>::max()) at.fail_member(key, fmt::format("{} is too large", v));
    return int(v);
  };
  out.first_step = small_int(r, "first_step");
  out.wall_s = r.get_nonnegative("wall_s");
  const common::JsonReader steps = r.at("steps");
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const common::JsonReader s = steps.at(i);
    StepLog log;
    log.step = small_int(s, "step");
    log.loss = s.get_number("loss");
    log.seconds = s.get_nonnegative("seconds");
    log.tokens_per_s = s.get_nonnegative("tokens_per_s");
    out.steps.push_back(log);
  }
  if (out.steps.empty()) steps.fail("expected at least one step");
  const common::JsonReader ranks = r.at("ranks");
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const common::JsonReader k = ranks.at(i);
    RankResult rank;
    rank.rank = small_int(k, "rank");
    if (rank.rank != int(i)) k.fail_member("rank", fmt::format("{}, expected {}", rank.rank, i));
    rank.peak_memory_bytes = k.get_nonnegative_int("peak_memory_bytes");
    rank.busy_s = k.get_nonnegative("busy_s");
    const common::JsonReader m = k.at("memory_bytes");
    rank.memory.weights = m.get_nonnegative_int("weights");
    rank.memory.weight_versions = m.get_nonnegative_int("weight_versions");
    rank.memory.gradients = m.get_nonnegative_int("gradients");
    rank.memory.optimizer = m.get_nonnegative_int("optimizer");
    rank.memory.activations = m.get_nonnegative_int("activations");
    rank.memory.workspace = m.get_nonnegative_int("workspace");
    out.ranks.push_back(rank);
  }
  return out;
}

std::vector<int> tp_group(int rank, int t) {
  std::vector<int> group;
  for (int k = 0; k < t; ++k)
    group.push_back(rank * t + k);
  return group;
}

std::vector<int> replica_devices(const planner::Plan& plan, int stage, int tp) {
  std::vector<int> group;
  for (int r = 0; r < plan.w; ++r)
    group.push_back(plan.rank_of(stage, r) * plan.t + tp);
  return group;
}

std::vector<std::int64_t> equal_parts(std::int64_t n, int parts) {
  std::vector<std::int64_t> bounds;
  for (int k = 0; k <= parts; ++k)
    bounds.push_back(n / parts * k);
  return bounds;
}

StageSpec chunk_spec(const models::ModelSpec& model, const planner::Plan& p, int stage, int chunk) {
  const int vs = chunk * p.d + stage;
  StageSpec spec;
  spec.model = model;
  for (int i = 0; i < vs; ++i)
    spec.first_block += p.stage_blocks[std::size_t(i)];
  spec.blocks = p.stage_blocks[std::size_t(vs)];
  spec.has_embedding = vs == 0;
  spec.has_head = vs == p.virtual_stages() - 1;
  spec.selective = p.recompute_of(stage) == planner::Recompute::selective;
  return spec;
}

StageSpec shard_spec(const models::ModelSpec& model, const planner::Plan& p, int stage, int chunk,
                     int tp_rank) {
  StageSpec spec = chunk_spec(model, p, stage, chunk);
  spec.t = p.t;
  spec.tp_rank = tp_rank;
  spec.sp = p.sp;
  return spec;
}

bool zeroed_tied_copy(const planner::Plan& plan, bool last, std::int64_t tied_offset) {
  return plan.d > 1 && last && tied_offset >= 0;
}

TiedCopySource tied_copy_source(const models::ModelSpec& model, const planner::Plan& plan,
                                int replica, int tp, const std::string& checkpoint) {
  // Slot offsets are in elements, the same for every dtype: the CPU's fp32 layout of the shard.
  const GptLayout first(shard_spec(model, plan, 0, 0, tp), models::DType::fp32, "cpu");
  return {shard_path(checkpoint, plan.rank_of(0, replica) * plan.t + tp), first.wte};
}

std::vector<std::pair<std::int64_t, std::int64_t>> updated_ranges(bool first, bool last,
                                                                  std::int64_t tied_offset,
                                                                  std::int64_t tied_size, int d,
                                                                  std::int64_t n) {
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  if (last && !first && tied_offset >= 0 && d > 1) {
    ranges = {{0, tied_offset}, {tied_offset + tied_size, n}};
  } else {
    ranges = {{0, n}};
  }
  std::erase_if(ranges, [](const auto& r) { return r.second <= r.first; });
  return ranges;
}

std::vector<std::int64_t> shard_starts(std::int64_t flat, std::int64_t base, int w) {
  std::vector<std::int64_t> starts;
  for (int r = 0; r < w; ++r)
    starts.push_back(planner::tied_shard(flat, w, r).begin - base);
  starts.push_back(flat - base);
  return starts;
}

std::vector<std::int64_t> clip_bounds(const std::vector<std::int64_t>& starts, std::int64_t a,
                                      std::int64_t b) {
  std::vector<std::int64_t> bounds;
  for (std::int64_t x : starts)
    bounds.push_back(std::clamp(x, a, b) - a);
  bounds.front() = 0;
  bounds.back() = b - a;
  return bounds;
}

std::vector<BucketPiece> bucket_pieces(bool first, std::int64_t tied_offset, std::int64_t tied_size,
                                       int d, int w, std::int64_t begin, std::int64_t end) {
  const bool apart = tied_offset >= 0 && (d == 1 || !first);
  const std::int64_t to = apart ? tied_offset : end, te = apart ? to + tied_size : end;
  const std::vector<std::int64_t> tied_starts = shard_starts(te - to, -to, w);  // [to, te) split
  const std::int64_t cuts[4] = {begin, std::clamp(to, begin, end), std::clamp(te, begin, end), end};
  std::vector<BucketPiece> pieces;
  for (int i = 0; i < 3; ++i) {
    BucketPiece piece;
    piece.index = i;
    piece.begin = cuts[i];
    piece.end = cuts[i + 1];
    if (piece.begin >= piece.end) continue;
    if (i == 1) {
      piece.kind = d == 1 ? BucketPiece::tied_whole : BucketPiece::tied_shards;
      if (d > 1) piece.bounds = clip_bounds(tied_starts, piece.begin, piece.end);
    }
    pieces.push_back(std::move(piece));
  }
  return pieces;
}

void microbatch_samples(const StepBook& book, int replica, int step, int microbatch,
                        std::vector<std::int32_t>& tokens, std::vector<std::int32_t>& targets) {
  const planner::Plan& p = book.plan();
  const int T = int(book.model->seq_len);
  tokens.resize(std::size_t(p.b) * T);
  targets.resize(std::size_t(p.b) * T);
  const std::int64_t first =
      (std::int64_t(step) * p.w + replica) * p.m * p.b + std::int64_t(microbatch) * p.b;
  for (int i = 0; i < p.b; ++i)
    book.data->sample(first + i, T, tokens.data() + std::size_t(i) * T,
                      targets.data() + std::size_t(i) * T);
}

int VersionSlots::slot_of(int version) const {
  const auto it = slot_of_.find(version);
  if (it == slot_of_.end())
    throw Error(fmt::format("rank {}: weight version {} is not held", rank_, version));
  return it->second;
}

void VersionSlots::free_version(int version) {
  free_[slot_of(version)] = true;
  slot_of_.erase(version);
}

int VersionSlots::target_for(int version, bool& allocate) const {
  // The new version goes into a freed slot (in place for flush schedules, where the version just
  // freed is the newest), or into the second slot the first time 2BW needs two.
  const int target = free_[0] ? 0 : (free_[1] ? 1 : -1);
  if (target < 0)
    throw Error(fmt::format("rank {}: no free weight slot for version {}", rank_, version));
  allocate = !allocated_[target];
  return target;
}

void VersionSlots::place(int version, int slot) {
  slot_of_[version] = slot;
  free_[slot] = false;
  allocated_[slot] = true;
  newest_ = slot;
}

void VersionSlots::resume(const std::vector<int>& versions) {
  // The newest version in slot 0, the 2BW shadow (if any) in slot 1: as in an unbroken run, the
  // next update writes into the shadow's slot once its step frees it.
  slot_of_.clear();
  slot_of_[versions.back()] = 0;
  free_[0] = false;
  if (versions.size() == 2) {
    slot_of_[versions.front()] = 1;
    allocated_[1] = true;
    free_[1] = false;
  }
  newest_ = 0;
}

void run_threads(int n, const std::function<void(int)>& body, const std::function<void()>& abort) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[std::size_t(r)] = std::current_exception();
        abort();
      }
    });
  for (auto& t : threads)
    t.join();
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      if (std::string(err.what()).rfind("transport aborted", 0) == 0) continue;
      throw;
    }
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace detail
}  // namespace pw::exec

namespace pw::exec {

void StageCompute::backward(const float*, const float*, const float*, int, float, GradientSink&,
                            float*, float*) {
  throw Error(
      "this backend's stage does not stream its gradients layer by layer (optimizer "
      "offload)");
}

float StageCompute::forward(LayerMemory&, const std::int32_t*, const float*, const std::int32_t*,
                            int, bool, float*, float*, float*) {
  throw Error("this backend's stage does not run layer by layer (offload chunks)");
}

void StageCompute::recompute(LayerMemory&, const std::int32_t*, int, const float*, float*) {
  throw Error("this backend's stage does not run layer by layer (offload chunks)");
}

void StageCompute::backward(LayerMemory&, const float*, const float*, int, float, float*, float*) {
  throw Error("this backend's stage does not run layer by layer (offload chunks)");
}

namespace {
[[noreturn]] void refuse_mixed() {
  throw Error(
      "this backend's stage does not run a stage mixing swapped and recomputed blocks "
      "(activation_layers)");
}
}  // namespace

MixedSizes StageCompute::mixed_sizes(int, const std::vector<bool>&) const {
  refuse_mixed();
}

float StageCompute::forward_mixed(const float*, const std::int32_t*, const float*,
                                  const std::int32_t*, int, const std::vector<bool>&, float*,
                                  float*, float*, float*) {
  refuse_mixed();
}

void StageCompute::recompute_mixed(const float*, const std::int32_t*, int, const std::vector<bool>&,
                                   const float*, float*) {
  refuse_mixed();
}

void StageCompute::backward_mixed(const float*, const std::vector<bool>&, const float*,
                                  const float*, const float*, int, float, float*, GradientSink*,
                                  float*, float*) {
  refuse_mixed();
}

namespace {
[[noreturn]] void refuse_blocks() {
  throw Error("this backend's stage does not run block recompute");
}
}  // namespace

std::int64_t StageCompute::layer_inputs(int) const {
  refuse_blocks();
}

std::int64_t StageCompute::blocks_scratch(int) const {
  refuse_blocks();
}

float StageCompute::forward_blocks(const float*, const std::int32_t*, const float*,
                                   const std::int32_t*, int, float*, float*, float*) {
  refuse_blocks();
}

void StageCompute::backward_blocks(const float*, const float*, const std::int32_t*, const float*,
                                   int, float, float*, GradientSink*, float*, float*, float*) {
  refuse_blocks();
}

float StageCompute::forward_blocks(LayerMemory&, const std::int32_t*, const float*,
                                   const std::int32_t*, int, float*, float*, float*) {
  refuse_blocks();
}

void StageCompute::backward_blocks(LayerMemory&, const float*, const std::int32_t*, const float*,
                                   int, float, float*, float*, float*) {
  refuse_blocks();
}

}  // namespace pw::exec
