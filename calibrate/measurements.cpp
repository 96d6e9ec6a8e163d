// Reading measured runs: CSV with vTrain's header or JSON, strict, one-line errors.
#include "calibrate/measurements.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>

#include "common/json_reader.hpp"

namespace pw::calibrate {

namespace {

const char* const kColGpus = "# GPUs";
const char* const kColGlobal = "global batch";
const char* const kColMicro = "micro batch";
const char* const kColHidden = "hidden size";
const char* const kColHeads = "attention heads";
const char* const kColLayers = "# layers";
const char* const kColSeq = "sequence length";
const char* const kColT = "tensor parallelism";
const char* const kColW = "data parallelism";
const char* const kColD = "pipeline parallelism";
const char* const kColTime = "iteration time (ms)";
const char* const kColumns[] = {kColGpus, kColGlobal, kColMicro, kColHidden, kColHeads, kColLayers,
                                kColSeq,  kColT,      kColW,     kColD,      kColTime};

std::string trimmed(std::string s) {
  const auto first = s.find_first_not_of(" \t\r");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t\r") - first + 1);
}

std::vector<std::string> split_commas(const std::string& line) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (true) {
    const std::size_t end = line.find(',', pos);
    out.push_back(trimmed(line.substr(pos, end == std::string::npos ? end : end - pos)));
    if (end == std::string::npos) return out;
    pos = end + 1;
  }
}

// Where a CSV cell sits, for messages: "runs.csv: row 3 (line 4), column \"# GPUs\"".
struct Cell {
  const std::string& source;
  int row, line;
  const char* column;
  [[noreturn]] void fail(const std::string& message) const {
    throw InputError(
        fmt::format("{}: row {} (line {}), column \"{}\": {}", source, row, line, column, message));
  }
};

std::int64_t parse_positive_int(const std::string& text, const Cell& cell) {
  std::int64_t v = 0;
  std::size_t used = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size()) cell.fail(fmt::format("\"{}\" is not an integer", text));
  if (v < 1) cell.fail(fmt::format("must be at least 1, found {}", v));
  if (v > 1'000'000'000) cell.fail(fmt::format("{} is too large", v));
  return v;
}

double parse_time_ms(const std::string& text, const Cell& cell) {
  double v = 0;
  std::size_t used = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size()) cell.fail(fmt::format("\"{}\" is not a number", text));
  if (!std::isfinite(v) || v <= 0)
    cell.fail(fmt::format("must be a positive finite time, found {}", text));
  return v;
}

// Checks shared by both formats: t*w*d == GPUs and a global batch that splits into microbatches.
void check_row(const Measurement& m, const std::string& gpus_name, const std::string& batch_name) {
  if (std::int64_t(m.t) * m.w * m.d != m.gpus)
    throw InputError(fmt::format(
        "{}, column \"{}\": tensor x data x pipeline parallelism = {} x {} x {} = {}, not {}",
        m.where, gpus_name, m.t, m.w, m.d, std::int64_t(m.t) * m.w * m.d, m.gpus));
  if (m.global_batch % (m.micro_batch * m.w) != 0)
    throw InputError(fmt::format(
        "{}, column \"{}\": {} is not a multiple of micro batch x data parallelism = {} x {}",
        m.where, batch_name, m.global_batch, m.micro_batch, m.w));
}

std::string read_limited(const std::string& path) {
  // A regular file only: a directory, a FIFO or /dev/zero is refused before it is read.
  return common::read_regular_file(path, kMaxMeasurementFileBytes, "measurements file");
}

}  // namespace

std::vector<Measurement> parse_measurements_csv(const std::string& text,
                                                const std::string& source) {
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
  std::vector<std::string> header;
  while (header.empty() && std::getline(in, line)) {
    ++line_no;
    if (line_no == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line = line.substr(3);  // BOM
    if (!trimmed(line).empty()) header = split_commas(line);
  }
  if (header.empty()) throw InputError(fmt::format("{}: empty file, no header", source));
  std::vector<std::size_t> index;
  for (const char* col : kColumns) {
    std::size_t i = 0;
    while (i < header.size() && header[i] != col)
      ++i;
    if (i == header.size())
      throw InputError(fmt::format("{}: line {}: missing column \"{}\"", source, line_no, col));
    index.push_back(i);
  }
  std::vector<Measurement> rows;
  while (std::getline(in, line)) {
    ++line_no;
    if (trimmed(line).empty()) continue;
    const auto cells = split_commas(line);
    Measurement m;
    m.row = int(rows.size()) + 1;
    m.where = fmt::format("{}: row {} (line {})", source, m.row, line_no);
    if (cells.size() != header.size())
      throw InputError(
          fmt::format("{}: {} cells, the header has {}", m.where, cells.size(), header.size()));
    auto integer = [&](int k) {
      return parse_positive_int(cells[index[std::size_t(k)]],
                                {source, m.row, line_no, kColumns[k]});
    };
    m.gpus = int(integer(0));
    m.global_batch = integer(1);
    m.micro_batch = integer(2);
    m.hidden = integer(3);
    m.heads = integer(4);
    m.layers = integer(5);
    m.seq_len = integer(6);
    m.t = int(integer(7));
    m.w = int(integer(8));
    m.d = int(integer(9));
    m.iteration_time_s = parse_time_ms(cells[index[10]], {source, m.row, line_no, kColTime}) / 1e3;
    check_row(m, kColGpus, kColGlobal);
    rows.push_back(m);
  }
  if (rows.empty())
    throw InputError(fmt::format("{}: no measurement rows after the header", source));
  return rows;
}

std::vector<Measurement> parse_measurements_json(const std::string& text,
                                                 const std::string& source) {
  const common::Json doc = common::parse_json(text, source);
  common::JsonReader root(doc, source);
  root.expect_format("pipewright.measurements/1");
  const common::JsonReader list = root.at("measurements");
  if (!list.value().is_array()) list.fail("expected an array of measurements");
  if (list.size() == 0) list.fail("no measurements");
  std::vector<Measurement> rows;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const common::JsonReader r = list.at(i);
    Measurement m;
    m.row = int(i) + 1;
    m.where = fmt::format("{}: {}", source, r.path());
    auto integer = [&](const char* key) {
      const std::int64_t v = r.get_positive_int(key);
      if (v > 1'000'000'000) r.fail_member(key, fmt::format("{} is too large", v));
      return v;
    };
    m.gpus = int(integer("gpus"));
    m.global_batch = integer("global_batch");
    m.micro_batch = integer("micro_batch");
    m.hidden = integer("hidden");
    m.heads = integer("heads");
    m.layers = integer("layers");
    m.seq_len = integer("seq_len");
    m.t = int(integer("t"));
    m.w = int(integer("w"));
    m.d = int(integer("d"));
    m.iteration_time_s = r.get_positive("iteration_time_ms") / 1e3;
    if (r.has("ffn")) m.ffn = integer("ffn");
    if (r.has("vocab")) m.vocab = integer("vocab");
    if (r.has("vocab_multiple")) m.vocab_multiple = integer("vocab_multiple");
    if (r.has("dtype")) m.dtype = r.get_string("dtype");
    if (r.has("attention")) m.attention = r.get_string("attention");
    if (r.has("dropout")) m.dropout = r.get_bool("dropout");
    check_row(m, "gpus", "global_batch");
    rows.push_back(m);
  }
  return rows;
}

std::vector<Measurement> read_measurements(const std::string& path) {
  const std::string text = read_limited(path);
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) throw InputError(fmt::format("{}: empty file", path));
  if (text[first] == '{') return parse_measurements_json(text, path);
  return parse_measurements_csv(text, path);
}

}  // namespace pw::calibrate
