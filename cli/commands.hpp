// Each subcommand registers itself on the root app; its callback throws pw::Error on bad input.
#pragma once

#include <CLI/CLI.hpp>

namespace pw::cli {

void add_models_command(CLI::App& app);
void add_clusters_command(CLI::App& app);
void add_trace_command(CLI::App& app);
void add_schedule_command(CLI::App& app);
void add_estimate_command(CLI::App& app);
void add_simulate_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_profile_command(CLI::App& app);
void add_sweep_command(CLI::App& app);
void add_validate_command(CLI::App& app);
void add_calibrate_command(CLI::App& app);

}  // namespace pw::cli
