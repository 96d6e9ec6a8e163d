// The measured run report of a CPU training run ("source": "measured"), shared by train and
// validate.
#pragma once

#include "cli/backend.hpp"
#include "exec/runtime.hpp"
#include "models/model.hpp"
#include "planner/plan.hpp"
#include "planner/report.hpp"

namespace pw::cli {

// Steady state: iteration_time_s is the mean step after the first (which includes the pipeline's
// warm-up); busy_s is each rank's compute over the run / steps. Adds "losses", "step_times_s",
// "backend", "device" (GPU) and "first_step" to extra; cluster and MFU from `on` (MFU 0 where its
// peak is unknown, e.g. the CPU).
// The line train and validate print per step: step, loss, ms, tokens/s (and the checkpoint saved).
void print_step(const exec::StepLog& s);

planner::RunReport measured_report(const models::ModelSpec& model, const planner::Plan& plan,
                                   const exec::TrainResult& r, const MeasuredOn& on = {});

}  // namespace pw::cli
