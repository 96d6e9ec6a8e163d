// Owners of a CUDA stream and a timing event: created in the constructor (a one-line pw::Error on
// failure), destroyed with the object.
#pragma once

#include <cuda_runtime.h>

#include "exec/cuda/device.hpp"

namespace pw::exec::cuda {

// A stream that does not synchronise with the legacy default stream.
class Stream {
 public:
  Stream() { CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  Event() { CUDA_CHECK(cudaEventCreate(&e_)); }
  ~Event() { (void)cudaEventDestroy(e_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

// Device seconds of the work `op()` enqueues on `stream`: an event pair around it, then a wait for
// the second. Host time spent issuing the work counts when the stream is idle meanwhile.
class EventTimer {
 public:
  explicit EventTimer(cudaStream_t stream) : stream_(stream) {}
  template <class Op>
  double seconds(const Op& op) {
    CUDA_CHECK(cudaEventRecord(start_.get(), stream_));
    op();
    CUDA_CHECK(cudaEventRecord(stop_.get(), stream_));
    CUDA_CHECK(cudaEventSynchronize(stop_.get()));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start_.get(), stop_.get()));
    return 1e-3 * double(ms);
  }

 private:
  cudaStream_t stream_;
  Event start_, stop_;
};

}  // namespace pw::exec::cuda
