// The optimizer-offload ops of a rank's program (ZeRO-Offload) on the SimGrid platform: copies
// over the GPU's host link (and the uplink it shares), CPU Adam as work on the node's CPU host;
// with t > 1 each GPU of the TP group copies and updates its own shard (HostWork).
// The model: docs/formulas.md, section 9.
#include <algorithm>

#include "sim/collectives.hpp"
#include "sim/observer.hpp"
#include "sim/world.hpp"

namespace pw::sim::detail {

using planner::Op;
using planner::OpKind;

bool OffloadReplay::on() const {
  return w_.plan().offload == planner::Offload::optimizer;
}

void HostWork::wait() const {
  for (const sg4::ActivityPtr& a : parts)
    a->wait();
}

double HostWork::start() const {
  double t = parts.front()->get_start_time();
  for (const sg4::ActivityPtr& a : parts)
    t = std::min(t, a->get_start_time());
  return t;
}

double HostWork::finish() const {
  double t = parts.front()->get_finish_time();
  for (const sg4::ActivityPtr& a : parts)
    t = std::max(t, a->get_finish_time());
  return t;
}

HostWork host_copy(const RankState& me, bool down, std::int64_t bytes) {
  const auto size = std::uint64_t(std::max<std::int64_t>(bytes, 1));
  HostWork h;
  for (sg4::Host* gpu : me.tp_hosts) {
    sg4::Host* from = down ? gpu : me.cpu;
    sg4::Host* to = down ? me.cpu : gpu;
    observe_transfer(from, to, double(size));
    h.parts.push_back(start_flow(from, to, size));
  }
  return h;
}

HostWork host_adam(const RankState& me, double parameters) {
  HostWork h;
  for (std::size_t k = 0; k < me.tp_hosts.size(); ++k) {
    sg4::ExecPtr e = sg4::this_actor::exec_init(parameters / me.cpu_adam_params_per_s * kCpuSpeed);
    e->set_host(me.cpu);
    e->start();
    h.parts.push_back(e);
  }
  return h;
}

void OffloadReplay::begin_backward(const Op& op) {
  if (w_.plan().offload_sharded()) return;  // w > 1: the gradients stay for the reduce-scatter
  const std::int64_t e = w_.dtype_bytes;
  const std::int64_t bytes = me_.offload.chunks[std::size_t(op.chunk)].streamed_parameters * e;
  me_.copied_out_bytes += bytes;
  out_ = host_copy(me_, true, bytes);
}

void OffloadReplay::run(const Op& op, int index) {
  const std::int64_t e = w_.dtype_bytes;
  switch (op.kind) {
    case OpKind::copy_gradient_to_host: {
      HostWork c = out_;
      if (op.microbatch < 0) {  // stage 0's tied gradient, summed on the device: copied now;
        // with w > 1 the chunk's shard of the reduce-scattered gradient (the replay waited for
        // the step's collectives)
        const planner::ChunkOffload& o = me_.offload.chunks[std::size_t(op.chunk)];
        const std::int64_t bytes =
            (w_.plan().offload_sharded() ? o.shard_copy_out_parameters
                                         : me_.offload.chunks[0].tied_copy_out_parameters) *
            e;
        me_.copied_out_bytes += bytes;
        c = host_copy(me_, true, bytes);
      }
      c.wait();
      me_.events.push_back({kCopyOut, c.start(), c.finish(), index});
      out_ = {};
      return;
    }
    case OpKind::host_optimizer_step: {
      // Tile `bucket` of the chunk: its parameters at the node's Adam rate (kCpuSpeed flop/s
      // stand for that rate; ranks whose tiles run at once share the CPU host max-min fairly).
      if (adam_) adam_.wait();
      const double parameters =
          double(me_.offload.chunks[std::size_t(op.chunk)].tiles[std::size_t(op.bucket)]);
      adam_ = host_adam(me_, parameters);
      adam_op_ = index;
      return;
    }
    case OpKind::copy_parameters_to_device: {
      adam_.wait();
      me_.events.push_back({kHostCpu, adam_.start(), adam_.finish(), adam_op_});
      adam_ = {};
      wait_uploads();  // one copy engine per direction: uploads in order
      const std::int64_t bytes =
          me_.offload.chunks[std::size_t(op.chunk)].tiles[std::size_t(op.bucket)] * e;
      me_.copied_in_bytes += bytes;
      upload_ = host_copy(me_, false, bytes);
      upload_op_ = index;
      return;
    }
    default:
      return;
  }
}

void OffloadReplay::wait_uploads() {
  if (!upload_) return;
  upload_.wait();
  me_.events.push_back({kCopyIn, upload_.start(), upload_.finish(), upload_op_});
  upload_ = {};
}

}  // namespace pw::sim::detail
