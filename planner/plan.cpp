// Plan checks, stage splitting, placement and the plan JSON format.
#include "planner/plan.hpp"

#include <algorithm>
#include <numeric>
#include <set>

#include <fmt/format.h>

#include "common/limits.hpp"

namespace pw::planner {

using common::Json;
using common::JsonReader;

std::string to_string(Schedule s) {
  switch (s) {
    case Schedule::gpipe:
      return "gpipe";
    case Schedule::one_f_one_b:
      return "1f1b";
    case Schedule::two_bw:
      return "2bw";
    case Schedule::interleaved:
      return "interleaved";
    case Schedule::dp:
      return "dp";
  }
  return "?";
}

std::string to_string(Recompute r) {
  switch (r) {
    case Recompute::none:
      return "none";
    case Recompute::selective:
      return "selective";
    case Recompute::full:
      return "full";
    case Recompute::block:
      return "block";
  }
  return "?";
}

Recompute parse_recompute(const std::string& s) {
  for (Recompute x : {Recompute::none, Recompute::selective, Recompute::full, Recompute::block})
    if (s == to_string(x)) return x;
  throw InputError(
      fmt::format("unknown recompute mode \"{}\" (expected none, selective, full or block)", s));
}

std::string to_string(Offload o) {
  switch (o) {
    case Offload::optimizer:
      return "optimizer";
    case Offload::chunks:
      return "chunks";
    case Offload::none:
      break;
  }
  return "none";
}

std::string to_string(ActivationChoice c) {
  return c == ActivationChoice::swap ? "swap" : "recompute";
}

ActivationChoice parse_activation_choice(const std::string& s) {
  if (s == "swap") return ActivationChoice::swap;
  if (s == "recompute") return ActivationChoice::recompute;
  throw InputError(fmt::format("unknown activation choice \"{}\" (expected swap or recompute)", s));
}

OffloadModes parse_offload_modes(const std::string& s) {
  OffloadModes m;
  if (s == "none") return m;
  std::size_t begin = 0;
  for (;;) {
    const std::size_t comma = s.find(',', begin);
    const std::string part = s.substr(begin, comma == std::string::npos ? comma : comma - begin);
    if (part == "optimizer" && m.optimizer == Offload::none) {
      m.optimizer = Offload::optimizer;
    } else if (part == "activations" && !m.activations) {
      m.activations = true;
    } else if (part == "chunks" && s == "chunks") {
      m.optimizer = Offload::chunks;
    } else if (part == "chunks") {
      throw InputError(fmt::format(
          "offload \"{}\": chunks (PatrickStar) holds all model data and combines with no other "
          "mode; use --offload chunks alone",
          s));
    } else {
      throw InputError(fmt::format(
          "unknown offload mode \"{}\" (expected none, optimizer, chunks, activations or "
          "optimizer,activations)",
          s));
    }
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return m;
}

std::string offload_name(const Plan& p) {
  if (p.offload == Offload::optimizer && p.offload_activations) return "optimizer,activations";
  if (p.offload_activations) return "activations";
  return to_string(p.offload);
}

void set_activations(Plan& p, const std::vector<ActivationChoice>& choices) {
  p.offload_activations = true;
  p.activations = choices;
  p.activation_layers.clear();  // every block follows its stage
  p.recompute.assign(choices.size(), Recompute::none);
  for (std::size_t s = 0; s < choices.size(); ++s)
    if (choices[s] == ActivationChoice::recompute) p.recompute[s] = Recompute::full;
}

namespace {
// The per-stage choice a stage's block choices amount to: swap when any block swaps.
ActivationChoice stage_choice(const std::vector<ActivationChoice>& layers) {
  for (ActivationChoice c : layers)
    if (c == ActivationChoice::swap) return ActivationChoice::swap;
  return ActivationChoice::recompute;
}
bool is_mixed(const std::vector<ActivationChoice>& layers) {
  return std::find(layers.begin(), layers.end(), ActivationChoice::swap) != layers.end() &&
         std::find(layers.begin(), layers.end(), ActivationChoice::recompute) != layers.end();
}
}  // namespace

void set_activation_layers(Plan& p, const std::vector<std::vector<ActivationChoice>>& layers) {
  std::vector<ActivationChoice> stages;
  for (const auto& l : layers)
    stages.push_back(stage_choice(l));
  set_activations(p, stages);
  p.activation_layers = layers;
}

std::int64_t stage_block_count(const Plan& p, int stage) {
  std::int64_t n = 0;
  for (int c = 0; c < p.v; ++c) {
    const std::size_t vs = std::size_t(c * p.d + stage);
    if (vs < p.stage_blocks.size()) n += p.stage_blocks[vs];
  }
  return n;
}

std::vector<ActivationChoice> layer_choices(const Plan& p, int stage) {
  if (!p.activation_layers.empty()) return p.activation_layers[std::size_t(stage)];
  const ActivationChoice c = p.swaps(stage) ? ActivationChoice::swap : ActivationChoice::recompute;
  return std::vector<ActivationChoice>(std::size_t(stage_block_count(p, stage)), c);
}

bool Plan::mixed_activations(int stage) const {
  return offload_activations && !activation_layers.empty() &&
         is_mixed(activation_layers[std::size_t(stage)]);
}

std::int64_t Plan::swapped_layers(int stage) const {
  if (!offload_activations) return 0;
  const auto l = layer_choices(*this, stage);
  return std::count(l.begin(), l.end(), ActivationChoice::swap);
}

std::int64_t Plan::recomputed_layers(int stage) const {
  if (!offload_activations) return 0;
  const auto l = layer_choices(*this, stage);
  return std::count(l.begin(), l.end(), ActivationChoice::recompute);
}

Schedule parse_schedule(const std::string& s) {
  for (Schedule x : {Schedule::gpipe, Schedule::one_f_one_b, Schedule::two_bw,
                     Schedule::interleaved, Schedule::dp})
    if (s == to_string(x)) return x;
  throw InputError(
      fmt::format("unknown schedule \"{}\" (expected gpipe, 1f1b, 2bw, interleaved or dp)", s));
}

namespace {

[[noreturn]] void reject(const std::string& field, const std::string& why) {
  throw PlanError(fmt::format("plan: {}: {}", field, why));
}

// activation_layers against d, the per-stage choices and (when resolved) the stage's blocks.
void check_activation_layers(const Plan& p) {
  if (p.activation_layers.empty() || !p.offload_activations) return;
  if (int(p.activation_layers.size()) != p.d)
    reject("activation_layers", fmt::format("has {} entries but the plan has d = {} stages",
                                            p.activation_layers.size(), p.d));
  for (int s = 0; s < p.d; ++s) {
    const auto& l = p.activation_layers[std::size_t(s)];
    const std::string field = fmt::format("activation_layers[{}]", s);
    if (l.empty()) reject(field, "needs one choice per block of the stage, found none");
    if (!p.stage_blocks.empty() && std::int64_t(l.size()) != stage_block_count(p, s))
      reject(field, fmt::format("has {} entries but stage {} holds {} blocks", l.size(), s,
                                stage_block_count(p, s)));
    if (p.activations.size() == p.activation_layers.size() &&
        p.activations[std::size_t(s)] != stage_choice(l))
      reject(field,
             fmt::format("amounts to {} (swap when any block swaps) but activations[{}] is {}",
                         to_string(stage_choice(l)), s, to_string(p.activations[std::size_t(s)])));
  }
}

}  // namespace

void check(const Plan& p) {
  const std::pair<const char*, int> positive[] = {{"t", p.t}, {"w", p.w}, {"d", p.d},
                                                  {"b", p.b}, {"m", p.m}, {"v", p.v}};
  for (auto [field, value] : positive)
    if (value < 1 || value > common::kMaxCount)
      reject(field, fmt::format("must be in 1 .. {}, found {}", common::kMaxCount, value));
  if (p.sp && p.t == 1)
    reject("sp", "sequence parallelism splits a tensor-parallel group's work and needs t > 1");
  // Each factor is at most 10^6 here, so these products fit in int64.
  if (std::int64_t(p.t) * p.w * p.d > kMaxGpus)
    reject("t*w*d", fmt::format("t*w*d = {}*{}*{} GPUs is more than {}", p.t, p.w, p.d, kMaxGpus));
  if (std::int64_t(p.w) * p.d > common::kMaxRanks)
    reject("w*d",
           fmt::format("w*d = {}*{} pipeline ranks is more than {}", p.w, p.d, common::kMaxRanks));
  if (std::int64_t(p.d) * p.v > common::kMaxCount)
    reject("v", fmt::format("d*v = {}*{} stages is more than {}", p.d, p.v, common::kMaxCount));
  if (p.schedule == Schedule::dp && p.d != 1)
    reject("d", fmt::format("schedule dp is data parallelism only and needs d = 1, found {}", p.d));
  if (p.schedule == Schedule::two_bw && p.m < p.d)
    reject("m", fmt::format("2bw needs m >= d (found m = {}, d = {}) so that at most two weight "
                            "versions are live",
                            p.m, p.d));
  if (p.schedule == Schedule::interleaved) {
    if (p.m % p.d != 0)
      reject("m", fmt::format("interleaved needs m to be a multiple of d (found m = {}, d = {})",
                              p.m, p.d));
  } else if (p.v != 1) {
    reject("v", fmt::format("v = {} needs schedule interleaved (schedule is {})", p.v,
                            to_string(p.schedule)));
  }
  if (p.overlap_param_gather && !p.distributed_optimizer)
    reject("overlap_param_gather", "needs the distributed optimizer (distributed_optimizer: true)");
  if (p.offload == Offload::optimizer) {
    // With w > 1 ZeRO-Offload shards CPU Adam over the replicas (docs/formulas.md section 9,
    // data parallelism): the distributed optimizer, its shards on the host.
    if (p.w > 1 && !p.distributed_optimizer)
      reject("offload", fmt::format("optimizer offload with data parallelism (w = {}) shards the "
                                    "host optimizer over the replicas (ZeRO-Offload): it needs "
                                    "the distributed optimizer (--distributed-optimizer)",
                                    p.w));
    if (p.distributed_optimizer && p.w == 1)
      reject("offload",
             "optimizer offload with the distributed optimizer needs w > 1 (it shards the host "
             "optimizer over the data-parallel replicas)");
  }
  if (p.chunk_bytes != 0 && p.offload != Offload::chunks)
    reject("chunk_bytes", "a chunk size needs offload chunks");
  if (p.chunk_bytes < 0 || p.chunk_bytes > common::kMaxBytes)
    reject("chunk_bytes",
           fmt::format("must be in 1 .. {}, found {}", common::kMaxBytes, p.chunk_bytes));
  if (p.chunk_shard) {
    if (p.offload != Offload::chunks) reject("chunk_shard", "sharded chunks need offload chunks");
    if (p.w < 2)
      reject("chunk_shard",
             fmt::format("sharded chunks split each chunk over the w replicas: needs w > 1, "
                         "found w = {}",
                         p.w));
  }
  if (p.offload == Offload::chunks) {
    // What the chunk manager does not do yet (planner/chunks.hpp), each a one-line refusal.
    // Pipeline stages (d > 1, gpipe or 1f1b) each manage their own chunks.
    // Data parallelism (w > 1) shards each chunk's optimizer state over the replicas
    // (planner/chunks.hpp): the distributed optimizer's rule, built in.
    // Tensor parallelism (t > 1): each GPU of a TP group manages the chunks of its own shard.
    // Interleaving (v > 1): each device one layout over its model chunks' layers.
    if (p.distributed_optimizer)
      reject("distributed_optimizer",
             "offload chunks shard their optimizer state over the w replicas by themselves; "
             "leave distributed_optimizer off");
  }
  if (!p.activations.empty() && !p.offload_activations)
    reject("activations", "swap/recompute choices need offload activations");
  if (!p.activation_layers.empty() && !p.offload_activations)
    reject("activation_layers", "swap/recompute choices need offload activations");
  check_activation_layers(p);
  if (p.offload_activations) {
    if (p.activations.empty())
      for (std::size_t s = 0; s < p.recompute.size(); ++s)
        if (p.recompute[s] != Recompute::none)
          reject("recompute", fmt::format("with activation offload each stage's recompute follows "
                                          "its swap/recompute choice (stage {} has {}); drop "
                                          "--recompute, or give the choices in a plan file",
                                          s, to_string(p.recompute[s])));
    if (!p.activations.empty() && int(p.activations.size()) != p.d)
      reject("activations", fmt::format("has {} entries but the plan has d = {} stages",
                                        p.activations.size(), p.d));
    for (std::size_t s = 0; s < p.activations.size(); ++s) {
      const Recompute want =
          p.activations[s] == ActivationChoice::swap ? Recompute::none : Recompute::full;
      if (!p.recompute.empty() && p.recompute.size() == p.activations.size() &&
          p.recompute[s] != want)
        reject(
            fmt::format("activations[{}]", s),
            fmt::format("{} needs recompute {} on stage {}, found {}", to_string(p.activations[s]),
                        to_string(want), s, to_string(p.recompute[s])));
      if (p.recompute.empty() && want != Recompute::none)
        reject(fmt::format("activations[{}]", s),
               fmt::format("recompute needs recompute full on stage {}, found none", s));
    }
  }
  if (!p.stage_blocks.empty() && int(p.stage_blocks.size()) != p.virtual_stages())
    reject("stage_blocks", fmt::format("has {} entries but the plan has d*v = {} stages",
                                       p.stage_blocks.size(), p.virtual_stages()));
  for (std::size_t i = 0; i < p.stage_blocks.size(); ++i)
    if (p.stage_blocks[i] < 1)
      reject(fmt::format("stage_blocks[{}]", i), "a stage must hold at least one block");
  if (!p.recompute.empty() && int(p.recompute.size()) != p.d)
    reject("recompute",
           fmt::format("has {} entries but the plan has d = {} stages", p.recompute.size(), p.d));
  if (!p.placement.empty() && int(p.placement.size()) != p.ranks())
    reject("placement", fmt::format("has {} entries but the plan has w*d = {} ranks",
                                    p.placement.size(), p.ranks()));
}

std::vector<std::int64_t> balanced_split(std::int64_t layers, int parts) {
  std::vector<std::int64_t> out(parts, layers / parts);
  for (int i = 0; i < int(layers % parts); ++i)
    ++out[i];
  return out;
}

void resolve_stages(Plan& p, std::int64_t layers) {
  check(p);
  if (p.virtual_stages() > layers)
    reject("d", fmt::format("d*v = {} stages but the model has only {} blocks", p.virtual_stages(),
                            layers));
  if (p.stage_blocks.empty()) {
    p.stage_blocks = balanced_split(layers, p.virtual_stages());
  } else {
    std::int64_t sum =
        std::accumulate(p.stage_blocks.begin(), p.stage_blocks.end(), std::int64_t{0});
    if (sum != layers)
      reject("stage_blocks",
             fmt::format("blocks sum to {} but the model has {} blocks", sum, layers));
  }
  check_activation_layers(p);  // its lengths against the blocks now known
}

void place(Plan& p, const DeviceGrid& grid, int ranks_per_gpu) {
  check(p);
  if (ranks_per_gpu < 1) reject("ranks_per_gpu", "must be at least 1");
  if (p.t > 1 && ranks_per_gpu > 1)
    reject("t", fmt::format("a tensor-parallel group (t = {}) needs a GPU per rank, not {} ranks "
                            "per GPU",
                            p.t, ranks_per_gpu));
  if (p.t > grid.gpus_per_node || grid.gpus_per_node % p.t != 0)
    reject("t", fmt::format("a tensor-parallel group stays inside a node: t = {} must divide the "
                            "{} GPUs per node",
                            p.t, grid.gpus_per_node));
  const std::int64_t devices = std::int64_t(grid.nodes) * grid.gpus_per_node;
  if (!p.placement.empty()) {
    for (int r = 0; r < p.ranks(); ++r) {
      const auto& pl = p.placement[r];
      if (pl.node < 0 || pl.node >= grid.nodes || pl.gpu < 0 || pl.gpu + p.t > grid.gpus_per_node)
        reject(fmt::format("placement[{}]", r),
               p.t == 1 ? fmt::format("rank {} is placed on node {} gpu {}, outside the cluster's "
                                      "{} x {}",
                                      r, pl.node, pl.gpu, grid.nodes, grid.gpus_per_node)
                        : fmt::format("rank {}'s TP group is placed on node {} gpus {}..{}, "
                                      "outside the cluster's {} x {}",
                                      r, pl.node, pl.gpu, pl.gpu + p.t - 1, grid.nodes,
                                      grid.gpus_per_node));
    }
    return;
  }
  // Megatron's order: TP fastest (a group's t GPUs adjacent), then data parallelism, then the
  // pipeline, over group slots of t GPUs. A plan may use fewer GPUs than the cluster has (the
  // first ones).
  const int slots_per_node = grid.gpus_per_node / p.t;
  const std::int64_t slots = std::int64_t(grid.nodes) * slots_per_node;
  if (std::int64_t(p.ranks()) > slots * ranks_per_gpu) {
    if (p.t > 1)
      reject("t*w*d", fmt::format("t*w*d = {}*{}*{} = {} GPUs but the cluster has {}", p.t, p.w,
                                  p.d, p.gpus(), devices));
    if (ranks_per_gpu == 1)
      reject("w*d", fmt::format("w*d = {}*{} = {} ranks but the cluster has {} devices", p.w, p.d,
                                p.ranks(), devices));
    reject("w*d", fmt::format("w*d = {} ranks but the cluster has {} devices x {} ranks per GPU",
                              p.ranks(), devices, ranks_per_gpu));
  }
  p.placement.assign(std::size_t(p.ranks()), {});
  // A stage's replicas inside one node when they fit (its all-reduce stays on the intra-node
  // fabric); otherwise each pipeline packed into consecutive slots (PipeDream-2BW's choice).
  const bool replicas_inside_node = p.w <= slots_per_node;
  for (int r = 0; r < p.ranks(); ++r) {
    const int s = p.stage_of(r), rep = p.replica_of(r);
    const int slot = replicas_inside_node ? s * p.w + rep : rep * p.d + s;
    const int device = slot / ranks_per_gpu;
    p.placement[std::size_t(r)] = {device / slots_per_node, (device % slots_per_node) * p.t};
  }
}

Plan parse_plan(const Json& json, const std::string& source) {
  JsonReader r(json, source);
  r.expect_format("pipewright.plan/1");
  Plan p;
  try {
    p.schedule = parse_schedule(r.get_string("schedule"));
  } catch (const InputError& e) {
    r.fail_member("schedule", e.what());
  }
  auto small_int = [&](const char* key) { return r.get_count(key); };
  p.t = r.has("t") ? small_int("t") : 1;
  if (r.has("sp")) p.sp = r.get_bool("sp");
  if (r.has("distributed_optimizer")) p.distributed_optimizer = r.get_bool("distributed_optimizer");
  if (r.has("overlap_param_gather")) p.overlap_param_gather = r.get_bool("overlap_param_gather");
  p.w = small_int("w");
  p.d = small_int("d");
  p.b = small_int("b");
  p.m = small_int("m");
  p.v = r.has("v") ? small_int("v") : 1;
  if (r.has("offload")) {
    try {
      const OffloadModes modes = parse_offload_modes(r.get_string("offload"));
      p.offload = modes.optimizer;
      p.offload_activations = modes.activations;
    } catch (const InputError& e) {
      r.fail_member("offload", e.what());
    }
  }
  if (r.has("chunk_bytes")) p.chunk_bytes = r.get_int_in("chunk_bytes", 1, common::kMaxBytes);
  if (r.has("chunk_shard")) p.chunk_shard = r.get_bool("chunk_shard");
  if (auto ac = r.find("activations")) {
    for (std::size_t i = 0; i < ac->size(); ++i) {
      const JsonReader e = ac->at(i);
      const std::string word = e.as_string();  // its own error names the element once
      try {
        p.activations.push_back(parse_activation_choice(word));
      } catch (const InputError& err) {
        e.fail(err.what());
      }
    }
  }
  if (auto al = r.find("activation_layers")) {
    for (std::size_t i = 0; i < al->size(); ++i) {
      const JsonReader st = al->at(i);
      std::vector<ActivationChoice> layers;
      for (std::size_t k = 0; k < st.size(); ++k) {
        const JsonReader e = st.at(k);
        const std::string word = e.as_string();  // its own error names the element once
        try {
          layers.push_back(parse_activation_choice(word));
        } catch (const InputError& err) {
          e.fail(err.what());
        }
      }
      p.activation_layers.push_back(std::move(layers));
    }
  }
  if (auto sb = r.find("stage_blocks"))
    for (std::size_t i = 0; i < sb->size(); ++i)
      p.stage_blocks.push_back(sb->at(i).as_int_in(1, common::kMaxCount));
  if (auto rc = r.find("recompute")) {
    // true / false (full / none), a mode name, or one of those per stage.
    auto mode = [&](const JsonReader& e) {
      if (e.value().is_boolean()) return e.as_bool() ? Recompute::full : Recompute::none;
      try {
        return parse_recompute(e.as_string());
      } catch (const InputError& err) {
        e.fail(err.what());
      }
    };
    if (rc->value().is_array()) {
      for (std::size_t i = 0; i < rc->size(); ++i)
        p.recompute.push_back(mode(rc->at(i)));
    } else {
      p.recompute.assign(std::size_t(p.d), mode(*rc));
    }
  }
  // Per-layer choices: the per-stage choices they amount to (check() compares them with an
  // activations list given too) and, without a recompute list, the recompute they imply.
  if (!p.activation_layers.empty() && p.offload_activations &&
      int(p.activation_layers.size()) == p.d) {
    const std::vector<ActivationChoice> given = p.activations;
    const std::vector<std::vector<ActivationChoice>> layers = p.activation_layers;
    const std::vector<Recompute> recompute = p.recompute;
    set_activation_layers(p, layers);
    if (!given.empty()) p.activations = given;
    if (r.has("recompute")) p.recompute = recompute;
  }
  // Choices without a recompute list: the recompute each choice implies.
  if (!p.activations.empty() && !r.has("recompute") && p.offload_activations &&
      p.activation_layers.empty()) {
    const std::vector<ActivationChoice> choices = p.activations;
    set_activations(p, choices);
  }
  if (auto pl = r.find("placement"))
    for (std::size_t i = 0; i < pl->size(); ++i) {
      auto e = pl->at(i);
      if (e.has("rank") && e.get_int("rank") != std::int64_t(i))
        e.fail_member("rank", fmt::format("entries must be in rank order; expected {}", i));
      p.placement.push_back({e.get_index("node"), e.get_index("gpu")});
    }
  try {
    check(p);
  } catch (const PlanError& e) {
    throw PlanError(fmt::format("{}: {}", source, e.what()));
  }
  return p;
}

Json to_json(const Plan& p) {
  Json j = {{"format", "pipewright.plan/1"},
            {"schedule", to_string(p.schedule)},
            {"t", p.t},
            {"sp", p.sp},
            {"distributed_optimizer", p.distributed_optimizer},
            {"w", p.w},
            {"d", p.d},
            {"b", p.b},
            {"m", p.m},
            {"v", p.v},
            {"global_batch", p.global_batch()},
            {"stage_blocks", p.stage_blocks}};
  // Written only when on, so plans without offload read and print as before.
  if (p.any_offload()) j["offload"] = offload_name(p);
  if (p.chunk_bytes > 0) j["chunk_bytes"] = p.chunk_bytes;
  if (p.chunk_shard) j["chunk_shard"] = true;
  if (!p.activations.empty()) {
    Json ac = Json::array();
    for (ActivationChoice c : p.activations)
      ac.push_back(to_string(c));
    j["activations"] = ac;
  }
  if (!p.activation_layers.empty()) {
    Json al = Json::array();
    for (const auto& layers : p.activation_layers) {
      Json l = Json::array();
      for (ActivationChoice c : layers)
        l.push_back(to_string(c));
      al.push_back(l);
    }
    j["activation_layers"] = al;
  }
  if (p.overlap_param_gather) j["overlap_param_gather"] = true;
  Json rc = Json::array();
  for (int s = 0; s < p.d; ++s)
    rc.push_back(to_string(p.recompute_of(s)));
  j["recompute"] = rc;
  Json pl = Json::array();
  for (int r = 0; r < int(p.placement.size()); ++r)
    pl.push_back({{"rank", r},
                  {"stage", p.stage_of(r)},
                  {"replica", p.replica_of(r)},
                  {"node", p.placement[r].node},
                  {"gpu", p.placement[r].gpu}});
  j["placement"] = pl;
  return j;
}

Plan load_plan(const std::string& path) {
  return parse_plan(common::read_json_file(path), path);
}

}  // namespace pw::planner
