// Shared parts of the libFuzzer targets (fuzz/fuzz_*.cpp) and of the seed maker (make_seeds.cpp).
//
// Every reader is fuzzed through the entry point a user reaches: the input is written to a file
// and the file is read the way the command line reads it. A pw::Error (the one-line "file: /path:
// message" a bad input gets) is the expected outcome of a bad input; any other exception escaping
// a reader is a finding (it would be pipewright's exit-3 "internal error"): it is printed and the
// process aborts, which libFuzzer reports as a crash. Sanitizer reports, signals, timeouts and
// out-of-memory are findings too (libFuzzer's own detection).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/json_reader.hpp"

namespace pw::fuzz {

// A scratch directory of this process (in /dev/shm when it is writable, else $TMPDIR or /tmp),
// removed at exit.
const std::string& scratch_dir();

// Writes the input to <scratch_dir>/<name> (replacing it) and returns the path.
std::string write_input(const std::uint8_t* data, std::size_t size,
                        const std::string& name = "input.json");

// Prints `what` with the input's size and aborts (a finding).
[[noreturn]] void finding(const std::string& what);

// Known findings owned by another change (fuzz_util.cpp lists them, with the input that shows
// each in fuzz/regressions/): an escaping exception whose message contains one is counted, not a
// finding, so a campaign can go past it; each count is printed at exit. PW_FUZZ_STRICT=1 makes
// them findings again. Returns whether `message` is one.
bool known_issue(const std::string& message);

// Runs `body`: pw::Error returns quietly; any other exception is a finding (or a known issue).
template <typename F>
int guarded(F&& body) {
  try {
    body();
  } catch (const pw::Error&) {
  } catch (const std::exception& e) {
    if (!known_issue(e.what()))
      finding(std::string("uncaught non-pipewright exception: ") + e.what());
  } catch (...) {
    finding("uncaught exception of unknown type");
  }
  return 0;
}

// A writer's output must read back, and read back to the same document ("what pipewright writes,
// it reads"): `parse` re-reads `written`; a pw::Error there, or a different document, is a finding.
template <typename Parse, typename Write>
void check_round_trip(const common::Json& written, Parse&& parse, Write&& write, const char* what) {
  try {
    const common::Json again = write(parse(written));
    if (again != written)
      finding(std::string(what) + ": written, read back and written again differs:\n" +
              written.dump() + "\n" + again.dump());
  } catch (const pw::Error& e) {
    finding(std::string(what) + ": cannot read back what it wrote: " + e.what() + "\n" +
            written.dump());
  }
}

// The tensors fuzz_ckpt_shard expects in a shard (names and sizes as exec/worker.cpp writes them),
// and the run identity fuzz_ckpt_manifest checks a manifest against.
struct ShardLayout {
  std::string name;
  std::int64_t floats;
};
const std::vector<ShardLayout>& shard_layout();
common::Json shard_header();  // the header fields besides "tensors"
common::Json run_identity();
constexpr int kManifestStep = 4;
constexpr int kManifestRanks = 2;

}  // namespace pw::fuzz
