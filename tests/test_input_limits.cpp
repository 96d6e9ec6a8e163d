// Input hardening (issue 13): the JSON reader's limits (depth, size, duplicate keys, any nlohmann
// error, non-regular files), integers read as 64-bit and refused out of range (never wrapped), the
// shared count limits for plans, clusters, reports and models, and checked size arithmetic.
#include <sys/stat.h>

#include <gtest/gtest.h>

#include "clusters/cluster.hpp"
#include "common/limits.hpp"
#include "models/model.hpp"
#include "planner/cost_model.hpp"
#include "planner/plan.hpp"
#include "planner/program.hpp"
#include "planner/report.hpp"
#include "test_util.hpp"
#include "traces/analytic.hpp"

namespace pw {
namespace {

using common::Json;
using testing::error_of;

void expect_one_line(const std::string& msg) {
  EXPECT_FALSE(msg.empty());
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(ParseJson, AnyNlohmannErrorIsOneLineNamingFileAndPath) {
  // out_of_range 406 (not a parse_error): once an "internal error".
  std::string msg = error_of([] { common::parse_json(R"({"a": {"b": [1, 1e400]}})", "f.json"); });
  EXPECT_NE(msg.find("f.json: /a/b/1: invalid JSON: number overflow parsing '1e400'"),
            std::string::npos)
      << msg;
  expect_one_line(msg);
  msg = error_of([] { common::parse_json("{\"a\": \"\xff\"}", "u.json"); });
  EXPECT_NE(msg.find("u.json: /a: invalid JSON"), std::string::npos) << msg;
  msg = error_of([] { common::parse_json("{ not json", "s.json"); });
  EXPECT_EQ(msg.rfind("s.json: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("invalid JSON: parse error"), std::string::npos) << msg;
  expect_one_line(msg);
}

TEST(ParseJson, DuplicateKeysAreRefused) {
  const std::string msg =
      error_of([] { common::parse_json(R"({"x": {"k": 1, "j": 2, "k": 3}})", "d.json"); });
  EXPECT_NE(msg.find("d.json: /x/k: invalid JSON: key given twice"), std::string::npos) << msg;
  // The same key in different objects is fine.
  EXPECT_NO_THROW(common::parse_json(R"({"a": {"k": 1}, "b": {"k": 1}, "c": [{"k": 1}, {"k": 2}]})",
                                     "ok.json"));
}

TEST(ParseJson, DepthIsLimitedBeforeAnythingRecursive) {
  std::string deep(100000, '[');
  deep += std::string(100000, ']');
  std::string msg = error_of([&] { common::parse_json(deep, "deep.json"); });
  EXPECT_NE(msg.find("nested deeper than"), std::string::npos) << msg;
  expect_one_line(msg);
  std::string ok_depth(common::kMaxJsonDepth, '[');
  ok_depth += std::string(common::kMaxJsonDepth, ']');
  EXPECT_NO_THROW(common::parse_json(ok_depth, "ok.json"));
  std::string one_more(common::kMaxJsonDepth + 1, '[');
  one_more += std::string(common::kMaxJsonDepth + 1, ']');
  EXPECT_THROW(common::parse_json(one_more, "deep.json"), InputError);
}

TEST(ReadJsonFile, NonRegularFilesAreRefusedBeforeReading) {
  testing::TempDir dir("limits");
  const std::string folder = dir.file("");
  for (const std::string& path : {std::string("/dev/zero"), folder}) {
    const std::string msg = error_of([&] { common::read_json_file(path); });
    EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
  }
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { common::read_json_file(fifo); }).find("not a regular file"),
            std::string::npos);
  const std::string huge = dir.file("huge.json");
  { std::ofstream create(huge); }
  std::filesystem::resize_file(huge, std::uintmax_t(common::kMaxJsonFileBytes + 1));
  EXPECT_NE(error_of([&] { common::read_json_file(huge); }).find("limit"), std::string::npos);
  EXPECT_NE(error_of([&] { common::read_json_file(dir.file("missing")); }).find("cannot open"),
            std::string::npos);
}

TEST(JsonReader, IntegersAreReadAs64BitAndNeverWrapped) {
  const Json j = common::parse_json(
      R"({"u": 18446744073709551615, "big": 4294967297, "neg": -1, "f": 2.5, "e": 1e19})", "n");
  common::JsonReader r(j, "n.json");
  EXPECT_NE(error_of([&] { r.get_int("u"); }).find("/u"), std::string::npos);
  EXPECT_EQ(r.get_int("big"), 4294967297);
  EXPECT_NE(error_of([&] { r.get_index("big"); }).find("/big: must be in 0 .. 999999"),
            std::string::npos);
  EXPECT_NE(error_of([&] { r.get_count("neg"); }).find("/neg"), std::string::npos);
  EXPECT_NE(error_of([&] { r.get_int("f"); }).find("/f"), std::string::npos);
  EXPECT_NE(error_of([&] { r.get_int("e"); }).find("/e"), std::string::npos);
}

TEST(CheckedArithmetic, RefusesInsteadOfWrapping) {
  EXPECT_EQ(common::checked_mul(1 << 20, 1 << 20, "x"), std::int64_t(1) << 40);
  EXPECT_THROW(common::checked_mul(std::int64_t(1) << 40, std::int64_t(1) << 40, "x"), InputError);
  EXPECT_THROW(common::checked_mul(3, 4, "x", 11), InputError);
  EXPECT_THROW(common::checked_add(INT64_MAX, 1, "x"), InputError);
  EXPECT_THROW(common::checked_product({1 << 20, 1 << 20, 1 << 20, 1 << 20}, "x"), InputError);
  EXPECT_TRUE(common::is_utf8("h\xc3\xa9llo"));
  EXPECT_FALSE(common::is_utf8("\xff"));
}

TEST(PlanLimits, IndicesAndCountsAreBounded) {
  Json plan = common::parse_json(
      R"({"format": "pipewright.plan/1", "schedule": "1f1b", "w": 2, "d": 1, "b": 1, "m": 1,
          "placement": [{"node": 0, "gpu": 0}, {"node": 0, "gpu": 4294967297}]})",
      "p");
  std::string msg = error_of([&] { planner::parse_plan(plan, "p.json"); });
  EXPECT_NE(msg.find("p.json: /placement/1/gpu"), std::string::npos) << msg;
  plan["placement"][1]["gpu"] = 1;
  plan["m"] = 1000001;
  msg = error_of([&] { planner::parse_plan(plan, "p.json"); });
  EXPECT_NE(msg.find("/m: must be in 1 .. 1000000"), std::string::npos) << msg;
  planner::Plan p;
  p.w = 1000;
  p.d = 1000;
  EXPECT_THROW(planner::check(p), PlanError);  // 10^6 ranks: more than kMaxRanks
  p.w = 1;
  p.d = 1;
  p.m = 2'000'000;
  EXPECT_THROW(planner::check(p), PlanError);
}

TEST(ProgramLimits, RefusedBeforeAllocating) {
  planner::Plan p;
  p.schedule = planner::Schedule::one_f_one_b;
  p.d = 8;
  p.m = 1'000'000;
  const std::string msg = error_of<PlanError>([&] { planner::generate_programs(p, 2, 1); });
  EXPECT_NE(msg.find("ops"), std::string::npos) << msg;
  expect_one_line(msg);
}

TEST(ClusterLimits, DeviceCountIsCheckedIn64Bits) {
  Json c = clusters::to_json(clusters::load_cluster("dgx-a100"));
  c["nodes"] = 3;
  c["gpus_per_node"] = 1431655766;  // 3 x this wraps a 32-bit int to 2
  EXPECT_NE(error_of([&] { clusters::parse_cluster(c, "c.json"); }).find("/gpus_per_node"),
            std::string::npos);
  c["gpus_per_node"] = 1000;
  c["nodes"] = 1001;
  EXPECT_NE(error_of([&] { clusters::parse_cluster(c, "c.json"); }).find("more than 1000000"),
            std::string::npos);
  EXPECT_THROW(clusters::load_cluster("dgx-a100:1000000"), InputError);
  EXPECT_THROW(clusters::load_cluster("dgx-a100", 1'000'001), InputError);
}

TEST(ReportLimits, RankIsNotWrapped) {
  planner::RunReport r;
  r.source = "measured";
  r.plan.w = 2;
  r.devices.resize(2);
  r.devices[1].rank = 1;
  Json j = planner::to_json(r);
  j["devices"][1]["rank"] = (std::int64_t(1) << 32) + 1;  // once read as rank 1
  std::string msg = error_of([&] { planner::parse_report(j, "r.json"); });
  EXPECT_NE(msg.find("r.json: /devices/1/rank"), std::string::npos) << msg;
  j["devices"][1]["rank"] = std::int64_t(1) << 31;  // once a segfault in validate
  EXPECT_THROW(planner::parse_report(j, "r.json"), InputError);
}

TEST(ModelLimits, DimensionsAndDerivedBytesAreBounded) {
  models::ModelSpec m = models::load_model("gpt-tiny");
  m.seq_len = 1'000'000'000;
  m.max_positions = m.seq_len;
  EXPECT_NE(error_of([&] { models::validate(m, "m"); }).find("/seq_len"), std::string::npos);
  // Sizes within the per-field limits whose per-device bytes pass kMaxBytes: one line, never a
  // negative memory.
  m = models::load_model("gpt2-124m");
  m.seq_len = 1 << 24;
  m.max_positions = m.seq_len;
  m.positions = models::Positions::rope;
  const clusters::Cluster c = clusters::load_cluster("dgx-a100");
  try {
    models::validate(m, "m");
    const traces::Trace t = traces::analytic_trace(m, c.device, {1 << 19});
    planner::Plan p;
    p.b = 1 << 19;
    planner::resolve_stages(p, m.layers);
    planner::place(p, {c.nodes, c.gpus_per_node});
    const auto est = planner::estimate(m, t, c, p);
    for (const auto& d : est.report.devices)
      EXPECT_GE(d.peak_memory_bytes, 0);
  } catch (const InputError& e) {
    expect_one_line(e.what());
  }
}

}  // namespace
}  // namespace pw
