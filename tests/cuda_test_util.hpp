// Helpers of the CUDA suites: skipping without a GPU, device buffers from a test arena, bf16
// rounding of host data and the relative error norm the GPU is checked with.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "exec/cuda/arena.hpp"
#include "exec/cuda/device.hpp"
#include "exec/cuda/runtime.hpp"

// Every GPU test starts with this: without a device it reports itself skipped, with the reason.
#define PW_SKIP_WITHOUT_GPU()                                            \
  do {                                                                   \
    if (pw::exec::cuda::cuda_device_count() == 0)                        \
      GTEST_SKIP() << "skipped: " << pw::exec::cuda::no_device_reason(); \
  } while (0)

namespace pw::testing {

using Vec = std::vector<float>;
using Ids = std::vector<std::int32_t>;
using exec::Category;
using exec::cuda::bf16;
using exec::cuda::DeviceArena;
using exec::cuda::DeviceBuffer;

// Normal(0, std) values rounded to bf16, so the CPU reference and the GPU start from equal inputs.
inline Vec randn(std::size_t n, unsigned seed, float std = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, std);
  Vec v(n);
  for (float& x : v)
    x = exec::cuda::round_to_bf16(d(gen));
  return v;
}

inline Ids random_ids(std::size_t n, int V, unsigned seed) {
  std::mt19937 gen(seed);
  Ids v(n);
  for (auto& x : v)
    x = std::int32_t(gen() % unsigned(V));
  return v;
}

inline void round_in_place(Vec& v) {
  for (float& x : v)
    x = exec::cuda::round_to_bf16(x);
}

// ||got - want|| / ||want|| (0 when both are 0).
inline double rel_err(const Vec& got, const Vec& want) {
  EXPECT_EQ(got.size(), want.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double d = double(got[i]) - double(want[i]);
    num += d * d;
    den += double(want[i]) * double(want[i]);
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

inline void sync() {
  CUDA_CHECK(cudaDeviceSynchronize());
}

// A device copy of host values: bf16 (rounded) or the host type itself.
inline DeviceBuffer to_device_bf16(DeviceArena& arena, const Vec& v,
                                   Category c = Category::activations) {
  DeviceBuffer b(arena, c, std::int64_t(v.size() * sizeof(bf16)));
  const auto h = exec::cuda::to_bf16(v.data(), std::int64_t(v.size()));
  if (!v.empty())
    CUDA_CHECK(cudaMemcpy(b.data(), h.data(), h.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  return b;
}

template <class T>
DeviceBuffer to_device(DeviceArena& arena, const std::vector<T>& v,
                       Category c = Category::activations) {
  DeviceBuffer b(arena, c, std::int64_t(v.size() * sizeof(T)));
  if (!v.empty())
    CUDA_CHECK(cudaMemcpy(b.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

inline Vec from_device_bf16(const void* p, std::int64_t n) {
  std::vector<bf16> h(std::size_t(n > 0 ? n : 0));
  sync();
  if (n > 0) CUDA_CHECK(cudaMemcpy(h.data(), p, h.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  return exec::cuda::to_float(h.data(), n);
}

template <class T>
std::vector<T> from_device(const void* p, std::int64_t n) {
  std::vector<T> h(std::size_t(n > 0 ? n : 0));
  sync();
  if (n > 0) CUDA_CHECK(cudaMemcpy(h.data(), p, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// A zeroed device buffer.
inline DeviceBuffer zeros(DeviceArena& arena, std::int64_t bytes,
                          Category c = Category::activations) {
  DeviceBuffer b(arena, c, bytes);
  if (bytes > 0) CUDA_CHECK(cudaMemset(b.data(), 0, std::size_t(bytes)));
  return b;
}

// A 4-step run of `plan` against the same run stopped after 2 steps (a checkpoint in `dir`, which
// is removed afterwards) and resumed: the later losses and the final weights the unbroken run's,
// bit for bit.
inline void expect_resume_is_exact(const models::ModelSpec& model, const planner::Plan& plan,
                                   exec::TrainOptions o, const std::string& dir) {
  o.steps = 4;
  o.checkpoint_dir.clear();
  o.resume = false;
  const exec::TrainResult unbroken = exec::cuda::train_cuda(model, plan, o);
  std::filesystem::remove_all(dir);
  o.checkpoint_dir = dir;
  o.steps = 2;
  exec::cuda::train_cuda(model, plan, o);
  o.steps = 4;
  o.resume = true;
  const exec::TrainResult resumed = exec::cuda::train_cuda(model, plan, o);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(resumed.first_step, 2);
  ASSERT_EQ(resumed.steps.size(), 2u);
  EXPECT_EQ(resumed.steps[0].loss, unbroken.steps[2].loss);
  EXPECT_EQ(resumed.steps[1].loss, unbroken.steps[3].loss);
  for (std::size_t r = 0; r < unbroken.ranks.size(); ++r)
    EXPECT_EQ(resumed.ranks[r].weights, unbroken.ranks[r].weights) << "rank " << r;
}

}  // namespace pw::testing
