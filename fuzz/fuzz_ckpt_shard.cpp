// libFuzzer target: a checkpoint shard (`train --resume`): magic, header length, JSON header,
// tensors (see fuzz_util.hpp and README "Fuzzing").
#include <vector>

#include "exec/checkpoint.hpp"
#include "fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = pw::fuzz::write_input(data, size, "rank-00000.bin");
  const auto& layout = pw::fuzz::shard_layout();
  std::vector<std::vector<float>> buffers;
  std::vector<pw::exec::ShardTensor> tensors;
  for (const auto& t : layout)
    buffers.emplace_back(std::size_t(t.floats), 0.0f);
  for (std::size_t i = 0; i < layout.size(); ++i)
    tensors.push_back({layout[i].name, buffers[i].data(), layout[i].floats});
  pw::fuzz::guarded([&] { (void)pw::exec::read_shard(path, tensors); });
  // The tied-embedding slice read (the last stage takes stage 0's copy).
  return pw::fuzz::guarded([&] {
    float out[3];
    pw::exec::read_shard_slice(path, "c0.w1", 2, out, 3);
  });
}
