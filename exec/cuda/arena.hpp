// One cudaMalloc per device, carved by a first-fit allocator with coalescing: no cudaMalloc or
// cudaFree in the step loop, and every byte counted by category as on the CPU backend.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/error.hpp"
#include "exec/memory.hpp"

namespace pw::exec::cuda {

// Device memory ran out: DeviceArena's cudaMalloc failed, or the arena has no block large enough.
// A pw::Error, so callers that do not care catch it as any other; the profiler skips a microbatch
// size on it.
class DeviceMemoryError : public Error {
 public:
  using Error::Error;
};

// The carving, without a device: offsets into [0, capacity), every block a multiple of
// `alignment` bytes. First fit over a free list ordered by offset; release merges a block with
// free neighbours, so freeing everything leaves one block. Not thread-safe (DeviceArena locks).
class OffsetAllocator {
 public:
  static constexpr std::int64_t kAlignment = 256;
  explicit OffsetAllocator(std::int64_t capacity_bytes);

  // Offset of a new block of `bytes` (rounded up to the alignment), or -1 when no free block is
  // large enough. 0 bytes is not a block: -1 is never returned for it, 0 is, and not recorded.
  std::int64_t allocate(std::int64_t bytes);
  // Frees the block at `offset`; returns its rounded size. Throws pw::Error for an offset that is
  // not a live block.
  std::int64_t release(std::int64_t offset);

  std::int64_t capacity() const { return capacity_; }
  std::int64_t used() const { return used_bytes_; }  // rounded bytes in live blocks
  std::int64_t largest_free() const;
  std::size_t free_blocks() const { return free_.size(); }
  std::size_t live_blocks() const { return live_.size(); }

 private:
  std::int64_t capacity_;
  std::int64_t used_bytes_ = 0;
  std::map<std::int64_t, std::int64_t> free_;            // offset -> size
  std::unordered_map<std::int64_t, std::int64_t> live_;  // offset -> size
};

// cudaMemGetInfo of the current device.
struct DeviceMemoryInfo {
  std::int64_t free_bytes = 0, total_bytes = 0;
};
DeviceMemoryInfo device_memory_info();
// What one arena may take of the current device: the free memory less a reserve of
// max(512 MiB, 1/32 of the total) for cuBLASLt, NCCL and the CUDA context; 0 when less is free.
std::int64_t default_arena_bytes();

// The device's one allocation. Counts the bytes callers asked for by category (current and peak,
// through a MemoryCounter shared with the rest of the worker if given), and the rounded bytes.
// Thread-safe: workers of several stages on one device may share it.
class DeviceArena {
 public:
  // cudaMalloc of `capacity_bytes` on the current device (the only one this arena makes); throws
  // DeviceMemoryError when it runs out of memory (cudaErrorMemoryAllocation).
  explicit DeviceArena(std::int64_t capacity_bytes, MemoryCounter* counter = nullptr);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // A 256-byte aligned block; throws DeviceMemoryError naming the request and the arena's state
  // when it does not fit. 0 bytes gives nullptr.
  void* allocate(std::int64_t bytes, Category category);
  void release(void* p);  // nullptr is a no-op

  int device() const { return device_; }
  std::int64_t capacity_bytes() const { return allocator_.capacity(); }
  std::int64_t reserved_bytes() const;       // rounded bytes in use
  std::int64_t peak_reserved_bytes() const;  // their maximum so far
  std::int64_t bytes(Category c) const;      // requested bytes in use, by category
  const MemoryCounter& counter() const { return *counter_; }
  // One line: capacity, use, peak, the categories and the driver's free/total memory.
  std::string summary() const;

  // Test hook: cudaMalloc calls made by every DeviceArena so far (one per construction).
  static std::int64_t cuda_malloc_calls();

 private:
  struct Live {
    std::int64_t requested;
    Category category;
  };
  mutable std::mutex mutex_;
  int device_ = 0;
  char* base_ = nullptr;
  OffsetAllocator allocator_;
  std::int64_t peak_reserved_ = 0;
  std::array<std::int64_t, 6> by_category_{};
  std::unordered_map<std::int64_t, Live> live_;
  MemoryCounter own_counter_;
  MemoryCounter* counter_;
};

// A block of a DeviceArena for as long as this lives (move-only), like exec::Buffer on the CPU.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceArena& arena, Category category, std::int64_t bytes);
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void* data() const { return data_; }
  std::int64_t bytes() const { return bytes_; }

 private:
  void reset() noexcept;
  DeviceArena* arena_ = nullptr;
  void* data_ = nullptr;
  std::int64_t bytes_ = 0;
};

// Carves typed, 16-byte aligned pieces out of a caller's buffer (a stage's workspace), front to
// back; throws pw::Error naming `what` when the buffer is too small. Copy it to carve a phase's
// pieces from the same start again.
class Carver {
 public:
  Carver(void* base, std::int64_t bytes, const char* what)
      : base_(static_cast<char*>(base)), bytes_(bytes), what_(what) {}
  template <class T>
  T* take(std::int64_t count) {
    return static_cast<T*>(take_bytes(count * std::int64_t(sizeof(T))));
  }
  void* take_bytes(std::int64_t n);
  std::int64_t left() const;  // bytes still free after aligning the next piece

 private:
  char* base_;
  std::int64_t bytes_;
  std::int64_t used_ = 0;
  const char* what_;
};

}  // namespace pw::exec::cuda
