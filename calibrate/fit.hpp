// Fitting the device model's efficiency parameters to measured runs: least squares on
// log(predicted / measured), in-sample errors and K-fold cross-validation. Formulas:
// docs/formulas.md ("Calibration").
#pragma once

#include <string>
#include <vector>

#include "calibrate/predict.hpp"
#include "clusters/device.hpp"

namespace pw::calibrate {

// Rows ready to fit, with their measured times.
struct FitData {
  std::vector<RowSetup> rows;
  std::vector<double> measured_s;
  std::vector<int> file_rows;  // each row's 1-based position in the measurements file
};

struct DeviceFit {
  clusters::DeviceEfficiency efficiency;
  std::vector<double> predicted_s;  // per row, with the fitted parameters
  std::size_t iterations = 0;
  std::string status;
};

// The fitted parameters, in order: gemm_max (logistic of its variable, in (0, 1)), gemm_half_dim,
// attention, elementwise (each exp of its variable, > 0), optimizer (logistic, in (0, 1)),
// layer_overhead_s (1e-4 s * x^2, >= 0), and overhead_exponent (1 + exp, > 1) only when `start`
// has one (> 0; otherwise the fit keeps the hard max of the launch floor). Fits from `start` (a
// zero overhead starts at 1e-4 s so its variable is not at the stationary x = 0; an optimizer of 1
// starts at 0.9). `device` supplies the peaks.
DeviceFit fit_device(const FitData& data, const clusters::DeviceSpec& device,
                     const clusters::DeviceEfficiency& start = {});

// Relative error of each prediction: predicted / measured - 1.
std::vector<double> relative_errors(const std::vector<double>& predicted_s,
                                    const std::vector<double>& measured_s);
double mean_abs(const std::vector<double>& errors);
double max_abs(const std::vector<double>& errors);

// Fold of row i (0-based) of n rows in K-fold cross-validation: i mod K (deterministic).
int fold_of(std::size_t i, int folds);

// K-fold cross-validation: each row's prediction by the fit on the other folds.
struct CrossValidation {
  std::vector<double> predicted_s;
  std::vector<clusters::DeviceEfficiency> fold_efficiency;
};
CrossValidation cross_validate(const FitData& data, const clusters::DeviceSpec& device, int folds,
                               const clusters::DeviceEfficiency& start = {});

std::vector<double> predict_all(const FitData& data, const clusters::DeviceSpec& device);

}  // namespace pw::calibrate
