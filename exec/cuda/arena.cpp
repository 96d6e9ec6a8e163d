// The device arena: one cudaMalloc, first-fit carving with coalescing, bytes by category.
#include "exec/cuda/arena.hpp"

#include <algorithm>
#include <atomic>

#include <fmt/format.h>

#include "exec/cuda/device.hpp"

namespace pw::exec::cuda {

namespace {

std::atomic<std::int64_t> g_cuda_malloc_calls{0};

std::int64_t round_up(std::int64_t n, std::int64_t a) {
  return (n + a - 1) / a * a;
}

const char* category_name(Category c) {
  switch (c) {
    case Category::weights:
      return "weights";
    case Category::weight_versions:
      return "weight_versions";
    case Category::gradients:
      return "gradients";
    case Category::optimizer:
      return "optimizer";
    case Category::activations:
      return "activations";
    case Category::workspace:
      return "workspace";
  }
  return "?";
}

std::string mib(std::int64_t bytes) {
  return fmt::format("{:.1f} MiB", double(bytes) / double(1 << 20));
}

}  // namespace

OffsetAllocator::OffsetAllocator(std::int64_t capacity_bytes)
    : capacity_(capacity_bytes / kAlignment * kAlignment) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::int64_t OffsetAllocator::allocate(std::int64_t bytes) {
  if (bytes <= 0) return 0;
  const std::int64_t need = round_up(bytes, kAlignment);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const std::int64_t offset = it->first, rest = it->second - need;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + need, rest);
    live_.emplace(offset, need);
    used_bytes_ += need;
    return offset;
  }
  return -1;
}

std::int64_t OffsetAllocator::release(std::int64_t offset) {
  const auto live = live_.find(offset);
  if (live == live_.end())
    throw Error(
        fmt::format("device arena: release of offset {} that is not an allocated block", offset));
  const std::int64_t size = live->second;
  live_.erase(live);
  used_bytes_ -= size;
  auto it = free_.emplace(offset, size).first;
  const auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    const auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
  return size;
}

std::int64_t OffsetAllocator::largest_free() const {
  std::int64_t best = 0;
  for (const auto& [offset, size] : free_)
    best = std::max(best, size);
  return best;
}

DeviceMemoryInfo device_memory_info() {
  std::size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return {std::int64_t(free_bytes), std::int64_t(total_bytes)};
}

std::int64_t default_arena_bytes() {
  const DeviceMemoryInfo info = device_memory_info();
  const std::int64_t reserve =
      std::max<std::int64_t>(std::int64_t(512) << 20, info.total_bytes / 32);
  return std::max<std::int64_t>(info.free_bytes - reserve, 0);
}

DeviceArena::DeviceArena(std::int64_t capacity_bytes, MemoryCounter* counter)
    : allocator_(capacity_bytes), counter_(counter ? counter : &own_counter_) {
  CUDA_CHECK(cudaGetDevice(&device_));
  if (allocator_.capacity() <= 0)
    throw Error(fmt::format("device arena: capacity {} bytes is less than {}", capacity_bytes,
                            OffsetAllocator::kAlignment));
  ++g_cuda_malloc_calls;
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, std::size_t(allocator_.capacity()));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    std::size_t free_bytes = 0, total_bytes = 0;
    (void)cudaMemGetInfo(&free_bytes, &total_bytes);
    const std::string what =
        fmt::format("device arena: cudaMalloc of {} on device {} failed: {} ({} free of {})",
                    mib(allocator_.capacity()), device_, cudaGetErrorString(e),
                    mib(std::int64_t(free_bytes)), mib(std::int64_t(total_bytes)));
    if (e == cudaErrorMemoryAllocation) throw DeviceMemoryError(what);
    throw Error(what);
  }
  base_ = static_cast<char*>(p);
}

DeviceArena::~DeviceArena() {
  (void)cudaFree(base_);  // no throwing from a destructor; the process is ending the arena anyway
}

void* DeviceArena::allocate(std::int64_t bytes, Category category) {
  if (bytes < 0) throw Error(fmt::format("device arena: negative request of {} bytes", bytes));
  if (bytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  const std::int64_t offset = allocator_.allocate(bytes);
  if (offset < 0)
    throw DeviceMemoryError(fmt::format(
        "device arena on device {}: no room for {} of {} ({} of {} in use, largest free block {})",
        device_, mib(bytes), category_name(category), mib(allocator_.used()),
        mib(allocator_.capacity()), mib(allocator_.largest_free())));
  live_.emplace(offset, Live{bytes, category});
  by_category_[std::size_t(category)] += bytes;
  peak_reserved_ = std::max(peak_reserved_, allocator_.used());
  counter_->add(category, bytes);
  return base_ + offset;
}

void DeviceArena::release(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const std::int64_t offset = static_cast<char*>(p) - base_;
  const auto it = live_.find(offset);
  if (offset < 0 || it == live_.end())
    throw Error("device arena: release of a pointer it did not hand out");
  allocator_.release(offset);
  by_category_[std::size_t(it->second.category)] -= it->second.requested;
  counter_->add(it->second.category, -it->second.requested);
  live_.erase(it);
}

std::int64_t DeviceArena::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocator_.used();
}

std::int64_t DeviceArena::peak_reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_reserved_;
}

std::int64_t DeviceArena::bytes(Category c) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return by_category_[std::size_t(c)];
}

std::string DeviceArena::summary() const {
  std::string s;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    s = fmt::format("device {} arena {}: {} in use, peak {}", device_, mib(allocator_.capacity()),
                    mib(allocator_.used()), mib(peak_reserved_));
    for (std::size_t c = 0; c < by_category_.size(); ++c)
      if (by_category_[c] > 0)
        s += fmt::format(", {} {}", category_name(Category(c)), mib(by_category_[c]));
  }
  const DeviceMemoryInfo m = device_memory_info();
  return s + fmt::format("; driver: {} free of {}", mib(m.free_bytes), mib(m.total_bytes));
}

std::int64_t DeviceArena::cuda_malloc_calls() {
  return g_cuda_malloc_calls.load();
}

DeviceBuffer::DeviceBuffer(DeviceArena& arena, Category category, std::int64_t bytes)
    : arena_(&arena), data_(arena.allocate(bytes, category)), bytes_(bytes) {}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : arena_(o.arena_), data_(o.data_), bytes_(o.bytes_) {
  o.arena_ = nullptr;
  o.data_ = nullptr;
  o.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    arena_ = o.arena_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.arena_ = nullptr;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  reset();
}

void DeviceBuffer::reset() noexcept {
  if (arena_ && data_) {
    try {
      arena_->release(data_);
    } catch (...) {  // a buffer only holds blocks its arena handed out: cannot happen
    }
  }
  arena_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

void* Carver::take_bytes(std::int64_t n) {
  const std::int64_t start = round_up(used_, 16);
  if (n < 0 || start + n > bytes_)
    throw Error(fmt::format("{}: needs {} more bytes at offset {} of a {}-byte buffer", what_, n,
                            start, bytes_));
  used_ = start + n;
  return base_ + start;
}

std::int64_t Carver::left() const {
  return std::max<std::int64_t>(0, bytes_ - round_up(used_, 16));
}

}  // namespace pw::exec::cuda
