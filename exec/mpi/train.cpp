// train_cpu_mpi: one CPU rank per process over MpiTransport; the step logs and results an mpirun
// job gathers (exec/mpi/train.hpp).
#include "exec/mpi/train.hpp"

#include <csignal>
#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "exec/mpi/transport.hpp"
#include "exec/worker.hpp"

namespace pw::exec {

namespace detail {

void merge_logs(StepBook& book, const MpiSession& mpi) {
  const std::size_t n = book.logs.size();
  std::vector<double> loss(n), end(n);
  double t = 0;
  for (std::size_t i = 0; i < n; ++i) {
    loss[i] = book.loss_sum[i];
    end[i] = (t += book.logs[i].seconds);
  }
  // Each step's loss is a sum of floats in doubles, exact in any order: the same as one process's.
  mpi.all_reduce(loss.data(), int(n));
  mpi.all_reduce(end.data(), int(n), true);
  std::vector<StepLog> logs;
  book.last_end_s = 0;
  for (std::size_t i = 0; i < n; ++i) {
    logs.push_back(book.make_log(book.logs[i].step, loss[i], end[i]));
    logs.back().checkpoint = book.logs[i].checkpoint;
  }
  book.logs = logs;
}

void gather_ranks(TrainResult& result, const MpiSession& mpi, bool timelines) {
  constexpr int kFields = 16;
  const RankResult& mine = result.ranks.front();
  const planner::MemoryBreakdown& m = mine.memory;
  const double local[kFields] = {double(mine.peak_memory_bytes),
                                 double(m.weights),
                                 double(m.weight_versions),
                                 double(m.gradients),
                                 double(m.optimizer),
                                 double(m.activations),
                                 double(m.workspace),
                                 mine.busy_s,
                                 double(mine.host_peak_memory_bytes),
                                 double(mine.copy_out_bytes),
                                 double(mine.copy_in_bytes),
                                 double(mine.activation_out_bytes),
                                 double(mine.activation_in_bytes),
                                 double(mine.edge_copy_out_bytes),
                                 double(mine.edge_copy_in_bytes),
                                 double(mine.edge_steps)};
  std::vector<double> all(std::size_t(kFields * mpi.size()));
  mpi.all_gather(local, int(sizeof(local)), all.data());
  std::vector<std::string> lines;
  if (timelines) {
    const planner::RankTimeline& tl = mine.timeline;
    common::Json ops = common::Json::array(), memory = common::Json::array();
    for (const planner::TimedOp& op : tl.ops)
      ops.push_back({op.stream, op.start_s, op.end_s, op.op});
    for (const auto& [time, bytes] : tl.memory)
      memory.push_back({time, bytes});
    lines =
        mpi.gather(common::Json{{"label", tl.label}, {"ops", ops}, {"memory", memory}}.dump(), 0);
  }
  std::vector<RankResult> ranks(std::size_t(mpi.size()));
  for (int r = 0; r < mpi.size(); ++r) {
    const double* f = all.data() + std::size_t(kFields * r);
    RankResult& out = ranks[std::size_t(r)];
    if (r == mine.rank) out = mine;
    out.rank = r;
    out.peak_memory_bytes = std::int64_t(f[0]);
    out.memory.weights = std::int64_t(f[1]);
    out.memory.weight_versions = std::int64_t(f[2]);
    out.memory.gradients = std::int64_t(f[3]);
    out.memory.optimizer = std::int64_t(f[4]);
    out.memory.activations = std::int64_t(f[5]);
    out.memory.workspace = std::int64_t(f[6]);
    out.busy_s = f[7];
    out.host_peak_memory_bytes = std::int64_t(f[8]);
    out.copy_out_bytes = std::int64_t(f[9]);
    out.copy_in_bytes = std::int64_t(f[10]);
    out.activation_out_bytes = std::int64_t(f[11]);
    out.activation_in_bytes = std::int64_t(f[12]);
    out.edge_copy_out_bytes = std::int64_t(f[13]);
    out.edge_copy_in_bytes = std::int64_t(f[14]);
    out.edge_steps = int(f[15]);
    if (r != mine.rank && std::size_t(r) < lines.size()) {
      const common::Json j = common::Json::parse(lines[std::size_t(r)]);
      out.timeline.rank = r;
      out.timeline.label = j.at("label").get<std::string>();
      for (const auto& op : j.at("ops"))
        out.timeline.ops.push_back(
            {op[0].get<int>(), op[1].get<double>(), op[2].get<double>(), op[3].get<int>()});
      for (const auto& s : j.at("memory"))
        out.timeline.memory.emplace_back(s[0].get<double>(), s[1].get<std::int64_t>());
    }
  }
  result.ranks = std::move(ranks);
}

}  // namespace detail

#if PW_HAVE_MPI

namespace {

// A test's fault injection (not a user option): PW_TEST_FAULT="RANK:OP:kill" makes rank RANK kill
// itself (SIGKILL) before op OP of its program, "RANK:OP:hang" makes it stop answering.
std::function<void(int, int)> fault_from_env() {
  const char* s = std::getenv("PW_TEST_FAULT");
  if (!s || !*s) return {};
  int rank = -1, op = -1;
  char action[8] = {};
  if (std::sscanf(s, "%d:%d:%7s", &rank, &op, action) != 3 ||
      (std::string(action) != "kill" && std::string(action) != "hang"))
    throw InputError(fmt::format("PW_TEST_FAULT=\"{}\": expected RANK:OP:kill or RANK:OP:hang", s));
  const bool kill = std::string(action) == "kill";
  return [=](int r, int o) {
    if (r != rank || o != op) return;
    if (kill) std::raise(SIGKILL);
    for (;;)
      std::this_thread::sleep_for(std::chrono::seconds(1));
  };
}

}  // namespace

TrainResult train_cpu_mpi(const models::ModelSpec& model, const planner::Plan& plan,
                          const TrainOptions& options,
                          const std::function<void(const StepLog&)>& on_step, const MpiSession& mpi,
                          const MpiRunOptions& run) {
  detail::check_cpu_model(model);
  // One process per device: t per pipeline rank (device = rank * t + TP index).
  check_world_size(mpi.size(), plan.ranks() * plan.t,
                   fmt::format("{} {}w={} d={}", planner::to_string(plan.schedule),
                               plan.t > 1 ? fmt::format("t={} ", plan.t) : "", plan.w, plan.d));
  const detail::PreparedRun prepared = detail::prepare_run(model, plan, options, "cpu");
  const TokenSource data(options.data, model.vocab, options.seed);
  MpiTransport transport(mpi.rank(), run.timeout_s);
  detail::Shared shared;
  shared.transport = &transport;
  shared.runs_on = "process";
  shared.before_op = fault_from_env();
  shared.init(model, prepared, options, data, 1);
  shared.devices = std::vector<MemoryCounter>(std::size_t(plan.ranks() * plan.t));
  shared.devices[std::size_t(mpi.rank())].set_budget(options.device_memory,
                                                     fmt::format("rank {}", mpi.rank()));
  // Rank 0 writes a checkpoint's manifest once every process wrote its shard.
  shared.write_manifests = mpi.rank() == 0;
  shared.before_manifest = [&] { transport.barrier("checkpoint barrier"); };
  detail::Worker worker(shared, mpi.rank());
  transport.barrier("start barrier");
  // --mpi-progress: messages move while the rank computes (transport.hpp, "Progress"); otherwise
  // only in the rank's own transport calls.
  if (options.mpi_progress && !transport.start_progress(mpi.thread_level()))
    throw Error("--mpi-progress: this MPI library gives no MPI_THREAD_SERIALIZED");
  shared.start = detail::Clock::now();
  worker.run();
  transport.flush();
  TrainResult result;
  result.first_step = prepared.first_step;
  result.programs = prepared.programs;
  result.wall_s = std::chrono::duration<double>(detail::Clock::now() - shared.start).count();
  result.ranks.push_back(worker.result());
  transport.barrier("end barrier");  // every rank done: the collectives below cannot hang
  transport.stop_progress();         // the session's own MPI calls below
  detail::merge_logs(shared, mpi);
  detail::gather_ranks(result, mpi, true);
  if (mpi.rank() == 0 && on_step)
    for (const StepLog& log : shared.logs)
      on_step(log);
  result.steps = shared.logs;
  return result;
}

#else

TrainResult train_cpu_mpi(const models::ModelSpec&, const planner::Plan&, const TrainOptions&,
                          const std::function<void(const StepLog&)>&, const MpiSession&,
                          const MpiRunOptions&) {
  throw Error("this pipewright was built without MPI: install libopenmpi-dev and rebuild");
}

#endif

}  // namespace pw::exec
