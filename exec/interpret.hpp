// The op switch both workers run (exec/README.md, "The device interface"): each program op to the
// worker's call for it, so which ops exist and how they group (the tied exchange, offload's
// copies) is written once for the CPU and the CUDA worker. A worker W provides, for an op:
//   forward, recompute, backward, all_reduce, optimizer_step, free_version, tied (the six tied-
//   embedding ops), offload (the five offload ops), send(op, Channel), recv(op, Channel), and
//   where it runs them chunk (the four chunk ops, PatrickStar: the CPU worker).
// Both are friends of it; it holds no state.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include "common/error.hpp"
#include "exec/transport.hpp"
#include "planner/program.hpp"

namespace pw::exec::detail {

template <class W>
void interpret(W& w, const planner::Op& op) {
  using planner::OpKind;
  switch (op.kind) {
    case OpKind::forward:
      return w.forward(op);
    case OpKind::recompute:
      return w.recompute(op);
    case OpKind::backward:
      return w.backward(op);
    case OpKind::send_activation:
      return w.send(op, Channel::activation);
    case OpKind::send_gradient:
      return w.send(op, Channel::gradient);
    case OpKind::recv_activation:
      return w.recv(op, Channel::activation);
    case OpKind::recv_gradient:
      return w.recv(op, Channel::gradient);
    case OpKind::all_reduce:
      return w.all_reduce(op);
    case OpKind::free_version:
      return w.free_version(op);
    case OpKind::optimizer_step:
      return w.optimizer_step(op);
    case OpKind::send_tied_gradient:
    case OpKind::recv_tied_gradient:
    case OpKind::send_tied_weights:
    case OpKind::recv_tied_weights:
    case OpKind::gather_tied_gradient:
    case OpKind::gather_tied_weights:
      return w.tied(op);
    case OpKind::copy_gradient_to_host:
    case OpKind::host_optimizer_step:
    case OpKind::copy_parameters_to_device:
    case OpKind::copy_activation_to_host:
    case OpKind::copy_activation_to_device:
      return w.offload(op);
    case OpKind::copy_chunk_to_host:
    case OpKind::copy_chunk_to_device:
    case OpKind::chunk_step_host:
    case OpKind::chunk_step_device:
      // The CPU worker runs them; prepare_run refuses chunks plans for the other backends.
      if constexpr (requires { w.chunk(op); })
        return w.chunk(op);
      else
        throw InputError("this executor does not run offload chunks (PatrickStar) yet");
  }
}

// The all-reduce bucket `bucket` of `buckets` over a chunk's n gradient elements: [first,
// second), ceil(n / buckets) each, the last ones shorter or empty (both workers, the simulator's
// bucket sizes).
inline std::pair<std::int64_t, std::int64_t> bucket_range(std::int64_t n, int buckets, int bucket) {
  const std::int64_t per = (n + buckets - 1) / buckets;
  const std::int64_t begin = std::min(n, per * bucket);
  return {begin, std::min(n, begin + per)};
}

}  // namespace pw::exec::detail
