// pipewright: plan, simulate and run pipeline-parallel training. Only this layer prints errors
// and chooses exit codes: one line on stderr; exit 0 on success, 1 for bad input or a failed run,
// 2 for usage errors (what CLI11 refuses: an unknown option, a missing or malformed value, a
// value outside the flag's range), 3 only for a bug ("internal error").
#include <cstdio>
#include <exception>
#include <new>

#include <fmt/format.h>

#include "cli/backend.hpp"
#include "cli/commands.hpp"
#include "common/error.hpp"
#include "common/limits.hpp"

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
    // Names and values end up in JSON output, which must be UTF-8: refuse other bytes here, once.
    for (int i = 1; i < argc; ++i)
      if (!pw::common::is_utf8(argv[i]))
        throw pw::InputError(fmt::format("command-line argument {} is not valid UTF-8", i));
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with code 0; every other is a usage error: exit 2 (not
    // CLI11's own codes 100+).
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    fmt::print(stderr, "pipewright: error: out of memory (the input's sizes are too large)\n");
    pw::cli::abort_job_if_mpi(1);
    return 1;
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
