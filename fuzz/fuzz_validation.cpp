// libFuzzer target: `validate`: a predicted and a measured report (the input is the JSON array
// [predicted, measured]), compared and written (see fuzz_util.hpp and README "Fuzzing").
#include "fuzz/fuzz_util.hpp"
#include "planner/validation.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = pw::fuzz::write_input(data, size, "reports.json");
  return pw::fuzz::guarded([&] {
    const pw::common::Json j = pw::common::read_json_file(path);
    // The two-file form is the harness's, not pipewright's: other shapes are skipped.
    if (!j.is_array() || j.size() != 2) return;
    const auto predicted = pw::planner::parse_report(j[0], "predicted.json");
    const auto measured = pw::planner::parse_report(j[1], "measured.json");
    const pw::planner::Validation v =
        pw::planner::validate(predicted, measured, "predicted.json", "measured.json");
    (void)pw::planner::to_json(v).dump(2);
  });
}
