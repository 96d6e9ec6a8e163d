// libFuzzer target: a cluster file (`--cluster FILE`) (see fuzz_util.hpp and README "Fuzzing").
#include "clusters/cluster.hpp"
#include "fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = pw::fuzz::write_input(data, size, "cluster.json");
  return pw::fuzz::guarded([&] {
    const pw::clusters::Cluster c = pw::clusters::load_cluster(path);
    pw::fuzz::check_round_trip(
        pw::clusters::to_json(c),
        [](const auto& j) { return pw::clusters::parse_cluster(j, "written"); },
        [](const auto& s) { return pw::clusters::to_json(s); }, "cluster");
    (void)pw::clusters::describe(c);
  });
}
