// Calibration: measurements are read strictly (one-line errors naming file, row and column), the
// least-squares fit recovers parameters the model itself generated, and the all-reduce fit
// recovers a link's efficiency and latency.
#include <cmath>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "tests/test_util.hpp"

#include "calibrate/collectives.hpp"
#include "calibrate/fit.hpp"
#include "calibrate/measurements.hpp"
#include "planner/cost_model.hpp"
#include "traces/analytic.hpp"

namespace pw::calibrate {
namespace {

using pw::testing::error_of;
using pw::testing::TempDir;

const char* const kHeader =
    "# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,tensor "
    "parallelism,data parallelism,pipeline parallelism,iteration time (ms)\n";

TEST(Measurements, CsvRowsAsVTrainWritesThem) {
  const auto rows = parse_measurements_csv(std::string(kHeader) +
                                               "2,16,8,1024,16,24,1024,1,1,2,372.160408\r\n"
                                               "8,32,4,1024,16,24,1024,2,2,2,219.732754\n",
                                           "runs.csv");
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].gpus, 2);
  EXPECT_EQ(rows[0].global_batch, 16);
  EXPECT_EQ(rows[0].micro_batch, 8);
  EXPECT_EQ(rows[0].hidden, 1024);
  EXPECT_EQ(rows[0].layers, 24);
  EXPECT_EQ(rows[0].d, 2);
  EXPECT_DOUBLE_EQ(rows[0].iteration_time_s, 0.372160408);
  EXPECT_EQ(rows[1].t, 2);
  EXPECT_EQ(rows[1].w, 2);
  EXPECT_EQ(rows[1].where, "runs.csv: row 2 (line 3)");
}

TEST(Measurements, JsonWithOptionalModelFields) {
  const auto rows = parse_measurements_json(
      R"({"format": "pipewright.measurements/1", "measurements": [
          {"gpus": 4, "global_batch": 16, "micro_batch": 2, "hidden": 512, "heads": 8,
           "layers": 4, "seq_len": 256, "t": 1, "w": 2, "d": 2, "iteration_time_ms": 12.5,
           "ffn": 1024, "vocab": 1000, "dtype": "bf16", "attention": "fused", "dropout": false}]})",
      "runs.json");
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_DOUBLE_EQ(rows[0].iteration_time_s, 0.0125);
  const models::ModelSpec m = row_model(rows[0]);
  EXPECT_EQ(m.ffn, 1024);
  EXPECT_EQ(m.vocab, 1000);
  EXPECT_EQ(m.dtype, models::DType::bf16);
  EXPECT_EQ(m.attention, models::Attention::fused);
  EXPECT_FALSE(m.dropout);
}

TEST(Measurements, VTrainModelDefaults) {
  Measurement r;
  r.hidden = 1024, r.heads = 16, r.layers = 24, r.seq_len = 1024, r.where = "x";
  const models::ModelSpec m = row_model(r);
  EXPECT_EQ(m.ffn, 4096);
  EXPECT_EQ(m.vocab, 50257);
  EXPECT_EQ(m.vocab_multiple, 128);
  EXPECT_EQ(m.dtype, models::DType::fp16);
  EXPECT_EQ(m.attention, models::Attention::unfused);
  EXPECT_TRUE(m.dropout);
}

TEST(Measurements, EachBadInputIsOneLineNamingFileRowAndColumn) {
  const std::string row = "2,16,8,1024,16,24,1024,1,1,2,";
  auto csv_error = [](const std::string& text) {
    return error_of([&] { parse_measurements_csv(text, "runs.csv"); });
  };
  struct Case {
    std::string text, expected;
  };
  const Case cases[] = {
      {"", "runs.csv: empty file, no header"},
      {kHeader, "runs.csv: no measurement rows after the header"},
      {"# GPUs,global batch\n2,16\n", "runs.csv: line 1: missing column \"micro batch\""},
      {std::string(kHeader) + row + "0\n",
       "runs.csv: row 1 (line 2), column \"iteration time (ms)\": must be a positive finite time, "
       "found 0"},
      {std::string(kHeader) + row + "-3\n", "column \"iteration time (ms)\": must be a positive"},
      {std::string(kHeader) + row + "inf\n", "column \"iteration time (ms)\": must be a positive"},
      {std::string(kHeader) + row + "nan\n", "column \"iteration time (ms)\": must be a positive"},
      {std::string(kHeader) + row + "fast\n", "\"fast\" is not a number"},
      {std::string(kHeader) + "2.5,16,8,1024,16,24,1024,1,1,2,300\n",
       "runs.csv: row 1 (line 2), column \"# GPUs\": \"2.5\" is not an integer"},
      {std::string(kHeader) + "4,16,8,1024,16,24,1024,1,1,2,300\n",
       "runs.csv: row 1 (line 2), column \"# GPUs\": tensor x data x pipeline parallelism = 1 x 1 "
       "x 2 = 2, not 4"},
      {std::string(kHeader) + "2,12,8,1024,16,24,1024,1,1,2,300\n",
       "column \"global batch\": 12 is not a multiple of micro batch x data parallelism = 8 x 1"},
      {std::string(kHeader) + "2,16,8,1024\n",
       "runs.csv: row 1 (line 2): 4 cells, the header has 11"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    const std::string e = csv_error(c.text);
    EXPECT_NE(e.find(c.expected), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos);
  }
  EXPECT_NE(error_of([] {
              parse_measurements_json(R"({"format": "pipewright.measurements/1",
      "measurements": [{"gpus": 2}]})",
                                      "r.json");
            }).find("r.json: /measurements/0"),
            std::string::npos);
}

TEST(Measurements, FilesEmptyOrHugeAreRefusedBeforeParsing) {
  TempDir dir("calibrate_files");
  const std::string empty = dir.write("empty.csv", std::string(" \n"));
  EXPECT_EQ(error_of([&] { read_measurements(empty); }), empty + ": empty file");
  const std::string huge = dir.write("huge.csv", std::string(kHeader));
  std::filesystem::resize_file(huge, kMaxMeasurementFileBytes + 1);  // sparse
  EXPECT_NE(error_of([&] { read_measurements(huge); }).find("over the 64 MiB limit"),
            std::string::npos);
}

TEST(DeviceEfficiency, JsonRoundTripAndDefaultsLeftOut) {
  clusters::DeviceSpec d = clusters::load_device("A100-80GB");
  EXPECT_EQ(d.efficiency, clusters::DeviceEfficiency{});
  EXPECT_FALSE(clusters::to_json(d).contains("efficiency"));
  d.efficiency = {0.7, 200, 0.5, 0.6, 0.8, 1e-4};
  const common::Json j = clusters::to_json(d);
  EXPECT_EQ(clusters::parse_device(common::JsonReader(j, "round trip")), d);
  common::Json bad = j;
  bad["efficiency"]["gemm_max"] = 1.5;
  EXPECT_NE(error_of([&] {
              clusters::parse_device(common::JsonReader(bad, "d.json"));
            }).find("d.json: /efficiency/gemm_max: must be in (0, 1]"),
            std::string::npos);
  bad = j;
  bad["efficiency"]["gemm_maximum"] = 0.5;
  EXPECT_NE(error_of([&] {
              clusters::parse_device(common::JsonReader(bad, "d.json"));
            }).find("unknown efficiency parameter"),
            std::string::npos);
}

// Synthetic runs (t = 1) on shapes wide enough to tell the parameters apart.
FitData synthetic(const clusters::Cluster& cluster, const clusters::DeviceSpec& truth) {
  FitData data;
  int row = 0;
  for (std::int64_t hidden : {512, 1024, 2048})
    for (std::int64_t layers : {4, 8})
      for (std::int64_t seq : {256, 1024})
        for (std::int64_t b : {1, 4})
          for (auto [w, d] : {std::pair{1, 1}, {2, 1}, {1, 2}, {2, 2}}) {
            Measurement m;
            m.row = ++row;
            m.where = "synthetic row " + std::to_string(row);
            m.hidden = hidden, m.heads = 16, m.layers = layers, m.seq_len = seq;
            m.micro_batch = b, m.w = w, m.d = d, m.t = 1, m.gpus = w * d;
            m.global_batch = b * w * 4;
            RowSetup s = setup_row(m, cluster);
            data.measured_s.push_back(predict_s(s, truth));
            data.rows.push_back(std::move(s));
            data.file_rows.push_back(row);
          }
  return data;
}

TEST(Fit, RecoversTheParametersThatGeneratedTheMeasurements) {
  const clusters::Cluster cluster = clusters::load_cluster("vtrain-a100");
  clusters::DeviceSpec truth = cluster.device;
  truth.efficiency = {0.7, 200, 0.5, 0.6, 0.8, 2e-4, 2.5};
  const FitData data = synthetic(cluster, truth);
  clusters::DeviceSpec start = cluster.device;
  start.efficiency = {};
  clusters::DeviceEfficiency from;  // fit the blend's exponent too (from 3)
  from.overhead_exponent = 3;
  const DeviceFit fit = fit_device(data, start, from);
  const auto& e = fit.efficiency;
  EXPECT_NEAR(e.gemm_max, 0.7, 1e-4);
  EXPECT_NEAR(e.gemm_half_dim, 200, 0.05);
  EXPECT_NEAR(e.attention, 0.5, 1e-4);
  EXPECT_NEAR(e.elementwise, 0.6, 1e-4);
  EXPECT_NEAR(e.optimizer, 0.8, 1e-4);
  EXPECT_NEAR(e.layer_overhead_s, 2e-4, 1e-8);
  EXPECT_NEAR(e.overhead_exponent, 2.5, 1e-4);
  EXPECT_LT(max_abs(relative_errors(fit.predicted_s, data.measured_s)), 1e-6);
  // Held-out folds of exact data are predicted exactly too.
  const CrossValidation cv = cross_validate(data, start, 3, from);
  EXPECT_LT(max_abs(relative_errors(cv.predicted_s, data.measured_s)), 1e-5);
}

// Without a start exponent the fit keeps the hard floor max(g, o) (six parameters, p stays 0).
TEST(Fit, HardFloorFitRecoversSixParametersAndKeepsTheMax) {
  const clusters::Cluster cluster = clusters::load_cluster("vtrain-a100");
  clusters::DeviceSpec truth = cluster.device;
  truth.efficiency = {0.7, 200, 0.5, 0.6, 0.8, 2e-4, 0};
  const FitData data = synthetic(cluster, truth);
  clusters::DeviceSpec start = cluster.device;
  start.efficiency = {};
  const DeviceFit fit = fit_device(data, start);
  EXPECT_EQ(fit.efficiency.overhead_exponent, 0);
  EXPECT_NEAR(fit.efficiency.gemm_max, 0.7, 1e-4);
  EXPECT_NEAR(fit.efficiency.layer_overhead_s, 2e-4, 1e-8);
  EXPECT_LT(max_abs(relative_errors(fit.predicted_s, data.measured_s)), 1e-6);
}

TEST(Fit, FoldsAreRowIndexModK) {
  EXPECT_EQ(fold_of(0, 5), 0);
  EXPECT_EQ(fold_of(7, 5), 2);
  EXPECT_EQ(fold_of(10, 5), 0);
}

TEST(Fit, DefaultParametersReproduceTheUncalibratedEstimate) {
  // Uncalibrated device: the row's prediction is `estimate` of the row's plan, unchanged.
  const clusters::Cluster cluster = clusters::load_cluster("vtrain-a100");
  Measurement m;
  m.where = "r", m.hidden = 1024, m.heads = 16, m.layers = 24, m.seq_len = 1024;
  m.gpus = 8, m.w = 4, m.d = 2, m.micro_batch = 2, m.global_batch = 64;
  const RowSetup s = setup_row(m, cluster);
  EXPECT_EQ(s.plan.m, 8);
  EXPECT_EQ(s.plan.recompute, std::vector<planner::Recompute>(2, planner::Recompute::full));
  clusters::DeviceSpec d = cluster.device;
  d.efficiency = {};
  planner::Plan p = s.plan;
  planner::place(p, {1, 8});
  const double expected =
      planner::estimate(s.model, traces::analytic_trace(s.model, d, {2}), s.cluster, p)
          .report.iteration_time_s;
  EXPECT_EQ(predict_s(s, d), expected);
}

// A run on fewer GPUs than a node uses the node's first GPUs (a plan may use fewer GPUs than the
// cluster has).
TEST(Fit, RowsOnFewerGpusThanANodeUseItsFirstGpus) {
  const clusters::Cluster cluster = clusters::load_cluster("vtrain-a100");
  Measurement m;
  m.where = "r", m.hidden = 1024, m.heads = 16, m.layers = 24, m.seq_len = 1024;
  m.gpus = 2, m.w = 1, m.d = 2, m.micro_batch = 8, m.global_batch = 16;
  const RowSetup s = setup_row(m, cluster);
  EXPECT_EQ(s.cluster.nodes, 1);
  EXPECT_EQ(s.cluster.gpus_per_node, 8);
  planner::Plan p = s.plan;
  planner::place(p, {s.cluster.nodes, s.cluster.gpus_per_node});
  EXPECT_EQ(p.placement[0], (planner::Placement{0, 0}));
  EXPECT_EQ(p.placement[1], (planner::Placement{0, 1}));
  EXPECT_GT(predict_s(s, cluster.device), 0);
}

TEST(Collectives, AllReduceFitRecoversEfficiencyAndLatency) {
  clusters::Link truth{300e9 * 0.77, 8e-6, "intra-node"};
  std::vector<AllReduceSample> samples;
  for (int n : {2, 4, 8})
    for (double bytes = 1 << 20; bytes <= double(1 << 30); bytes *= 4)
      samples.push_back({n, bytes, planner::ring_allreduce_s(bytes, n, truth)});
  const CollectiveFit fit = fit_intra_node(samples, 300e9);
  EXPECT_NEAR(fit.efficiency, 0.77, 1e-6);
  EXPECT_NEAR(fit.latency_s, 8e-6, 1e-11);
}

TEST(Collectives, NcclTestsCsvAndItsErrors) {
  TempDir dir("calibrate_nccl");
  const std::string good =
      dir.write("allreduce_4gpu.csv",
                std::string("size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)\n"
                            "1048576,262144,float,51400,30.60,52740,29.82\n"));
  const auto s = read_allreduce_csv(good);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].gpus, 4);
  EXPECT_DOUBLE_EQ(s[0].time_s, 51400e-9);
  const std::string unnamed = dir.write("allreduce.csv", std::string("size(B),time(ns)\n1,2\n"));
  EXPECT_NE(error_of([&] { read_allreduce_csv(unnamed); }).find("GPU count"), std::string::npos);
}

}  // namespace
}  // namespace pw::calibrate
