// libFuzzer target: a Hugging Face config.json, imported as a model (see fuzz_util.hpp and README
// "Fuzzing").
#include "fuzz/fuzz_util.hpp"
#include "models/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = pw::fuzz::write_input(data, size, "config.json");
  return pw::fuzz::guarded([&] {
    // Straight to the importer, whether or not the file looks like a Hugging Face config
    // (fuzz_model covers the choice between the two formats).
    const pw::common::Json j = pw::common::read_json_file(path);
    const pw::models::ModelSpec m = pw::models::import_hf_config(j, path, "fuzz-hf");
    pw::fuzz::check_round_trip(
        pw::models::to_json(m), [](const auto& s) { return pw::models::parse_model(s, "written"); },
        [](const auto& s) { return pw::models::to_json(s); }, "imported model");
    (void)pw::models::derive_costs(m);
  });
}
