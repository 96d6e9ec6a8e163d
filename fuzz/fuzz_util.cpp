// Shared parts of the libFuzzer targets (see fuzz_util.hpp).
#include "fuzz/fuzz_util.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <utility>
#include <vector>

namespace pw::fuzz {

namespace fs = std::filesystem;

namespace {

std::size_t g_input_size = 0;

std::string make_scratch_dir() {
  std::string base = "/tmp";
  if (::access("/dev/shm", W_OK) == 0)
    base = "/dev/shm";
  else if (const char* t = std::getenv("TMPDIR"); t != nullptr && *t != '\0')
    base = t;
  // Named by the process id: a run that crashed (no exit handler) leaves its directory, which the
  // next run removes once that process is gone.
  try {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(base, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("pw-fuzz-", 0) != 0) continue;
      const long pid = std::strtol(name.c_str() + 8, nullptr, 10);
      if (pid > 0 && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH) fs::remove_all(e.path(), ec);
    }
  } catch (const fs::filesystem_error&) {
    // Another process removed an entry meanwhile: nothing to clean up here.
  }
  std::string templ = base + "/pw-fuzz-" + std::to_string(::getpid()) + "-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) {
    std::perror("pw-fuzz: mkdtemp");
    std::abort();
  }
  return templ;
}

}  // namespace

const std::string& scratch_dir() {
  // Never destroyed: the exit handler that removes the directory runs after static destructors.
  static const std::string* dir = [] {
    auto* d = new std::string(make_scratch_dir());
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(scratch_dir(), ec);
    });
    return d;
  }();
  return *dir;
}

std::string write_input(const std::uint8_t* data, std::size_t size, const std::string& name) {
  g_input_size = size;
  const std::string path = scratch_dir() + "/" + name;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    std::perror(("pw-fuzz: " + path).c_str());
    std::abort();
  }
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) {
      std::perror(("pw-fuzz: write " + path).c_str());
      std::abort();
    }
    done += std::size_t(n);
  }
  ::close(fd);
  return path;
}

namespace {

struct KnownIssue {
  const char* message_part;  // in the escaping exception's what()
  const char* where;         // who fixes it
  long hits = 0;
};

// Findings in code another change of issue 13 rewrites; remove an entry once it is fixed there
// (its input in fuzz/regressions/ then proves the fix on every ctest run).
// None today: the first, 1e400 escaping common::parse_json as nlohmann's out_of_range.406, went
// when the reader learned to name it (fuzz/regressions/*/number-overflow-1e400.json prove it).
std::vector<KnownIssue> g_known;

bool strict() {
  static const bool s = [] {
    const char* e = std::getenv("PW_FUZZ_STRICT");
    return e != nullptr && *e != '\0' && *e != '0';
  }();
  return s;
}

}  // namespace

bool known_issue(const std::string& message) {
  if (strict()) return false;
  for (auto& k : g_known) {
    if (message.find(k.message_part) == std::string::npos) continue;
    static bool reporting = false;
    ++k.hits;
    if (!std::exchange(reporting, true))
      std::atexit([] {
        for (const auto& k : g_known)
          if (k.hits > 0)
            std::fprintf(stderr,
                         "pw-fuzz: known issue (not counted as a finding; %s): %ld inputs: %s\n",
                         k.where, k.hits, k.message_part);
      });
    return true;
  }
  return false;
}

void finding(const std::string& what) {
  std::fprintf(stderr, "pw-fuzz finding (input of %zu bytes): %s\n", g_input_size, what.c_str());
  std::fflush(stderr);
  std::abort();
}

const std::vector<ShardLayout>& shard_layout() {
  static const std::vector<ShardLayout> layout = {
      {"c0.w0", 6}, {"c0.w1", 6}, {"c0.m", 6}, {"c0.v", 6}};
  return layout;
}

common::Json shard_header() {
  return {{"format", "pipewright.checkpoint-shard/1"},
          {"rank", 0},
          {"stage", 0},
          {"replica", 0},
          {"step", kManifestStep},
          {"versions", {3, 4}}};
}

common::Json run_identity() {
  return {{"model", "gpt-tiny"},
          {"plan", {{"schedule", "2bw"}, {"w", 1}, {"d", 2}, {"b", 2}, {"m", 4}}},
          {"optimizer", {{"lr", 0.001}, {"beta1", 0.9}, {"beta2", 0.999}}},
          {"seed", 1},
          {"data", "synthetic"}};
}

}  // namespace pw::fuzz
