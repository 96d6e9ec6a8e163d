// pipewright: plan, simulate and run pipeline-parallel training. Only this layer prints errors
// and chooses exit codes: one line on stderr, exit 1 for bad input, 2 for usage errors.
#include <cstdio>
#include <exception>

#include <fmt/format.h>

#include "cli/backend.hpp"
#include "cli/commands.hpp"
#include "common/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"pipewright: plan, simulate and run memory-efficient pipeline-parallel training",
               "pipewright"};
  app.set_version_flag("--version", std::string("pipewright ") + PW_VERSION);
  app.require_subcommand(1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return fmt::format("pipewright: {} (see --help)\n", e.what());
  });
  pw::cli::add_models_command(app);
  pw::cli::add_clusters_command(app);
  pw::cli::add_trace_command(app);
  pw::cli::add_schedule_command(app);
  pw::cli::add_estimate_command(app);
  pw::cli::add_simulate_command(app);
  pw::cli::add_plan_command(app);
  pw::cli::add_train_command(app);
  pw::cli::add_profile_command(app);
  pw::cli::add_sweep_command(app);
  pw::cli::add_validate_command(app);
  pw::cli::add_calibrate_command(app);
  try {
    pw::cli::start_mpi_if_launched(&argc, &argv);  // before any thread starts
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const pw::Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "pipewright: error: {}\n", e.what());
    pw::cli::abort_job_if_mpi(1);
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "pipewright: internal error: {}\n", e.what());
    pw::cli::abort_job_if_mpi(3);
    return 3;
  }
  return 0;
}
