// libFuzzer target: a model file, read as `--model FILE` reads it (pipewright or Hugging Face
// format) (see fuzz_util.hpp and README "Fuzzing").
#include "fuzz/fuzz_util.hpp"
#include "models/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = pw::fuzz::write_input(data, size, "model.json");
  return pw::fuzz::guarded([&] {
    const pw::models::ModelSpec m = pw::models::load_model(path);
    pw::fuzz::check_round_trip(
        pw::models::to_json(m), [](const auto& j) { return pw::models::parse_model(j, "written"); },
        [](const auto& s) { return pw::models::to_json(s); }, "model");
    (void)pw::models::derive_costs(m);
  });
}
