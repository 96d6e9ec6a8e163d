// libFuzzer target: a run report (`validate --predicted/--measured FILE`, `sweep`'s inputs) (see
// fuzz_util.hpp and README "Fuzzing").
#include "fuzz/fuzz_util.hpp"
#include "planner/report.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = pw::fuzz::write_input(data, size, "report.json");
  return pw::fuzz::guarded([&] {
    const pw::planner::RunReport r =
        pw::planner::parse_report(pw::common::read_json_file(path), path);
    pw::fuzz::check_round_trip(
        pw::planner::to_json(r),
        [](const auto& j) { return pw::planner::parse_report(j, "written"); },
        [](const auto& s) { return pw::planner::to_json(s); }, "report");
    (void)pw::planner::describe_oom(r);
  });
}
