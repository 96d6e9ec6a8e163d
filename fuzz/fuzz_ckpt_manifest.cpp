// libFuzzer target: a checkpoint manifest (`train --resume`: the newest one found, checked against
// the run) (see fuzz_util.hpp and README "Fuzzing").
#include <filesystem>

#include "exec/checkpoint.hpp"
#include "fuzz/fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace fs = std::filesystem;
  const std::string dir = pw::fuzz::scratch_dir() + "/checkpoints";
  static const bool made = [&] {
    fs::create_directories(pw::exec::checkpoint_path(dir, pw::fuzz::kManifestStep));
    return true;
  }();
  (void)made;
  const std::string name =
      fs::path(pw::exec::checkpoint_path("checkpoints", pw::fuzz::kManifestStep)) / "manifest.json";
  pw::fuzz::write_input(data, size, name);
  return pw::fuzz::guarded([&] {
    const auto step = pw::exec::latest_checkpoint(dir);
    if (!step) pw::fuzz::finding("latest_checkpoint did not find the manifest");
    pw::exec::check_manifest(dir, *step, pw::fuzz::kManifestRanks, pw::fuzz::run_identity());
  });
}
