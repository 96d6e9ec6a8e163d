// The optimizer-offload ops of a rank's program (ZeRO-Offload) on the SimGrid platform: copies
// over the GPU's host link (and the uplink it shares), CPU Adam as work on the node's CPU host.
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

sg4::CommPtr OffloadReplay::flow(sg4::Host* from, sg4::Host* to, std::int64_t bytes) {
  const auto size = std::uint64_t(std::max<std::int64_t>(bytes, 1));
  observe_transfer(from, to, double(size));
  return start_flow(from, to, size);
}

void OffloadReplay::begin_backward(const Op& op) {
  if (w_.plan().offload_sharded()) return;  // w > 1: the gradients stay for the reduce-scatter
  const std::int64_t e = w_.dtype_bytes;
  const std::int64_t bytes = me_.offload.chunks[std::size_t(op.chunk)].streamed_parameters * e;
  me_.copied_out_bytes += bytes;
  out_ = flow(me_.host, me_.cpu, bytes);
}

void OffloadReplay::run(const Op& op, int index) {
  const std::int64_t e = w_.dtype_bytes;
  switch (op.kind) {
    case OpKind::copy_gradient_to_host: {
      sg4::CommPtr c = out_;
      if (op.microbatch < 0) {  // stage 0's tied gradient, summed on the device: copied now;
        // with w > 1 the chunk's shard of the reduce-scattered gradient (the replay waited for
        // the step's collectives)
        const planner::ChunkOffload& o = me_.offload.chunks[std::size_t(op.chunk)];
        const std::int64_t bytes =
            (w_.plan().offload_sharded() ? o.shard_copy_out_parameters
                                         : me_.offload.chunks[0].tied_copy_out_parameters) *
            e;
        me_.copied_out_bytes += bytes;
        c = flow(me_.host, me_.cpu, bytes);
      }
      c->wait();
      me_.events.push_back({kCopyOut, c->get_start_time(), c->get_finish_time(), index});
      out_ = nullptr;
      return;
    }
    case OpKind::host_optimizer_step: {
      // Tile `bucket` of the chunk: its parameters at the node's Adam rate (kCpuSpeed flop/s
      // stand for that rate; ranks whose tiles run at once share the CPU host max-min fairly).
      if (adam_) adam_->wait();
      const double parameters =
          double(me_.offload.chunks[std::size_t(op.chunk)].tiles[std::size_t(op.bucket)]);
      adam_ = sg4::this_actor::exec_init(parameters / me_.cpu_adam_params_per_s * kCpuSpeed);
      adam_->set_host(me_.cpu);
      adam_->start();
      adam_op_ = index;
      return;
    }
    case OpKind::copy_parameters_to_device: {
      adam_->wait();
      me_.events.push_back({kHostCpu, adam_->get_start_time(), adam_->get_finish_time(), adam_op_});
      adam_ = nullptr;
      wait_uploads();  // one copy engine per direction: uploads in order
      const std::int64_t bytes =
          me_.offload.chunks[std::size_t(op.chunk)].tiles[std::size_t(op.bucket)] * e;
      me_.copied_in_bytes += bytes;
      upload_ = flow(me_.cpu, me_.host, bytes);
      upload_op_ = index;
      return;
    }
    default:
      return;
  }
}

void OffloadReplay::wait_uploads() {
  if (!upload_) return;
  upload_->wait();
  me_.events.push_back(
      {kCopyIn, upload_->get_start_time(), upload_->get_finish_time(), upload_op_});
  upload_ = nullptr;
}

}  // namespace pw::sim::detail
