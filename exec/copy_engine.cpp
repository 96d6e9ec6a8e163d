// A FIFO of work on its own thread (see copy_engine.hpp).
#include "exec/copy_engine.hpp"

namespace pw::exec {

CopyEngine::CopyEngine() : thread_([this] { loop(); }) {}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  thread_.join();
}

CopyEngine::Ticket CopyEngine::submit(std::function<void()> work) {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.push_back(std::move(work));
  cv_.notify_all();
  return ++submitted_;
}

void CopyEngine::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return done_ >= ticket || error_ || stop_; });
  if (error_) std::rethrow_exception(error_);
}

CopyEngine::Ticket CopyEngine::last() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return submitted_;
}

void CopyEngine::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !error_); });
    if (stop_) return;
    std::function<void()> work = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr failed;
    try {
      work();
    } catch (...) {
      failed = std::current_exception();
    }
    lock.lock();
    if (failed && !error_) error_ = failed;
    ++done_;
    cv_.notify_all();
  }
}

}  // namespace pw::exec
