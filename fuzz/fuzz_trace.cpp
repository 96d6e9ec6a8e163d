// libFuzzer target: a trace file (`--trace FILE`) (see fuzz_util.hpp and README "Fuzzing").
#include "fuzz/fuzz_util.hpp"
#include "traces/trace.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = pw::fuzz::write_input(data, size, "trace.json");
  return pw::fuzz::guarded([&] {
    const pw::traces::Trace t = pw::traces::read_trace(path);
    pw::fuzz::check_round_trip(
        pw::traces::to_json(t), [](const auto& j) { return pw::traces::parse_trace(j, "written"); },
        [](const auto& s) { return pw::traces::to_json(s); }, "trace");
  });
}
