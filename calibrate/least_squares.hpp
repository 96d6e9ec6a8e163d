// Nonlinear least squares: GSL's trust-region Levenberg-Marquardt (gsl_multifit_nlinear) over
// unconstrained variables, with a finite-difference Jacobian. Callers keep parameters in range by
// fitting transformed variables (see fit.cpp).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace pw::calibrate {

// Fills r (n residuals) for the variables x. May throw; the exception leaves solve().
using ResidualFn = std::function<void(const std::vector<double>& x, std::vector<double>& r)>;

struct LeastSquaresResult {
  std::vector<double> x;
  double cost = 0;  // 1/2 sum r_i^2 at x
  std::size_t iterations = 0;
  std::string status;  // "converged (small step)", "stopped: 200 iterations", ...
};

// Minimizes 1/2 sum r_i(x)^2 from x0. Throws InputError when n < x0.size().
LeastSquaresResult solve_least_squares(const ResidualFn& residuals, std::size_t n,
                                       std::vector<double> x0, std::size_t max_iterations = 200);

}  // namespace pw::calibrate
