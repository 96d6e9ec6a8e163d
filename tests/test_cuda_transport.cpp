// The GPU transports (exec/cuda/{local,nccl}_transport, mpi_launch). Host-only checks run
// everywhere; the GPU tests report themselves skipped without a device (or with one GPU, the
// two-GPU NCCL test).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test_util.hpp"
#include "exec/cuda/device_transport.hpp"
#include "exec/cuda/local_transport.hpp"
#include "exec/cuda/mpi_launch.hpp"
#if PW_HAVE_NCCL
#include "exec/cuda/nccl_transport.hpp"
#endif

namespace pw::testing {
namespace {

using exec::Channel;
using exec::cuda::DType;
using exec::cuda::LocalTransport;
using exec::cuda::TransportTimeout;

// ---------------------------------------------------------------- host-only: run everywhere

TEST(TransportMessages, OneLineFormats) {
  using namespace exec::cuda;
  EXPECT_EQ(timeout_message(3, "recv activation from 2", 1.5),
            "rank 3: recv activation from 2 timed out after 1.5s");
  EXPECT_EQ(timeout_message(0, "all_reduce bf16 over {0,2}", 300),
            "rank 0: all_reduce bf16 over {0,2} timed out after 300s");
  EXPECT_EQ(aborted_message(1, "send gradient to 0"),
            "transport aborted: rank 1: send gradient to 0");
  EXPECT_EQ(cuda_op_message(1, "send gradient to 0", "cudaMemcpyAsync", cudaErrorInvalidValue),
            "rank 1: send gradient to 0: cudaMemcpyAsync failed: cudaErrorInvalidValue: invalid "
            "argument");
  EXPECT_EQ(p2p_op_name("recv", Channel::tied, "from", 7), "recv tied from 7");
  EXPECT_EQ(group_text({2, 0, 1}), "{2,0,1}");
}

// The distributed optimizer's parts: group.size() + 1 ascending offsets from 0, else one line.
TEST(TransportMessages, BoundsAreAscendingOffsetsFromZero) {
  using namespace exec::cuda;
  EXPECT_NO_THROW(check_bounds(0, "reduce_scatter bf16 over {0,1}", {0, 1}, {0, 5, 5}));
  for (const std::vector<std::int64_t>& bad :
       {std::vector<std::int64_t>{0, 5}, {1, 5, 9}, {0, 6, 5}, {}}) {
    try {
      check_bounds(2, "all_gather fp32 over {0,2}", {0, 2}, bad);
      FAIL() << "accepted " << bad.size() << " bounds";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind("rank 2: all_gather fp32 over {0,2}: bounds [", 0), 0u) << what;
      EXPECT_NE(what.find("are not 3 ascending offsets from 0"), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  }
}

TEST(TransportMessages, PollUntilTimesOutAndAborts) {
  using namespace exec::cuda;
  std::atomic<bool> aborted{false};
  bool timed_out = false;
  try {
    poll_until(
        4, "recv gradient from 5", 0.05, aborted, [] { return false; }, [&] { timed_out = true; });
    FAIL() << "no timeout";
  } catch (const TransportTimeout& e) {
    EXPECT_EQ(std::string(e.what()), "rank 4: recv gradient from 5 timed out after 0.05s");
  }
  EXPECT_TRUE(timed_out);

  // An abort from another thread wakes the poll, which says it was aborted.
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    aborted = true;
  });
  const auto t0 = std::chrono::steady_clock::now();
  try {
    poll_until(
        2, "synchronize", 60, aborted, [] { return false; }, nullptr);
    FAIL() << "not aborted";
  } catch (const TransportTimeout&) {
    FAIL() << "a timeout instead of the abort";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "transport aborted: rank 2: synchronize");
  }
  t.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
}

TEST(MpiLaunch, DetectsTheLauncherEnvironment) {
  using exec::cuda::detect_mpi_env;
  auto from = [](std::map<std::string, std::string> vars) {
    return [vars = std::move(vars)](const char* n) -> const char* {
      const auto it = vars.find(n);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  };
  const auto none = detect_mpi_env(from({}));
  EXPECT_FALSE(none.launched);
  EXPECT_EQ(none.size, 1);

  const auto ompi = detect_mpi_env(from({{"OMPI_COMM_WORLD_RANK", "5"},
                                         {"OMPI_COMM_WORLD_SIZE", "8"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  EXPECT_TRUE(ompi.launched);
  EXPECT_EQ(ompi.launcher, "OpenMPI");
  EXPECT_EQ(ompi.rank, 5);
  EXPECT_EQ(ompi.size, 8);
  EXPECT_EQ(ompi.local_rank, 1);
  EXPECT_EQ(ompi.local_size, 4);

  const auto mpich = detect_mpi_env(from({{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}}));
  EXPECT_EQ(mpich.launcher, "MPICH");
  EXPECT_EQ(mpich.rank, 2);
  EXPECT_EQ(mpich.local_rank, 2);  // no local rank given: one node

  try {
    detect_mpi_env(from({{"OMPI_COMM_WORLD_RANK", "x1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
    FAIL() << "accepted a malformed rank";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()),
              "launcher environment: OMPI_COMM_WORLD_RANK=\"x1\" is not a non-negative integer");
  }
  EXPECT_THROW(detect_mpi_env(from({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}})),
               InputError);
  EXPECT_THROW(detect_mpi_env(from({{"OMPI_COMM_WORLD_SIZE", "2"}})), InputError);
  // The real environment of this test process: not under mpirun (ctest runs it directly).
  EXPECT_NO_THROW(detect_mpi_env());
}

TEST(MpiLaunch, WorldSizeAndDeviceChecks) {
  using namespace exec::cuda;
  EXPECT_NO_THROW(check_world_size(4, 4));
  try {
    check_world_size(3, 4, "w=2, d=2");
    FAIL() << "accepted 3 processes for 4 ranks";
  } catch (const PlanError& e) {
    EXPECT_EQ(std::string(e.what()),
              "mpirun started 3 processes but the plan has 4 ranks (w=2, d=2): run mpirun -np 4");
  }
  MpiEnv env;
  env.launched = true;
  env.rank = 9;
  env.local_rank = 1;
  EXPECT_EQ(local_device(env, 8), 1);
  try {
    local_device(env, 1);
    FAIL() << "two processes on one GPU";
  } catch (const PlanError& e) {
    EXPECT_EQ(std::string(e.what()),
              "rank 9: local rank 1 but this node has 1 CUDA device: one process per GPU (stages "
              "sharing a GPU run in one process)");
  }
  std::printf("MPI support built: %s\n", MpiSession::available() ? "yes" : "no");
}

#if PW_HAVE_NCCL
TEST(NcclHost, VersionWithoutAGpu) {
  using namespace exec::cuda;
  const int v = nccl_version();  // design.md: works without a GPU
  EXPECT_GE(v, NCCL_VERSION(2, 18, 0));
  EXPECT_EQ(v / 10000, NCCL_MAJOR);
  EXPECT_EQ(nccl_version_string().rfind(std::to_string(NCCL_MAJOR) + ".", 0), 0u);
  std::printf("NCCL %s\n", nccl_version_string().c_str());
}

TEST(NcclHost, ErrorMessageIsOneLine) {
  const std::string m = exec::cuda::nccl_error_message(
      2, "all_reduce bf16 over {0,2}", "ncclAllReduce", ncclRemoteError, "peer 0 closed\nsocket\n");
  EXPECT_EQ(m.find('\n'), std::string::npos);
  EXPECT_EQ(
      m.rfind("rank 2: all_reduce bf16 over {0,2}: ncclAllReduce failed: ncclRemoteError: ", 0), 0u)
      << m;
  EXPECT_NE(m.find("(peer 0 closed socket)"), std::string::npos) << m;
  EXPECT_EQ(exec::cuda::nccl_error_message(0, "op", "ncclSend", ncclInvalidUsage, "")
                .find("ncclInvalidUsage"),
            std::string(std::string("rank 0: op: ncclSend failed: ")).size());
}
#endif

// ---------------------------------------------------------------- one GPU: local transport

struct Streams {
  std::vector<cudaStream_t> s;
  explicit Streams(int n) : s(std::size_t(n)) {
    for (auto& x : s)
      CUDA_CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  }
  ~Streams() {
    for (auto x : s)
      (void)cudaStreamDestroy(x);
  }
  cudaStream_t operator[](int i) const { return s[std::size_t(i)]; }
};

std::vector<unsigned char> bytes_of(const void* device, std::int64_t n) {
  return from_device<unsigned char>(device, n);
}

// Runs f(rank) on one thread per rank with the device current; rethrows the first failure.
template <class F>
void on_threads(int ranks, F f) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        CUDA_CHECK(cudaSetDevice(0));
        f(r);
      } catch (...) {
        errors[std::size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : threads)
    t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

TEST(LocalTransport, FifoPerChannelThreeRanks) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(64 << 20);
  LocalTransport t(arena, 3, 60);
  Streams streams(3);
  constexpr int K = 24;
  constexpr std::int64_t B = 4096 + 3;  // odd size: no alignment assumed
  // Rank 0 sends K activations and K gradients to rank 1, interleaved, and K activations to rank
  // 2; rank 2 also sends K activations to rank 1. The source buffer is overwritten on the stream
  // right after each send: the message must hold what it held at the send.
  DeviceBuffer rx1a(arena, Category::activations, K * B), rx1g(arena, Category::activations, K * B),
      rx1b(arena, Category::activations, K * B), rx2(arena, Category::activations, K * B);
  DeviceBuffer src0(arena, Category::activations, B), src2(arena, Category::activations, B);
  on_threads(3, [&](int r) {
    const cudaStream_t s = streams[r];
    auto* a = rx1a.as<unsigned char>();
    auto* g = rx1g.as<unsigned char>();
    auto* b = rx1b.as<unsigned char>();
    if (r == 0) {
      for (int i = 0; i < K; ++i) {
        CUDA_CHECK(cudaMemsetAsync(src0.data(), 1 + i, B, s));
        t.send(0, 1, Channel::activation, src0.data(), B, s);
        t.send(0, 2, Channel::activation, src0.data(), B, s);
        CUDA_CHECK(cudaMemsetAsync(src0.data(), 101 + i, B, s));
        t.send(0, 1, Channel::gradient, src0.data(), B, s);
      }
    } else if (r == 2) {
      for (int i = 0; i < K; ++i) {
        t.recv(0, 2, Channel::activation, rx2.as<unsigned char>() + i * B, B, s);
        CUDA_CHECK(cudaMemsetAsync(src2.data(), 201 - i, B, s));
        t.send(2, 1, Channel::activation, src2.data(), B, s);
      }
    } else {
      // Channels are independent: all gradients first, then the two activation sources.
      for (int i = 0; i < K; ++i)
        t.recv(0, 1, Channel::gradient, g + i * B, B, s);
      for (int i = 0; i < K; ++i) {
        t.recv(2, 1, Channel::activation, b + i * B, B, s);
        t.recv(0, 1, Channel::activation, a + i * B, B, s);
      }
    }
    t.synchronize(r, s, "test synchronize");
  });
  EXPECT_EQ(t.queued_messages(), 0);
  const auto a = bytes_of(rx1a.data(), K * B), g = bytes_of(rx1g.data(), K * B),
             b = bytes_of(rx1b.data(), K * B), c = bytes_of(rx2.data(), K * B);
  for (int i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < B; j += 997) {
      const std::size_t k = std::size_t(i * B + j);
      ASSERT_EQ(a[k], 1 + i) << "activation 0->1, message " << i;
      ASSERT_EQ(g[k], 101 + i) << "gradient 0->1, message " << i;
      ASSERT_EQ(b[k], 201 - i) << "activation 2->1, message " << i;
      ASSERT_EQ(c[k], 1 + i) << "activation 0->2, message " << i;
    }
  CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(LocalTransport, Bf16AndFp32PayloadsArriveBitExact) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(64 << 20);
  LocalTransport t(arena, 2, 60);
  Streams streams(2);
  const Vec f = randn(12345, 7), h = randn((1 << 20) + 7, 8);
  DeviceBuffer sf = to_device(arena, f), sh = to_device_bf16(arena, h);
  DeviceBuffer rf(arena, Category::activations, sf.bytes()),
      rh(arena, Category::activations, sh.bytes());
  on_threads(2, [&](int r) {
    if (r == 0) {
      t.send(0, 1, Channel::activation, sh.data(), sh.bytes(), streams[0]);
      t.send(0, 1, Channel::tied, sf.data(), sf.bytes(), streams[0]);
    } else {
      t.recv(0, 1, Channel::tied, rf.data(), rf.bytes(), streams[1]);
      t.recv(0, 1, Channel::activation, rh.data(), rh.bytes(), streams[1]);
    }
    t.synchronize(r, streams[r], "test synchronize");
  });
  const auto got_f = from_device<float>(rf.data(), std::int64_t(f.size()));
  EXPECT_EQ(std::memcmp(got_f.data(), f.data(), f.size() * sizeof(float)), 0);
  EXPECT_EQ(from_device_bf16(rh.data(), std::int64_t(h.size())), h);  // h is bf16-exact
  // A receive of the wrong size is a one-line error naming rank and op.
  t.send(0, 1, Channel::activation, sf.data(), 64, streams[0]);
  try {
    t.recv(0, 1, Channel::activation, rf.data(), 128, streams[1]);
    FAIL() << "size mismatch accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "rank 1: recv activation from 0: the message has 64 bytes, the receive buffer 128");
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(LocalTransport, AllReduceEqualsHostSumInGroupOrder) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(64 << 20);
  LocalTransport t(arena, 4, 60);
  Streams streams(4);
  const std::vector<int> group = {2, 0, 3};  // rank 1 is another stage
  const std::int64_t n = 100003;
  std::map<int, Vec> f, h;
  std::map<int, DeviceBuffer> df, dh;
  for (int r : group) {
    f[r] = randn(std::size_t(n), 10 + unsigned(r), 3.0f);
    h[r] = randn(std::size_t(n), 20 + unsigned(r), 3.0f);
    df[r] = to_device(arena, f[r]);
    dh[r] = to_device_bf16(arena, h[r]);
  }
  Vec want_f(std::size_t(n), 0.0f), want_h(std::size_t(n), 0.0f);
  for (int r : group)
    for (std::int64_t i = 0; i < n; ++i) {
      want_f[std::size_t(i)] += f[r][std::size_t(i)];  // fp32, group order, as the CPU transport
      want_h[std::size_t(i)] += h[r][std::size_t(i)];
    }
  round_in_place(want_h);  // one rounding of the fp32 sum
  on_threads(4, [&](int r) {
    if (r == 1) return;
    t.all_reduce_sum_fp32(group, r, df.at(r).as<float>(), n, streams[r]);
    t.all_reduce_sum_bf16(group, r, dh.at(r).as<bf16>(), n, streams[r]);
    // A second reduction of the same group matches by order: sums of the sums.
    t.all_reduce_sum_fp32(group, r, df.at(r).as<float>(), 1000, streams[r]);
    t.synchronize(r, streams[r], "test synchronize");
  });
  for (int r : group) {
    const Vec got_f = from_device<float>(df[r].data(), n);
    const Vec got_h = from_device_bf16(dh[r].data(), n);
    for (std::int64_t i = 0; i < n; ++i) {
      const float twice =
          i < 1000 ? (want_f[std::size_t(i)] + want_f[std::size_t(i)]) + want_f[std::size_t(i)]
                   : want_f[std::size_t(i)];
      ASSERT_EQ(got_f[std::size_t(i)], twice) << "rank " << r << " element " << i;
      ASSERT_EQ(got_h[std::size_t(i)], want_h[std::size_t(i)]) << "rank " << r << " element " << i;
    }
  }
  // A group of one is the identity and enqueues nothing.
  const Vec before = from_device<float>(df[2].data(), 16);
  t.all_reduce_sum_fp32({2}, 2, df[2].as<float>(), 16, streams[2]);
  EXPECT_EQ(from_device<float>(df[2].data(), 16), before);
}

// Reduce-scatter then all-gather over uneven parts (one empty) is the all-reduce: each owner's part
// is the group-order sum, bit for bit, the other members' elements untouched until the gather.
TEST(LocalTransport, ReduceScatterAndAllGatherFollowTheParts) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(64 << 20);
  LocalTransport t(arena, 4, 60);
  Streams streams(4);
  const std::vector<int> group = {2, 0, 3};
  const std::int64_t n = 100003;
  const std::vector<std::int64_t> bounds = {0, 50001, 50001, n};  // rank 0's part is empty
  std::map<int, Vec> f, h;
  std::map<int, DeviceBuffer> df, dh;
  for (int r : group) {
    f[r] = randn(std::size_t(n), 30 + unsigned(r), 3.0f);
    h[r] = randn(std::size_t(n), 40 + unsigned(r), 3.0f);
    df[r] = to_device(arena, f[r]);
    dh[r] = to_device_bf16(arena, h[r]);
  }
  Vec want_f(std::size_t(n), 0.0f), want_h(std::size_t(n), 0.0f);
  for (int r : group)
    for (std::int64_t i = 0; i < n; ++i) {
      want_f[std::size_t(i)] += f[r][std::size_t(i)];
      want_h[std::size_t(i)] += h[r][std::size_t(i)];
    }
  round_in_place(want_h);
  on_threads(4, [&](int r) {
    if (r == 1) return;
    t.reduce_scatter_sum(group, r, df.at(r).data(), bounds, exec::cuda::DType::fp32, streams[r]);
    t.reduce_scatter_sum(group, r, dh.at(r).data(), bounds, exec::cuda::DType::bf16, streams[r]);
    t.synchronize(r, streams[r], "test synchronize");
  });
  for (std::size_t k = 0; k < group.size(); ++k) {
    const int r = group[k];
    const Vec got_f = from_device<float>(df[r].data(), n);
    const Vec got_h = from_device_bf16(dh[r].data(), n);
    for (std::int64_t i = 0; i < n; ++i) {
      const bool own = i >= bounds[k] && i < bounds[k + 1];
      ASSERT_EQ(got_f[std::size_t(i)], own ? want_f[std::size_t(i)] : f[r][std::size_t(i)])
          << "rank " << r << " element " << i;
      ASSERT_EQ(got_h[std::size_t(i)], own ? want_h[std::size_t(i)] : h[r][std::size_t(i)])
          << "rank " << r << " element " << i;
    }
  }
  on_threads(4, [&](int r) {
    if (r == 1) return;
    t.all_gather(group, r, df.at(r).data(), bounds, exec::cuda::DType::fp32, streams[r]);
    t.all_gather(group, r, dh.at(r).data(), bounds, exec::cuda::DType::bf16, streams[r]);
    t.synchronize(r, streams[r], "test synchronize");
  });
  for (int r : group) {
    EXPECT_EQ(from_device<float>(df[r].data(), n), want_f) << "rank " << r;
    EXPECT_EQ(from_device_bf16(dh[r].data(), n), want_h) << "rank " << r;
  }
  // Bad parts are refused before anything is enqueued.
  EXPECT_THROW(t.all_gather(group, 2, df[2].data(), {0, 5}, exec::cuda::DType::fp32, streams[2]),
               Error);
}

TEST(LocalTransport, AbortWakesABlockedReceive) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(1 << 20);
  LocalTransport t(arena, 2, 120);
  Streams streams(2);
  DeviceBuffer buf(arena, Category::activations, 256);
  std::string what;
  std::thread receiver([&] {
    try {
      CUDA_CHECK(cudaSetDevice(0));
      t.recv(0, 1, Channel::gradient, buf.data(), 256, streams[1]);
    } catch (const Error& e) {
      what = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto t0 = std::chrono::steady_clock::now();
  t.abort();
  receiver.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  EXPECT_EQ(what, "transport aborted: rank 1: recv gradient from 0");
  EXPECT_THROW(t.send(0, 1, Channel::gradient, buf.data(), 256, streams[0]), Error);
}

TEST(LocalTransport, TimeoutThrowsOneLineErrorAndAborts) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(1 << 20);
  LocalTransport t(arena, 3, 0.2);
  Streams streams(3);
  DeviceBuffer buf(arena, Category::activations, 256);
  try {
    t.recv(2, 1, Channel::activation, buf.data(), 256, streams[1]);
    FAIL() << "no timeout";
  } catch (const TransportTimeout& e) {
    EXPECT_EQ(std::string(e.what()), "rank 1: recv activation from 2 timed out after 0.2s");
  }
  EXPECT_TRUE(t.aborted());
  try {
    t.all_reduce_sum_fp32({0, 2}, 0, buf.as<float>(), 64, streams[0]);
    FAIL() << "ran after the abort";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "transport aborted: rank 0: all_reduce fp32 over {0,2}");
  }
}

TEST(LocalTransport, StagingBlocksReturnToTheArena) {
  PW_SKIP_WITHOUT_GPU();
  DeviceArena arena(8 << 20);
  const std::int64_t used = arena.reserved_bytes();
  {
    LocalTransport t(arena, 2, 60);
    Streams streams(2);
    DeviceBuffer a(arena, Category::activations, 1 << 20), b(arena, Category::activations, 1 << 20);
    // 64 MiB through an 8 MiB arena: blocks must be recycled as the receiver's copies finish.
    for (int i = 0; i < 64; ++i) {
      t.send(0, 1, Channel::activation, a.data(), 1 << 20, streams[0]);
      t.recv(0, 1, Channel::activation, b.data(), 1 << 20, streams[1]);
    }
    t.synchronize(1, streams[1], "test synchronize");
    EXPECT_LE(t.staging_blocks(), 64);
  }
  EXPECT_EQ(arena.reserved_bytes(), used);
}

// ---------------------------------------------------------------- NCCL

#if PW_HAVE_NCCL
using exec::cuda::NcclTransport;

TEST(NcclTransport, SingleRankWorld) {
  PW_SKIP_WITHOUT_GPU();
  CUDA_CHECK(cudaSetDevice(0));
  DeviceArena arena(16 << 20);
  Streams streams(1);
  const ncclUniqueId id = exec::cuda::nccl_unique_id();
  NcclTransport t(id, 1, 0, {0}, 60);
  EXPECT_EQ(t.stage_members(), std::vector<int>{0});
  const Vec f = randn(4099, 3), h = randn(4099, 4);
  DeviceBuffer df = to_device(arena, f), dh = to_device_bf16(arena, h);
  t.all_reduce_sum_fp32({0}, 0, df.as<float>(), 4099, streams[0]);  // one member: identity
  t.all_reduce_sum_bf16({0}, 0, dh.as<bf16>(), 4099, streams[0]);
  t.reduce_scatter_sum({0}, 0, df.data(), {0, 4099}, exec::cuda::DType::fp32, streams[0]);
  t.all_gather({0}, 0, dh.data(), {0, 4099}, exec::cuda::DType::bf16, streams[0]);
  t.connect(Channel::tied, {0});
  // A send to itself is only possible grouped with its receive (all-to-all style).
  DeviceBuffer rx(arena, Category::activations, df.bytes());
  {
    exec::cuda::TransportGroup g(t);
    t.send(0, 0, Channel::tied, df.data(), df.bytes(), streams[0]);
    t.recv(0, 0, Channel::tied, rx.data(), rx.bytes(), streams[0]);
    g.end();
  }
  t.synchronize(0, streams[0], "test synchronize");
  EXPECT_EQ(from_device<float>(df.data(), 4099), f);
  EXPECT_EQ(from_device_bf16(dh.data(), 4099), h);
  EXPECT_EQ(from_device<float>(rx.data(), 4099), f);
  // Misuse is a one-line error naming the rank and the op, without an NCCL call.
  try {
    t.send(0, 0, Channel::activation, df.data(), 16, streams[0]);
    FAIL() << "ungrouped send to self";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("rank 0: send activation to 0 from 0, 16 bytes: ", 0), 0u)
        << e.what();
  }
  EXPECT_THROW(t.all_reduce_sum_fp32({0, 1}, 0, df.as<float>(), 16, streams[0]), Error);
}

// Two ranks, one thread and one GPU each, as two processes under mpirun would be: the ids are
// shared in memory instead of over MPI (ncclCommInitAll does the same from one thread; a thread per
// rank runs the transport's own constructor).
TEST(NcclTransport, TwoGpusP2pAllReduceAndDeadPeer) {
  PW_SKIP_WITHOUT_GPU();
  const int gpus = exec::cuda::cuda_device_count();
  if (gpus < 2) GTEST_SKIP() << "skipped: needs 2 CUDA devices, found " << gpus;
  constexpr int K = 8;
  constexpr std::int64_t n = 65537, B = n * 4;
  const ncclUniqueId pipe_id = exec::cuda::nccl_unique_id(),
                     replica_id = exec::cuda::nccl_unique_id(),
                     dead_id = exec::cuda::nccl_unique_id();
  const std::vector<Vec> part = {randn(std::size_t(n), 1), randn(std::size_t(n), 2)};
  std::vector<std::vector<unsigned char>> got(2);
  std::vector<Vec> tied(2), sum(2), gathered(2);
  std::vector<std::string> dead(2);
  std::atomic<bool> rank0_done{false};
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        CUDA_CHECK(cudaSetDevice(r));
        DeviceArena arena(64 << 20);
        Streams st(3);  // compute, send, recv
        const int peer = 1 - r;
        {
          // Two stages, one replica each: activations 0 -> 1 and gradients 1 -> 0 on their own
          // streams, then the grouped tied exchange.
          NcclTransport t(pipe_id, 2, r, {0, 1}, 60);
          t.connect(Channel::activation, {peer});
          t.connect(Channel::gradient, {peer});
          DeviceBuffer tx(arena, Category::activations, B), rx(arena, Category::activations, K * B);
          for (int i = 0; i < K; ++i) {
            void* slot = rx.as<unsigned char>() + i * B;
            if (r == 0) {
              CUDA_CHECK(cudaMemsetAsync(tx.data(), i + 1, B, st[1]));
              t.send(0, 1, Channel::activation, tx.data(), B, st[1]);
              t.recv(1, 0, Channel::gradient, slot, B, st[2]);
            } else {
              t.recv(0, 1, Channel::activation, slot, B, st[2]);
              CUDA_CHECK(cudaMemsetAsync(tx.data(), 100 + i, B, st[1]));
              t.send(1, 0, Channel::gradient, tx.data(), B, st[1]);
            }
          }
          t.synchronize(r, st[1], "test send stream");
          t.synchronize(r, st[2], "test recv stream");
          got[std::size_t(r)] = from_device<unsigned char>(rx.data(), K * B);
          DeviceBuffer mine = to_device(arena, part[std::size_t(r)]),
                       theirs(arena, Category::activations, B);
          exec::cuda::TransportGroup g(t);
          t.send(r, peer, Channel::tied, mine.data(), B, st[0]);
          t.recv(peer, r, Channel::tied, theirs.data(), B, st[0]);
          g.end();
          t.synchronize(r, st[0], "test tied");
          tied[std::size_t(r)] = from_device<float>(theirs.data(), n);
        }
        {
          // One stage, two replicas: the all-reduce of two parts (a + b == b + a: exact).
          NcclTransport t(replica_id, 2, r, {0, 0}, 60);
          DeviceBuffer d = to_device(arena, part[std::size_t(r)]);
          t.all_reduce_sum_fp32({0, 1}, r, d.as<float>(), n, st[0]);
          t.synchronize(r, st[0], "test all_reduce");
          sum[std::size_t(r)] = from_device<float>(d.data(), n);
          // The distributed optimizer's pair over uneven parts: the sum again.
          DeviceBuffer e = to_device(arena, part[std::size_t(r)]);
          const std::vector<std::int64_t> bounds = {0, n / 3, n};
          t.reduce_scatter_sum({0, 1}, r, e.data(), bounds, DType::fp32, st[0]);
          t.all_gather({0, 1}, r, e.data(), bounds, DType::fp32, st[0]);
          t.synchronize(r, st[0], "test reduce_scatter and all_gather");
          gathered[std::size_t(r)] = from_device<float>(e.data(), n);
        }
        {
          // A peer that stops answering: rank 0 waits for a gradient that never comes.
          NcclTransport t(dead_id, 2, r, {0, 1}, 2.0);
          t.connect(Channel::gradient, {peer});
          if (r == 0) {
            DeviceBuffer rx(arena, Category::activations, B);
            t.recv(1, 0, Channel::gradient, rx.data(), B, st[2]);
            try {
              t.synchronize(0, st[2], "wait for gradient");
            } catch (const TransportTimeout& e) {
              dead[0] = e.what();
            }
            EXPECT_TRUE(t.aborted());
            rank0_done = true;
          } else {
            while (!rank0_done)
              std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        }  // rank 1's finalize cannot complete: polled for 2 s, then aborted; no hang
      } catch (...) {
        errors[std::size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : threads)
    t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (int i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < B; j += 4099) {
      ASSERT_EQ(got[1][std::size_t(i * B + j)], i + 1) << "activation " << i;
      ASSERT_EQ(got[0][std::size_t(i * B + j)], 100 + i) << "gradient " << i;
    }
  EXPECT_EQ(tied[0], part[1]);
  EXPECT_EQ(tied[1], part[0]);
  for (std::int64_t i = 0; i < n; ++i) {
    const float want = part[0][std::size_t(i)] + part[1][std::size_t(i)];
    ASSERT_EQ(sum[0][std::size_t(i)], want) << i;
    ASSERT_EQ(sum[1][std::size_t(i)], want) << i;
    ASSERT_EQ(gathered[0][std::size_t(i)], want) << i;
    ASSERT_EQ(gathered[1][std::size_t(i)], want) << i;
  }
  EXPECT_EQ(dead[0], "rank 0: wait for gradient timed out after 2s");
}
#endif

}  // namespace
}  // namespace pw::testing
