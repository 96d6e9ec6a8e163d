// Measured training runs to calibrate against: one iteration time per (model, plan) row, read from
// a CSV with vTrain's columns or a "pipewright.measurements/1" JSON file (docs/formats.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pw::calibrate {

// One measured run: a GPT model trained with Megatron's 1F1B schedule on t * w * d GPUs.
struct Measurement {
  std::string where;  // "runs.csv row 3" or "runs.json /measurements/2", for messages
  int row = 0;        // 1-based position in the file
  int gpus = 0;
  std::int64_t global_batch = 0;
  std::int64_t micro_batch = 0;
  std::int64_t hidden = 0;
  std::int64_t heads = 0;
  std::int64_t layers = 0;
  std::int64_t seq_len = 0;
  int t = 1;  // tensor parallelism
  int w = 1;  // data parallelism
  int d = 1;  // pipeline parallelism
  double iteration_time_s = 0;
  // Optional model fields (JSON only); unset: vTrain's GPT (FFN 4h, vocabulary 50257 padded to a
  // multiple of 128 t, fp16, unfused attention, dropout).
  std::optional<std::int64_t> ffn, vocab, vocab_multiple;
  std::optional<std::string> dtype, attention;
  std::optional<bool> dropout;
};

// Files larger than this are refused before they are read.
inline constexpr std::int64_t kMaxMeasurementFileBytes = 64ll << 20;

// CSV (header: "# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence
// length,tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)", any order,
// extra columns ignored) or JSON, by content: a file whose first non-blank character is '{' is
// JSON. Every bad value is an InputError naming the file, row and column.
std::vector<Measurement> read_measurements(const std::string& path);
std::vector<Measurement> parse_measurements_csv(const std::string& text, const std::string& source);
std::vector<Measurement> parse_measurements_json(const std::string& text,
                                                 const std::string& source);

}  // namespace pw::calibrate
