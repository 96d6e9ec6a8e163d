// libFuzzer target: a device file (`--device FILE`, a cluster's "device": "FILE") (see
// fuzz_util.hpp and README "Fuzzing").
#include "clusters/device.hpp"
#include "fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = pw::fuzz::write_input(data, size, "device.json");
  return pw::fuzz::guarded([&] {
    const pw::clusters::DeviceSpec d = pw::clusters::load_device(path);
    pw::fuzz::check_round_trip(
        pw::clusters::to_json(d),
        [](const auto& j) {
          return pw::clusters::parse_device(pw::common::JsonReader(j, "written"));
        },
        [](const auto& s) { return pw::clusters::to_json(s); }, "device");
  });
}
