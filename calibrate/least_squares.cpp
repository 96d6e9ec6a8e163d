// GSL's gsl_multifit_nlinear (Levenberg-Marquardt, trust region), wrapped for C++ callbacks.
#include "calibrate/least_squares.hpp"

#include <exception>

#include <fmt/format.h>
#include <gsl/gsl_blas.h>
#include <gsl/gsl_errno.h>
#include <gsl/gsl_multifit_nlinear.h>

#include "common/error.hpp"

namespace pw::calibrate {

namespace {

struct Context {
  const ResidualFn* residuals;
  std::vector<double> x, r;
  std::exception_ptr error;
};

int gsl_residuals(const gsl_vector* x, void* data, gsl_vector* f) {
  auto* c = static_cast<Context*>(data);
  for (std::size_t i = 0; i < c->x.size(); ++i)
    c->x[i] = gsl_vector_get(x, i);
  try {
    (*c->residuals)(c->x, c->r);
  } catch (...) {
    c->error = std::current_exception();  // never unwind through GSL's C frames
    return GSL_EBADFUNC;
  }
  for (std::size_t i = 0; i < c->r.size(); ++i)
    gsl_vector_set(f, i, c->r[i]);
  return GSL_SUCCESS;
}

// GSL's workspace and vectors, freed on every path.
struct Workspace {
  gsl_multifit_nlinear_workspace* w = nullptr;
  gsl_vector* x0 = nullptr;
  ~Workspace() {
    if (w != nullptr) gsl_multifit_nlinear_free(w);
    if (x0 != nullptr) gsl_vector_free(x0);
  }
};

}  // namespace

LeastSquaresResult solve_least_squares(const ResidualFn& residuals, std::size_t n,
                                       std::vector<double> x0, std::size_t max_iterations) {
  const std::size_t p = x0.size();
  if (p == 0 || n < p)
    throw InputError(fmt::format("least squares: {} residuals cannot fit {} parameters", n, p));
  gsl_set_error_handler_off();  // GSL's default handler aborts the process
  Context ctx{&residuals, x0, std::vector<double>(n), nullptr};
  gsl_multifit_nlinear_fdf fdf;
  fdf.f = gsl_residuals;
  fdf.df = nullptr;   // forward-difference Jacobian
  fdf.fvv = nullptr;  // no geodesic acceleration
  fdf.n = n;
  fdf.p = p;
  fdf.params = &ctx;
  gsl_multifit_nlinear_parameters params = gsl_multifit_nlinear_default_parameters();
  params.trs = gsl_multifit_nlinear_trs_lm;
  params.scale = gsl_multifit_nlinear_scale_more;
  Workspace ws;
  ws.w = gsl_multifit_nlinear_alloc(gsl_multifit_nlinear_trust, &params, n, p);
  ws.x0 = gsl_vector_alloc(p);
  if (ws.w == nullptr || ws.x0 == nullptr) throw std::bad_alloc();
  for (std::size_t i = 0; i < p; ++i)
    gsl_vector_set(ws.x0, i, x0[i]);
  int status = gsl_multifit_nlinear_init(ws.x0, &fdf, ws.w);
  int info = 0;
  if (status == GSL_SUCCESS)
    status = gsl_multifit_nlinear_driver(max_iterations, 1e-10, 1e-10, 1e-12, nullptr, nullptr,
                                         &info, ws.w);
  if (ctx.error) std::rethrow_exception(ctx.error);
  LeastSquaresResult out;
  const gsl_vector* x = gsl_multifit_nlinear_position(ws.w);
  out.x.resize(p);
  for (std::size_t i = 0; i < p; ++i)
    out.x[i] = gsl_vector_get(x, i);
  double chi2 = 0;
  gsl_blas_ddot(gsl_multifit_nlinear_residual(ws.w), gsl_multifit_nlinear_residual(ws.w), &chi2);
  out.cost = chi2 / 2;
  out.iterations = gsl_multifit_nlinear_niter(ws.w);
  if (status == GSL_SUCCESS)
    out.status = info == 1 ? "converged (small step)" : "converged (small gradient)";
  else if (status == GSL_EMAXITER)
    out.status = fmt::format("stopped after {} iterations", max_iterations);
  else if (status == GSL_ENOPROG)
    out.status = "stopped: no further progress";
  else
    throw InputError(fmt::format("least squares failed: {}", gsl_strerror(status)));
  return out;
}

}  // namespace pw::calibrate
