// `pipewright calibrate`: fits the analytic device model's efficiency parameters to measured
// iteration times (and, with --allreduce, the intra-node link to nccl-tests all-reduce times),
// prints in-sample and cross-validated errors, writes the calibrated device preset.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <numeric>

#include <fmt/format.h>

#include "calibrate/collectives.hpp"
#include "calibrate/fit.hpp"
#include "cli/commands.hpp"
#include "cli/options.hpp"

namespace pw::cli {

namespace {

struct CalibrateArgs {
  std::string measurements;
  ClusterOptions cluster;
  std::string out;
  std::string residuals;
  std::string name;
  std::vector<std::string> allreduce;
  std::string cluster_out;
  std::string note;
  int folds = 5;
  bool skip_unsupported = false;
  bool blend_floor = false;
};

// The rows the model can predict; the others are an error naming the row or, with
// --skip-unsupported, counted by reason.
calibrate::FitData prepare(const std::vector<calibrate::Measurement>& rows,
                           const clusters::Cluster& cluster, bool skip_unsupported) {
  calibrate::FitData data;
  std::map<std::string, int> skipped;
  for (const auto& m : rows) {
    try {
      calibrate::RowSetup row = calibrate::setup_row(m, cluster);
      calibrate::predict_s(row, cluster.device);  // throws when the row is unsupported
      data.rows.push_back(std::move(row));
      data.measured_s.push_back(m.iteration_time_s);
      data.file_rows.push_back(m.row);
    } catch (const Error& e) {
      if (!skip_unsupported)
        throw InputError(fmt::format("{}: cannot predict: {} (--skip-unsupported skips such rows)",
                                     m.where, e.what()));
      ++skipped[e.what()];
    }
  }
  for (const auto& [reason, count] : skipped)
    fmt::print("skipped {} row{}: {}\n", count, count == 1 ? "" : "s", reason);
  if (data.rows.size() < 7)
    throw InputError(
        fmt::format("calibrate: {} predictable rows cannot fit 7 parameters", data.rows.size()));
  return data;
}

void print_parameters(const clusters::DeviceEfficiency& e) {
  fmt::print(
      "  gemm_max {:.4f}  gemm_half_dim {:.1f}  attention {:.4f}  elementwise {:.4f}  optimizer "
      "{:.4f}  layer_overhead_s {:.3e}  overhead_exponent {:.3f}\n",
      e.gemm_max, e.gemm_half_dim, e.attention, e.elementwise, e.optimizer, e.layer_overhead_s,
      e.overhead_exponent);
}

void print_worst(const std::vector<calibrate::Measurement>& rows, const calibrate::FitData& data,
                 const std::vector<double>& predicted) {
  const auto errors = calibrate::relative_errors(predicted, data.measured_s);
  std::vector<std::size_t> order(errors.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::abs(errors[a]) > std::abs(errors[b]);
  });
  fmt::print(
      "  worst rows:\n  {:>5} {:>4} {:>3} {:>3} {:>3} {:>3} {:>6} {:>6} {:>3} {:>11} {:>11} "
      "{:>7}\n",
      "row", "GPUs", "t", "w", "d", "b", "B", "hidden", "L", "measured", "predicted", "error");
  for (std::size_t k = 0; k < std::min<std::size_t>(5, order.size()); ++k) {
    const std::size_t i = order[k];
    const auto& m = rows[std::size_t(data.file_rows[i] - 1)];
    fmt::print("  {:>5} {:>4} {:>3} {:>3} {:>3} {:>3} {:>6} {:>6} {:>3} {:>11} {:>11} {:>+6.1f}%\n",
               m.row, m.gpus, m.t, m.w, m.d, m.micro_batch, m.global_batch, m.hidden, m.layers,
               human_seconds(data.measured_s[i]), human_seconds(predicted[i]), 100 * errors[i]);
  }
}

std::string residuals_csv(const std::vector<calibrate::Measurement>& rows,
                          const calibrate::FitData& data, const std::vector<double>& predicted,
                          const std::vector<double>& cv_predicted, int folds) {
  std::string out =
      "row,gpus,global_batch,micro_batch,hidden,heads,layers,seq_len,t,w,d,measured_s,"
      "predicted_s,error,fold,cv_predicted_s,cv_error\n";
  for (std::size_t i = 0; i < data.rows.size(); ++i) {
    const auto& m = rows[std::size_t(data.file_rows[i] - 1)];
    out += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{:.9g},{:.9g},{:.6f},{},{:.9g},{:.6f}\n",
                       m.row, m.gpus, m.global_batch, m.micro_batch, m.hidden, m.heads, m.layers,
                       m.seq_len, m.t, m.w, m.d, m.iteration_time_s, predicted[i],
                       predicted[i] / m.iteration_time_s - 1, calibrate::fold_of(i, folds),
                       cv_predicted[i], cv_predicted[i] / m.iteration_time_s - 1);
  }
  return out;
}

// --allreduce: fits the intra-node link and applies it to the cluster.
void fit_collectives(const CalibrateArgs& a, clusters::Cluster& cluster) {
  std::vector<calibrate::AllReduceSample> samples;
  for (const auto& f : a.allreduce) {
    auto s = calibrate::read_allreduce_csv(f);
    samples.insert(samples.end(), s.begin(), s.end());
  }
  const auto fit = calibrate::fit_intra_node(samples, cluster.intra_node.bandwidth_bytes_per_s);
  std::vector<double> measured;
  for (const auto& s : samples)
    measured.push_back(s.time_s);
  const auto err = calibrate::relative_errors(fit.predicted_s, measured);
  fmt::print(
      "all-reduce fit ({} sizes in {} files, {}): intra_node efficiency {:.4f}, latency_s "
      "{:.3e}; mean |error| {:.1f}%, max {:.1f}%\n",
      samples.size(), a.allreduce.size(), fit.status, fit.efficiency, fit.latency_s,
      100 * calibrate::mean_abs(err), 100 * calibrate::max_abs(err));
  cluster.intra_node.efficiency = fit.efficiency;
  cluster.intra_node.latency_s = fit.latency_s;
}

std::string default_name(const std::string& device) {
  const std::string suffix = "-cal";
  if (device.size() > suffix.size() && device.ends_with(suffix)) return device;
  return device + suffix;
}

struct Rendered {
  std::string device, residuals;
};

// The device fit: default-parameter error, the fit, in-sample errors, worst rows, K-fold CV.
Rendered fit_measurements(const CalibrateArgs& a, const clusters::Cluster& cluster) {
  const auto rows = calibrate::read_measurements(a.measurements);
  const calibrate::FitData data = prepare(rows, cluster, a.skip_unsupported);
  clusters::DeviceSpec base = cluster.device;
  base.efficiency = {};  // every fit starts from the uncalibrated model
  const auto before =
      calibrate::relative_errors(calibrate::predict_all(data, base), data.measured_s);
  fmt::print("{} of {} rows of {} on {} ({} x {}); default parameters: mean |error| {:.2f}%\n",
             data.rows.size(), rows.size(), a.measurements, cluster.name, cluster.gpus_per_node,
             cluster.device.name, 100 * calibrate::mean_abs(before));
  clusters::DeviceEfficiency start;  // the defaults; --blend-floor fits the exponent from 3
  if (a.blend_floor) start.overhead_exponent = 3;
  const calibrate::DeviceFit fit = calibrate::fit_device(data, base, start);
  const auto err = calibrate::relative_errors(fit.predicted_s, data.measured_s);
  fmt::print("fit ({} iterations, {}):\n", fit.iterations, fit.status);
  print_parameters(fit.efficiency);
  fmt::print("  in-sample: mean |error| {:.2f}%, max {:.2f}%\n", 100 * calibrate::mean_abs(err),
             100 * calibrate::max_abs(err));
  print_worst(rows, data, fit.predicted_s);
  const auto cv = calibrate::cross_validate(data, base, a.folds, start);
  const auto cv_err = calibrate::relative_errors(cv.predicted_s, data.measured_s);
  fmt::print("  {}-fold cross-validation: mean |error| {:.2f}%, max {:.2f}%\n", a.folds,
             100 * calibrate::mean_abs(cv_err), 100 * calibrate::max_abs(cv_err));
  clusters::DeviceSpec device = base;
  device.name = a.name.empty() ? default_name(base.name) : a.name;
  device.efficiency = fit.efficiency;
  const std::string peaks_of =
      device.name.ends_with("-cal") ? device.name.substr(0, device.name.size() - 4) : base.name;
  device.notes = fmt::format(
      "The peaks and capacity of {} with the analytic model's efficiency parameters fitted by "
      "pipewright calibrate to {} of {} measured runs in {} on cluster {} ({} rows skipped as "
      "unsupported): in-sample mean |error| {:.2f}%, {}-fold cross-validated {:.2f}%.{}",
      peaks_of, data.rows.size(), rows.size(),
      std::filesystem::path(a.measurements).filename().string(), cluster.name,
      rows.size() - data.rows.size(), 100 * calibrate::mean_abs(err), a.folds,
      100 * calibrate::mean_abs(cv_err), a.note.empty() ? "" : " " + a.note);
  return {clusters::to_json(device).dump(2) + "\n",
          residuals_csv(rows, data, fit.predicted_s, cv.predicted_s, a.folds)};
}

// Writes every non-empty (path, text) atomically; on a failure removes those already written.
void write_all(const std::vector<std::pair<std::string, std::string>>& files) {
  std::vector<std::string> written;
  try {
    for (const auto& [path, text] : files) {
      if (path.empty() || text.empty()) continue;
      common::write_file_atomic(path, text);
      written.push_back(path);
    }
  } catch (const Error&) {
    for (const auto& p : written)
      std::remove(p.c_str());
    throw;
  }
  for (const auto& p : written)
    fmt::print("wrote {}\n", p);
}

void run(const CalibrateArgs& a) {
  if (a.measurements.empty() && a.allreduce.empty())
    throw InputError("calibrate: give --measurements FILE and/or --allreduce FILE...");
  if (!a.measurements.empty() && a.out.empty())
    throw InputError("calibrate: --out DEVICE.json is required with --measurements");
  if (a.measurements.empty() && (!a.out.empty() || !a.residuals.empty()))
    throw InputError("calibrate: --out and --residuals need --measurements");
  clusters::Cluster cluster = a.cluster.load();
  if (!a.allreduce.empty()) fit_collectives(a, cluster);
  Rendered r;
  if (!a.measurements.empty()) r = fit_measurements(a, cluster);
  const std::string cluster_text =
      a.cluster_out.empty() ? "" : clusters::to_json(cluster).dump(2) + "\n";
  write_all({{a.out, r.device}, {a.residuals, r.residuals}, {a.cluster_out, cluster_text}});
}

}  // namespace

void add_calibrate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "calibrate",
      "fit the analytic device model to measured iteration times; write a calibrated device");
  auto a = std::make_shared<CalibrateArgs>();
  cmd->add_option("--measurements", a->measurements,
                  "measured runs: CSV with vTrain's columns or pipewright.measurements/1 JSON");
  a->cluster.add(*cmd, "vtrain-a100");
  cmd->add_option("--out,-o", a->out, "write the calibrated device (pipewright.device/1) here");
  cmd->add_option("--folds", a->folds, "K for K-fold cross-validation (row i is in fold i mod K)")
      ->capture_default_str();
  cmd->add_option("--residuals", a->residuals,
                  "write each row's measured, fitted and cross-validated times here (CSV)");
  cmd->add_flag("--blend-floor", a->blend_floor,
                "also fit overhead_exponent: the launch floor blends with GPU time as a p-norm "
                "instead of a max (docs/formulas.md section 6)");
  cmd->add_flag("--skip-unsupported", a->skip_unsupported,
                "skip (and count) rows the model cannot predict instead of failing");
  cmd->add_option("--name", a->name,
                  "name of the written device (default: the cluster's "
                  "device name + \"-cal\")");
  cmd->add_option("--note", a->note, "a sentence appended to the written device's notes");
  cmd->add_option("--allreduce", a->allreduce,
                  "nccl-tests all-reduce CSVs (allreduce_<N>gpu.csv): fit the cluster's "
                  "intra_node efficiency and latency first")
      ->expected(1, -1);
  cmd->add_option("--cluster-out", a->cluster_out,
                  "write the cluster with the fitted intra_node (pipewright.cluster/1) here");
  cmd->callback([a] { run(*a); });
}

}  // namespace pw::cli
