// nccl-tests all-reduce tables and the two-parameter fit of the intra-node link.
#include "calibrate/collectives.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

#include <fmt/format.h>

#include "calibrate/least_squares.hpp"
#include "planner/cost_model.hpp"

namespace pw::calibrate {

namespace {

std::vector<std::string> cells_of(const std::string& line) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (true) {
    const std::size_t end = line.find(',', pos);
    std::string c = line.substr(pos, end == std::string::npos ? end : end - pos);
    while (!c.empty() && (c.back() == '\r' || c.back() == ' '))
      c.pop_back();
    out.push_back(c);
    if (end == std::string::npos) return out;
    pos = end + 1;
  }
}

double positive_number(const std::string& text, const std::string& where) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size() || !std::isfinite(v) || v <= 0)
    throw InputError(fmt::format("{}: \"{}\" is not a positive number", where, text));
  return v;
}

}  // namespace

std::vector<AllReduceSample> read_allreduce_csv(const std::string& path) {
  std::smatch match;
  const std::string name = std::filesystem::path(path).filename().string();
  static const std::regex gpus_re("([0-9]+)gpu");
  if (!std::regex_search(name, match, gpus_re) || match[1].length() > 4 || std::stoi(match[1]) < 2)
    throw InputError(fmt::format(
        "{}: the file name must say the GPU count (>= 2), as in allreduce_8gpu.csv", path));
  const int gpus = std::stoi(match[1]);
  std::ifstream in(path);
  if (!in) throw InputError(fmt::format("{}: cannot open", path));
  std::string line;
  if (!std::getline(in, line)) throw InputError(fmt::format("{}: empty file", path));
  const auto header = cells_of(line);
  std::size_t size_col = header.size(), time_col = header.size();
  for (std::size_t i = header.size(); i-- > 0;) {
    if (header[i] == "size(B)") size_col = i;
    if (header[i] == "time(ns)") time_col = i;  // the first one: out of place
  }
  if (size_col == header.size() || time_col == header.size())
    throw InputError(fmt::format("{}: line 1: missing column \"size(B)\" or \"time(ns)\"", path));
  std::vector<AllReduceSample> out;
  for (int line_no = 2; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \r") == std::string::npos) continue;
    const auto cells = cells_of(line);
    const std::string where = fmt::format("{}: line {}", path, line_no);
    if (cells.size() != header.size())
      throw InputError(
          fmt::format("{}: {} cells, the header has {}", where, cells.size(), header.size()));
    out.push_back({gpus, positive_number(cells[size_col], where + ", column \"size(B)\""),
                   positive_number(cells[time_col], where + ", column \"time(ns)\"") * 1e-9});
  }
  if (out.empty()) throw InputError(fmt::format("{}: no measurement rows", path));
  return out;
}

CollectiveFit fit_intra_node(const std::vector<AllReduceSample>& samples,
                             double bandwidth_bytes_per_s) {
  if (!(bandwidth_bytes_per_s > 0))
    throw InputError("all-reduce fit: the cluster's intra_node bandwidth must be positive");
  // Variables: efficiency = logistic(x0), latency_s = 1e-6 s * exp(x1).
  auto link = [&](const std::vector<double>& x) {
    clusters::Link l;
    l.bandwidth_bytes_per_s = bandwidth_bytes_per_s / (1 + std::exp(-x[0]));
    l.latency_s = 1e-6 * std::exp(x[1]);
    l.via = "intra-node";
    return l;
  };
  auto predict = [&](const AllReduceSample& s, const clusters::Link& l) {
    return planner::ring_allreduce_s(s.bytes, s.gpus, l);
  };
  const ResidualFn residuals = [&](const std::vector<double>& x, std::vector<double>& r) {
    const clusters::Link l = link(x);
    for (std::size_t i = 0; i < samples.size(); ++i)
      r[i] = std::log(predict(samples[i], l) / samples[i].time_s);
  };
  const LeastSquaresResult ls = solve_least_squares(residuals, samples.size(), {1.0, 1.0});
  CollectiveFit fit;
  const clusters::Link l = link(ls.x);
  fit.efficiency = l.bandwidth_bytes_per_s / bandwidth_bytes_per_s;
  fit.latency_s = l.latency_s;
  for (const auto& s : samples)
    fit.predicted_s.push_back(predict(s, l));
  fit.status = ls.status;
  return fit;
}

}  // namespace pw::calibrate
