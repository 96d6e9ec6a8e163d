// The weight slots' writes, the one rule both workers (CPU and CUDA) give them (exec/README.md,
// "The device interface"): which slot an update or a step's parameter uploads write, that the
// write begins only after the slot's last tied-weights send has read it, that a slot gets its
// memory the first time it is written, and which version each slot then holds.
// Host-only, backend-independent: tested on the CPU with a device that records its calls
// (tests/test_offload_exec.cpp) and through both workers.
#pragma once

#include <utility>
#include <vector>

#include <fmt/format.h>

#include "common/error.hpp"
#include "exec/offload.hpp"
#include "exec/run_common.hpp"
#include "planner/plan.hpp"

namespace pw::exec::detail {

// Who writes a slot: the device's optimizer step, or optimizer offload's uploads (CPU Adam's new
// parameters, copy_parameters_to_device) on the host-to-device copy engine.
enum class SlotWriter { update, upload };

// The two weight slots of a rank (VersionSlots) and the reads their writes wait for. `Reader` is
// the worker's event (done once the send that read the slot has; default-constructed: none).
// The worker `W` does only what a device does:
//   void allocate_slot(int slot)             every chunk's buffer of the slot, counted
//   void before_slot_write(int slot, SlotWriter, Reader last_send)
//                                            orders the writer after the slot's readers: the last
//                                            tied-weights send out of it since its last write
//                                            (default-constructed: none) and whatever else of the
//                                            device reads it
//   void retire_reader(Reader)               a send's read (or none) that the next one of the
//                                            slot supersedes (both on one FIFO engine or stream)
template <class W, class Reader>
class WeightSlots {
 public:
  explicit WeightSlots(W& w) : w_(w) {}
  WeightSlots(const WeightSlots&) = delete;
  WeightSlots& operator=(const WeightSlots&) = delete;

  void set_rank(int rank) {
    rank_ = rank;
    versions_.set_rank(rank);
  }
  int slot_of(int version) const { return versions_.slot_of(version); }
  int newest() const { return versions_.newest(); }
  void free_version(int version) { versions_.free_version(version); }
  void resume(const std::vector<int>& versions) { versions_.resume(versions); }

  // send_tied_weights out of `version`'s slot, issued: `sent` is done once it has read it.
  void read_by(int version, Reader sent) {
    w_.retire_reader(std::exchange(readers_[versions_.slot_of(version)], std::move(sent)));
  }

  // The device's optimizer step to `version`: the slot it writes (a free one), ready to be
  // written. Throws naming the rank when no slot is free.
  int begin_update(int version) {
    bool allocate = false;
    const int target = versions_.target_for(version, allocate);
    ready(target, SlotWriter::update, allocate);
    return target;
  }
  // After the update: `slot` holds `version`, the newest.
  void end_update(int version, int slot) { versions_.place(version, slot); }

  // A step's copy_parameters_to_device: the slot the uploads write, which its first one picks
  // (upload_slot) and readies.
  int upload_target(const planner::Plan& plan) {
    if (upload_ < 0) {
      upload_ = upload_slot(plan, versions_.newest());
      ready(upload_, SlotWriter::upload, !versions_.allocated(upload_));
    }
    return upload_;
  }
  // The optimizer step after the uploads (the version's parameters written into the slot): the
  // slot, now holding `version`, the newest. Throws naming the rank when no upload came.
  int end_upload(int version) {
    if (upload_ < 0)
      throw Error(
          fmt::format("rank {}: optimizer step of version {} without its uploads", rank_, version));
    const int slot = std::exchange(upload_, -1);
    versions_.place(version, slot);
    return slot;
  }

  // Offload chunks: the weights live in the chunks, not in the slots; only which version is the
  // newest moves (no memory, no tied-weights reads of a slot).
  void advance(int version) {
    bool allocate = false;
    versions_.place(version, versions_.target_for(version, allocate));
  }

 private:
  void ready(int slot, SlotWriter writer, bool allocate) {
    w_.before_slot_write(slot, writer, std::exchange(readers_[slot], Reader{}));
    if (allocate) w_.allocate_slot(slot);
  }

  W& w_;
  int rank_ = 0;
  VersionSlots versions_;
  Reader readers_[2]{};  // the last tied-weights send out of each slot since its last write
  int upload_ = -1;
};

}  // namespace pw::exec::detail
