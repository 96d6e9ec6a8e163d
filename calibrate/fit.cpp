// Device model calibration: transformed variables keep each parameter in range; residuals are
// log(predicted / measured), so every row weighs the same whatever its iteration time.
#include "calibrate/fit.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "calibrate/least_squares.hpp"

namespace pw::calibrate {

namespace {

constexpr double kOverheadScale_s = 1e-4;

double logit(double p) {
  p = std::clamp(p, 1e-6, 1 - 1e-6);
  return std::log(p / (1 - p));
}

double logistic(double x) {
  return 1 / (1 + std::exp(-x));
}

// gemm_max and optimizer are fractions of a peak: in (0, 1). The optimizer starts from 0.9, not
// its default 1, where the logistic has no finite preimage.
std::vector<double> to_variables(const clusters::DeviceEfficiency& e) {
  const double overhead = e.layer_overhead_s > 0 ? e.layer_overhead_s : kOverheadScale_s;
  std::vector<double> x = {logit(e.gemm_max),
                           std::log(std::max(e.gemm_half_dim, 1e-3)),
                           std::log(e.attention),
                           std::log(e.elementwise),
                           logit(std::min(e.optimizer, 0.9)),
                           std::sqrt(overhead / kOverheadScale_s)};
  // The floor blend's exponent is fitted only when the start has one (p = 1 + e^x6 > 1); a start
  // of 0 keeps the hard max(g, o) and six variables.
  if (e.overhead_exponent > 0) x.push_back(std::log(std::max(e.overhead_exponent - 1, 1e-6)));
  return x;
}

clusters::DeviceEfficiency from_variables(const std::vector<double>& x) {
  clusters::DeviceEfficiency e;
  e.gemm_max = logistic(x[0]);
  e.gemm_half_dim = std::exp(x[1]);
  e.attention = std::exp(x[2]);
  e.elementwise = std::exp(x[3]);
  e.optimizer = logistic(x[4]);
  e.layer_overhead_s = kOverheadScale_s * x[5] * x[5];
  if (x.size() > 6) e.overhead_exponent = 1 + std::exp(x[6]);
  return e;
}

clusters::DeviceSpec with_efficiency(clusters::DeviceSpec d, const clusters::DeviceEfficiency& e) {
  d.efficiency = e;
  return d;
}

FitData subset(const FitData& data, int folds, int fold, bool in_fold) {
  FitData out;
  for (std::size_t i = 0; i < data.rows.size(); ++i) {
    if ((fold_of(i, folds) == fold) != in_fold) continue;
    out.rows.push_back(data.rows[i]);
    out.measured_s.push_back(data.measured_s[i]);
    out.file_rows.push_back(data.file_rows[i]);
  }
  return out;
}

}  // namespace

std::vector<double> predict_all(const FitData& data, const clusters::DeviceSpec& device) {
  std::vector<double> out;
  out.reserve(data.rows.size());
  for (const auto& row : data.rows)
    out.push_back(predict_s(row, device));
  return out;
}

DeviceFit fit_device(const FitData& data, const clusters::DeviceSpec& device,
                     const clusters::DeviceEfficiency& start) {
  const ResidualFn residuals = [&](const std::vector<double>& x, std::vector<double>& r) {
    const clusters::DeviceSpec d = with_efficiency(device, from_variables(x));
    for (std::size_t i = 0; i < data.rows.size(); ++i) {
      const double predicted = predict_s(data.rows[i], d);
      // A non-finite prediction (a parameter driven to an extreme) is a very bad fit, not an
      // error: a large residual turns the step back.
      r[i] = std::isfinite(predicted) && predicted > 0 ? std::log(predicted / data.measured_s[i])
                                                       : 1e3;
    }
  };
  const LeastSquaresResult ls =
      solve_least_squares(residuals, data.rows.size(), to_variables(start));
  DeviceFit fit;
  fit.efficiency = from_variables(ls.x);
  fit.predicted_s = predict_all(data, with_efficiency(device, fit.efficiency));
  fit.iterations = ls.iterations;
  fit.status = ls.status;
  return fit;
}

std::vector<double> relative_errors(const std::vector<double>& predicted_s,
                                    const std::vector<double>& measured_s) {
  std::vector<double> out;
  for (std::size_t i = 0; i < predicted_s.size(); ++i)
    out.push_back(predicted_s[i] / measured_s[i] - 1);
  return out;
}

double mean_abs(const std::vector<double>& errors) {
  double sum = 0;
  for (double e : errors)
    sum += std::abs(e);
  return errors.empty() ? 0 : sum / double(errors.size());
}

double max_abs(const std::vector<double>& errors) {
  double m = 0;
  for (double e : errors)
    m = std::max(m, std::abs(e));
  return m;
}

int fold_of(std::size_t i, int folds) {
  return int(i % std::size_t(folds));
}

CrossValidation cross_validate(const FitData& data, const clusters::DeviceSpec& device, int folds,
                               const clusters::DeviceEfficiency& start) {
  if (folds < 2 || std::size_t(folds) > data.rows.size())
    throw InputError(fmt::format("--folds: {} folds need 2 <= K <= {} (the rows fitted)", folds,
                                 data.rows.size()));
  CrossValidation cv;
  cv.predicted_s.assign(data.rows.size(), 0);
  for (int k = 0; k < folds; ++k) {
    const DeviceFit fit = fit_device(subset(data, folds, k, false), device, start);
    cv.fold_efficiency.push_back(fit.efficiency);
    const clusters::DeviceSpec d = with_efficiency(device, fit.efficiency);
    for (std::size_t i = 0; i < data.rows.size(); ++i)
      if (fold_of(i, folds) == k) cv.predicted_s[i] = predict_s(data.rows[i], d);
  }
  return cv;
}

}  // namespace pw::calibrate
