// What the analytic model predicts for one measured run: the row's GPT model, its Megatron plan
// (1F1B, full recompute, balanced stages) placed on the row's GPUs, and the closed-form estimate.
#pragma once

#include "calibrate/measurements.hpp"
#include "clusters/cluster.hpp"
#include "models/model.hpp"
#include "planner/plan.hpp"

namespace pw::calibrate {

// A row made ready to predict: everything but the device's efficiency parameters.
struct RowSetup {
  models::ModelSpec model;
  planner::Plan plan;         // resolved and placed on `cluster`
  clusters::Cluster cluster;  // the given cluster cut to the row's GPU count
};

// vTrain's GPT: FFN 4h, vocabulary 50257 padded to a multiple of 128 t, fp16, unfused attention,
// dropout, learned positions, tied embeddings (optional fields of the row replace these).
models::ModelSpec row_model(const Measurement& m);

// Throws PlanError / InputError when the row cannot be set up (a plan the cluster cannot hold).
// The cluster keeps its node shape when the row uses whole nodes; a row on fewer GPUs than a node
// runs on one node of exactly its GPU count (place() wants every GPU used).
RowSetup setup_row(const Measurement& m, const clusters::Cluster& cluster);

// Predicted iteration time (s) with `device`'s peaks and efficiency parameters. Throws when the
// model cannot predict the row (e.g. a feature not implemented yet).
double predict_s(const RowSetup& row, const clusters::DeviceSpec& device);

}  // namespace pw::calibrate
