// The executor's byte-counting allocator: every buffer a worker holds is counted by category, so a
// measured run reports peak memory with the same breakdown as the planner and the simulator.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "planner/report.hpp"

namespace pw::exec {

enum class Category { weights, weight_versions, gradients, optimizer, activations, workspace };

// Current and peak bytes of one device, by category. Thread-safe (ranks on one device share it).
// With a budget it is the emulated device's arena: a growth past the budget first asks `reclaim`
// to free memory (a swapped stash whose copy to the host is under way: it waits for the copy),
// and when nothing more can be freed throws an InputError naming the device, what did not fit and
// by how much.
class MemoryCounter {
 public:
  // `bytes` 0: unlimited. `owner` names the device in the error ("rank 1").
  void set_budget(std::int64_t bytes, std::string owner);
  std::int64_t budget() const { return budget_; }
  // Frees some of the device's memory and returns true, or returns false when it cannot. Called
  // without the counter's lock, on the thread that asked for the growth.
  void set_reclaim(std::function<bool()> reclaim) { reclaim_ = std::move(reclaim); }
  void add(Category c, std::int64_t bytes);
  std::int64_t current() const;
  std::int64_t peak() const;
  planner::MemoryBreakdown at_peak() const;  // the breakdown when the total peaked
  // (time, total bytes) at every change, for the timeline's memory counter.
  std::vector<std::pair<std::chrono::steady_clock::time_point, std::int64_t>> samples() const;

 private:
  mutable std::mutex mutex_;
  std::int64_t budget_ = 0;
  std::string owner_;
  std::function<bool()> reclaim_;
  planner::MemoryBreakdown now_, at_peak_;
  std::int64_t peak_ = 0;
  std::vector<std::pair<std::chrono::steady_clock::time_point, std::int64_t>> samples_;
};

// Storage that dying buffers give back for the next buffer of the same size. A worker allocates
// the same few sizes every microbatch (stash, stage output, input gradient); reusing them spares
// the page faults and zero-filling of fresh memory (a tenth of a CPU step, docs/performance.md).
// The counters are unaffected: a buffer counts its bytes while it lives, wherever they came from.
// Thread-safe.
class BufferPool {
 public:
  // `floats` floats: a given-back vector of that size with its old contents, else a new zeroed one.
  std::vector<float> take(std::int64_t floats);
  void give(std::vector<float>&& data);

 private:
  std::mutex mutex_;
  std::map<std::int64_t, std::vector<std::vector<float>>> free_;
};

// A float buffer whose bytes are counted while it lives.
class Buffer {
 public:
  Buffer() = default;
  // Zero-filled.
  Buffer(MemoryCounter* counter, Category category, std::int64_t floats);
  // From the pool, and back to it when released: its contents are undefined (a kernel's output
  // that it overwrites completely).
  Buffer(MemoryCounter* counter, Category category, std::int64_t floats, BufferPool* pool);
  // Takes `data` over (no copy).
  Buffer(MemoryCounter* counter, Category category, std::vector<float>&& data);
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  float* data() { return data_.data(); }
  const float* data() const { return data_.data(); }
  std::int64_t size() const { return std::int64_t(data_.size()); }
  bool empty() const { return data_.empty(); }
  // Keeps elements [begin, end) only, moved to the front; the rest is freed (and uncounted).
  void keep(std::int64_t begin, std::int64_t end);

 private:
  void release();
  MemoryCounter* counter_ = nullptr;
  BufferPool* pool_ = nullptr;
  Category category_ = Category::activations;
  std::vector<float> data_;
};

}  // namespace pw::exec
