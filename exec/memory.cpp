// Byte counting by category (see memory.hpp).
#include "exec/memory.hpp"

#include <fmt/format.h>

#include "common/error.hpp"

namespace pw::exec {

namespace {
std::int64_t& slot(planner::MemoryBreakdown& m, Category c) {
  switch (c) {
    case Category::weights:
      return m.weights;
    case Category::weight_versions:
      return m.weight_versions;
    case Category::gradients:
      return m.gradients;
    case Category::optimizer:
      return m.optimizer;
    case Category::activations:
      return m.activations;
    case Category::workspace:
      return m.workspace;
  }
  return m.workspace;
}

const char* category_name(Category c) {
  switch (c) {
    case Category::weights:
      return "weights";
    case Category::weight_versions:
      return "weight versions";
    case Category::gradients:
      return "gradients";
    case Category::optimizer:
      return "optimizer state";
    case Category::activations:
      return "activations";
    case Category::workspace:
      return "workspace";
  }
  return "workspace";
}

std::string bytes_text(std::int64_t b) {
  if (b >= (std::int64_t(1) << 20))
    return fmt::format("{} B ({:.2f} MiB)", b, double(b) / 1048576.0);
  if (b >= 1024) return fmt::format("{} B ({:.1f} KiB)", b, double(b) / 1024.0);
  return fmt::format("{} B", b);
}

}  // namespace

void MemoryCounter::set_budget(std::int64_t bytes, std::string owner) {
  std::lock_guard<std::mutex> lock(mutex_);
  budget_ = bytes;
  owner_ = std::move(owner);
}

void MemoryCounter::add(Category c, std::int64_t bytes) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (budget_ > 0 && bytes > 0 && now_.total() + bytes > budget_) {
    lock.unlock();
    const bool freed = reclaim_ && reclaim_();
    lock.lock();
    if (!freed && now_.total() + bytes > budget_)
      throw InputError(
          fmt::format("{}: --device-memory {}: {} of {} do not fit ({} in use; short by {})",
                      owner_, bytes_text(budget_), category_name(c), bytes_text(bytes),
                      bytes_text(now_.total()), bytes_text(now_.total() + bytes - budget_)));
  }
  slot(now_, c) += bytes;
  samples_.emplace_back(std::chrono::steady_clock::now(), now_.total());
  if (now_.total() > peak_) {
    peak_ = now_.total();
    at_peak_ = now_;
  }
}

std::int64_t MemoryCounter::current() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return now_.total();
}

std::int64_t MemoryCounter::peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

planner::MemoryBreakdown MemoryCounter::at_peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return at_peak_;
}

std::vector<std::pair<std::chrono::steady_clock::time_point, std::int64_t>> MemoryCounter::samples()
    const {
  std::lock_guard<std::mutex> lock(mutex_);
  return samples_;
}

std::vector<float> BufferPool::take(std::int64_t floats) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = free_.find(floats);
    if (it != free_.end() && !it->second.empty()) {
      std::vector<float> data = std::move(it->second.back());
      it->second.pop_back();
      return data;
    }
  }
  return std::vector<float>(std::size_t(floats), 0.0f);
}

void BufferPool::give(std::vector<float>&& data) {
  if (data.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  free_[std::int64_t(data.size())].push_back(std::move(data));
}

Buffer::Buffer(MemoryCounter* counter, Category category, std::int64_t floats)
    : counter_(counter), category_(category), data_(std::size_t(floats), 0.0f) {
  if (counter_) counter_->add(category_, floats * std::int64_t(sizeof(float)));
}

Buffer::Buffer(MemoryCounter* counter, Category category, std::int64_t floats, BufferPool* pool)
    : counter_(counter), pool_(pool), category_(category), data_(pool->take(floats)) {
  if (counter_) counter_->add(category_, floats * std::int64_t(sizeof(float)));
}

Buffer::Buffer(MemoryCounter* counter, Category category, std::vector<float>&& data)
    : counter_(counter), category_(category), data_(std::move(data)) {
  if (counter_) counter_->add(category_, std::int64_t(data_.size() * sizeof(float)));
}

Buffer::Buffer(Buffer&& o) noexcept
    : counter_(o.counter_), pool_(o.pool_), category_(o.category_), data_(std::move(o.data_)) {
  o.counter_ = nullptr;
  o.pool_ = nullptr;
  o.data_.clear();
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    counter_ = o.counter_;
    pool_ = o.pool_;
    category_ = o.category_;
    data_ = std::move(o.data_);
    o.counter_ = nullptr;
    o.pool_ = nullptr;
    o.data_.clear();
  }
  return *this;
}

Buffer::~Buffer() {
  release();
}

void Buffer::keep(std::int64_t begin, std::int64_t end) {
  if (begin < 0 || end < begin || end > size())
    throw std::logic_error("Buffer::keep: out of range");
  const std::int64_t dropped = size() - (end - begin);
  std::copy(data_.begin() + begin, data_.begin() + end, data_.begin());
  data_.resize(std::size_t(end - begin));
  data_.shrink_to_fit();
  if (counter_) counter_->add(category_, -dropped * std::int64_t(sizeof(float)));
}

void Buffer::release() {
  if (counter_ && !data_.empty())
    counter_->add(category_, -std::int64_t(data_.size() * sizeof(float)));
  counter_ = nullptr;
  if (pool_) {
    pool_->give(std::move(data_));
    pool_ = nullptr;
  }
  data_.clear();
  data_.shrink_to_fit();
}

}  // namespace pw::exec
