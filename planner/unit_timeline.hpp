// Unit-time timeline: a deterministic timed run of schedule programs, bubble figures, and the
// ASCII timeline and program listings that `pipewright schedule` prints.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "planner/program.hpp"

namespace pw::planner {

// Duration of each op kind in abstract time units. With chunk_scale, a compute op of an
// interleaved plan takes 1/v of the figure (a chunk is 1/v of a stage).
struct Durations {
  double forward = 1;
  double backward = 2;
  double recompute = 1;
  double comm = 0;  // each send and receive
  double all_reduce = 0;
  double optimizer = 0;
  double free_version = 0;
  bool chunk_scale = true;
};

using DurationFn = std::function<double(const Program& device, const Op& op)>;
DurationFn duration_fn(const Plan& plan, const Durations& durations);

struct OpTime {
  double start = 0;
  double end = 0;
};

// One stream per device: ops run in program order, an op starts when the previous one ends, a
// receive no earlier than its send's end, an all_reduce when every replica has reached it.
struct Timeline {
  std::vector<std::vector<OpTime>> ops;  // [rank][op index]
  std::vector<double> busy;              // per rank: summed durations of its ops
  double makespan = 0;
};

// Throws ScheduleError when the programs cannot run (see execute()).
Timeline run_timeline(const Programs& programs, const DurationFn& duration);
Timeline run_unit_timeline(const Programs& programs, const Durations& durations = {});

// End times of a device's optimizer steps, in step order.
std::vector<double> optimizer_times(const Programs& programs, const Timeline& timeline, int rank);

// Window of one optimizer step: from the first op of the step on any device to the last.
// compute is the most busy time any device spends on the step's ops; bubble = time - compute.
struct StepTiming {
  double start = 0;
  double end = 0;
  double time = 0;
  double compute = 0;
  double bubble = 0;
  double fraction() const { return time > 0 ? bubble / time : 0; }        // bubble / step time
  double overhead() const { return compute > 0 ? bubble / compute : 0; }  // bubble / ideal time
};
StepTiming step_timing(const Programs& programs, const Timeline& timeline, int step);

// Idle share of one step's time: (d-1)/(m+d-1) for gpipe and 1f1b with uniform stages.
double bubble_fraction(const Programs& programs, const Timeline& timeline, int step);

struct RenderOptions {
  int max_columns = 0;     // > 0: fit the rows into this width (labels may be cut); 0: no limit
  bool show_comm = false;  // draw sends, receives, all-reduces and optimizer steps that take time
};

// One row per device: each compute op drawn as its label ("F3", "B3", "R3", "F3.1") followed by
// '-' over its span, idle time as ' ' with a '.' at each time unit.
std::string render_timeline(const Programs& programs, const Timeline& timeline,
                            const RenderOptions& options = {});

// Each device's op list, wrapped at `columns`; compute ops carry their weight version ("F3@1")
// when the schedule is 2bw.
std::string print_programs(const Programs& programs, int columns = 100);

}  // namespace pw::planner
