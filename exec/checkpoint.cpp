// Checkpoint shards and manifests (see checkpoint.hpp).
#include "exec/checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string_view>

#include <fmt/format.h>

#include "common/error.hpp"

namespace pw::exec {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'P', 'W', 'C', 'K', 'P', 'T', '0', '2'};
constexpr char kOldMagic[8] = {'P', 'W', 'C', 'K', 'P', 'T', '0', '1'};
constexpr const char* kShardFormat = "pipewright.checkpoint-shard/2";
constexpr const char* kManifest = "manifest.json";
constexpr std::size_t kPrefix = 20;  // magic, header length, their CRC-32
// The manifest ends with `,\n  "crc32": "xxxxxxxx"\n}\n`; the CRC covers every byte before it.
constexpr std::string_view kCrcLead = ",\n  \"crc32\": \"";
constexpr std::string_view kCrcTail = "\"\n}\n";
constexpr std::size_t kCrcTrailer = kCrcLead.size() + 8 + kCrcTail.size();

// A checkpoint written by an older pipewright: an error, not a damaged checkpoint to skip.
class OldCheckpoint : public InputError {
 public:
  using InputError::InputError;
};

std::uint32_t crc32_of(const void* data, std::size_t n, std::uint32_t crc = 0) {
  return std::uint32_t(::crc32_z(crc, static_cast<const Bytef*>(data), n));
}

std::string hex(std::uint32_t crc) {
  return fmt::format("{:08x}", crc);
}

// Parses 8 lowercase hex digits; nullopt otherwise.
std::optional<std::uint32_t> parse_hex(std::string_view s) {
  if (s.size() != 8) return std::nullopt;
  std::uint32_t v = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return std::nullopt;
    v = v << 4 | std::uint32_t(d);
  }
  return v;
}

void put_u64(unsigned char* out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u32(unsigned char* out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i)
    out[i] = static_cast<unsigned char>(v >> (8 * i));
}
std::uint64_t get_u64(const unsigned char* in) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= std::uint64_t(in[i]) << (8 * i);
  return v;
}
std::uint32_t get_u32(const unsigned char* in) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= std::uint32_t(in[i]) << (8 * i);
  return v;
}

// Writes `n` bytes or throws naming `path`.
void write_all(int fd, const void* data, std::size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::write(fd, p, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      throw InputError(fmt::format("{}: write failed: {}", path, std::strerror(errno)));
    }
    p += k;
    n -= std::size_t(k);
  }
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Writes a file atomically and durably: `fill(fd)` writes a temporary file beside `path`, which is
// fsynced and renamed over it; on any failure the temporary is removed and `path` is untouched.
template <typename Fill>
void write_durably(const std::string& path, const char* what, Fill&& fill) {
  const fs::path target(path);
  std::error_code ec;
  fs::create_directories(target.parent_path(), ec);
  const std::string tmp =
      (target.parent_path() / fmt::format(".{}.tmp.{}", target.filename().string(), ::getpid()))
          .string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0)
    throw InputError(fmt::format("{}: cannot write {}: {}", path, what, std::strerror(errno)));
  try {
    fill(fd);
    if (::fsync(fd) != 0)
      throw InputError(fmt::format("{}: fsync failed: {}", path, std::strerror(errno)));
  } catch (...) {
    ::close(fd);
    std::remove(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    std::remove(tmp.c_str());
    throw InputError(fmt::format("{}: cannot write {}: {}", path, what, std::strerror(errno)));
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    std::remove(tmp.c_str());
    throw InputError(fmt::format("{}: cannot write {}: {}", path, what, ec.message()));
  }
  fsync_dir(target.parent_path());
}

// A test hook: PIPEWRIGHT_TEST_KILL_IN_CHECKPOINT=<step> kills the process (SIGKILL, as a
// preemption would) half-way through rank 0's shard of that step.
bool kill_requested(const common::Json& header) {
  const char* env = std::getenv("PIPEWRIGHT_TEST_KILL_IN_CHECKPOINT");
  return env != nullptr && header.value("rank", -1) == 0 &&
         std::to_string(header.value("step", -1)) == env;
}

std::optional<int> step_of(const fs::path& entry) {
  const std::string name = entry.filename().string();
  if (name.size() != 13 || name.rfind("step-", 0) != 0) return std::nullopt;
  if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return std::stoi(name.substr(5));
}

// The steps in `dir` whose manifest exists, newest first.
std::vector<int> complete_steps(const std::string& dir) {
  std::vector<int> steps;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return steps;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto step = step_of(entry.path());
    if (step && fs::exists(entry.path() / kManifest, ec)) steps.push_back(*step);
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::string read_file(const std::string& path, const char* what) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw InputError(fmt::format("{}: missing {} (or not a regular file)", path, what));
  std::ifstream in(path, std::ios::binary);
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (!in.good() && !in.eof()) throw InputError(fmt::format("{}: cannot read {}", path, what));
  return text;
}

// A shard opened for reading: its prefix and header checked (both CRCs, the tensor list, the
// file's size), the stream at the first tensor's values.
struct TensorEntry {
  std::string name;
  std::int64_t floats = 0;
  std::uint32_t crc = 0;
  std::uint64_t offset = 0;  // of its first byte in the file
};

class ShardFile {
 public:
  explicit ShardFile(const std::string& path) : path_(path) {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec))
      throw InputError(fmt::format("{}: missing checkpoint shard (or not a regular file)", path));
    const std::uintmax_t size = fs::file_size(path, ec);
    if (ec) throw InputError(fmt::format("{}: cannot read checkpoint shard", path));
    in_.open(path, std::ios::binary);
    if (!in_) throw InputError(fmt::format("{}: cannot open checkpoint shard", path));
    unsigned char prefix[kPrefix];
    if (size < kPrefix || !in_.read(reinterpret_cast<char*>(prefix), kPrefix))
      throw InputError(fmt::format("{}: not a pipewright checkpoint shard (truncated)", path));
    if (std::memcmp(prefix, kOldMagic, 8) == 0)
      throw OldCheckpoint(fmt::format(
          "{}: a checkpoint of an older format (pipewright.checkpoint/1, without checksums) that "
          "this version does not read; start a fresh run in another --checkpoint-dir",
          path));
    if (std::memcmp(prefix, kMagic, 8) != 0)
      throw InputError(fmt::format("{}: not a pipewright checkpoint shard (bad magic)", path));
    if (get_u32(prefix + 16) != crc32_of(prefix, 16))
      throw InputError(fmt::format("{}: damaged: header length checksum mismatch", path));
    const std::uint64_t n = get_u64(prefix + 8);
    if (n > std::min<std::uintmax_t>(std::uint64_t(1) << 30, size - kPrefix) ||
        size - kPrefix - n < 4)
      throw InputError(fmt::format("{}: truncated: header of {} bytes in a file of {}", path, n,
                                   std::uint64_t(size)));
    std::string text(n, '\0');
    unsigned char crc[4];
    if (!in_.read(text.data(), std::streamsize(n)) || !in_.read(reinterpret_cast<char*>(crc), 4))
      throw InputError(fmt::format("{}: truncated shard header", path));
    if (get_u32(crc) != crc32_of(text.data(), text.size()))
      throw InputError(fmt::format("{}: damaged: header checksum mismatch", path));
    header_ = common::parse_json(text, path);
    const common::JsonReader r(header_, path);
    r.expect_format(kShardFormat);
    step_ = r.get_nonnegative_int("step");
    rank_ = r.get_nonnegative_int("rank");
    const common::JsonReader list = r.at("tensors");
    std::uint64_t offset = kPrefix + n + 4;
    for (std::size_t i = 0; i < list.size(); ++i) {
      const common::JsonReader t = list.at(i);
      TensorEntry e;
      e.name = t.get_string("name");
      e.floats = t.get_nonnegative_int("floats");
      const auto c = parse_hex(t.get_string("crc32"));
      if (!c) t.fail_member("crc32", "expected 8 lowercase hex digits");
      e.crc = *c;
      e.offset = offset;
      if (std::uint64_t(e.floats) > (size - offset) / 4)
        throw InputError(fmt::format("{}: truncated in tensor {}: {} bytes, the header lists more",
                                     path, e.name, std::uint64_t(size)));
      offset += std::uint64_t(e.floats) * 4;
      tensors_.push_back(e);
    }
    if (offset != size)
      throw InputError(fmt::format("{}: {} trailing bytes after the last tensor", path,
                                   std::uint64_t(size) - offset));
  }

  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  const common::Json& header() const { return header_; }
  std::int64_t step() const { return step_; }
  std::int64_t rank() const { return rank_; }

  // Reads tensor `i` into `out` (its whole size) and checks its CRC.
  void read(std::size_t i, float* out) {
    const TensorEntry& e = tensors_[i];
    in_.seekg(std::streamoff(e.offset));
    if (!in_.read(reinterpret_cast<char*>(out), std::streamsize(e.floats * 4)))
      throw InputError(fmt::format("{}: truncated in tensor {}", path_, e.name));
    check(e, crc32_of(out, std::size_t(e.floats) * 4));
  }

  // Reads tensor `i` in pieces, only to check its CRC.
  void verify(std::size_t i) {
    const TensorEntry& e = tensors_[i];
    in_.seekg(std::streamoff(e.offset));
    std::vector<char> buf(std::size_t(1) << 20);
    std::uint64_t left = std::uint64_t(e.floats) * 4;
    std::uint32_t crc = 0;
    while (left > 0) {
      const std::size_t k = std::size_t(std::min<std::uint64_t>(left, buf.size()));
      if (!in_.read(buf.data(), std::streamsize(k)))
        throw InputError(fmt::format("{}: truncated in tensor {}", path_, e.name));
      crc = crc32_of(buf.data(), k, crc);
      left -= k;
    }
    check(e, crc);
  }

 private:
  void check(const TensorEntry& e, std::uint32_t crc) const {
    if (crc != e.crc)
      throw InputError(fmt::format("{}: damaged: tensor {}: checksum {} read, {} stored", path_,
                                   e.name, hex(crc), hex(e.crc)));
  }

  std::string path_;
  std::ifstream in_;
  common::Json header_;
  std::int64_t step_ = 0, rank_ = 0;
  std::vector<TensorEntry> tensors_;
};

}  // namespace

std::string checkpoint_path(const std::string& dir, int step) {
  return (fs::path(dir) / fmt::format("step-{:08d}", step)).string();
}

std::string shard_path(const std::string& checkpoint, int rank) {
  return (fs::path(checkpoint) / fmt::format("rank-{:05d}.bin", rank)).string();
}

std::optional<int> latest_checkpoint(const std::string& dir) {
  const std::vector<int> steps = complete_steps(dir);
  if (steps.empty()) return std::nullopt;
  return steps.front();
}

void remove_incomplete_checkpoints(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  std::vector<fs::path> doomed;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (step_of(entry.path()) && !fs::exists(entry.path() / kManifest))
      doomed.push_back(entry.path());
  for (const auto& p : doomed)
    fs::remove_all(p, ec);
}

void write_manifest(const std::string& dir, int step, int ranks, const common::Json& identity,
                    int keep, const common::Json& result) {
  common::Json m = common::Json::object();
  m["format"] = kCheckpointFormat;
  m["step"] = step;
  m["ranks"] = ranks;
  m["run"] = identity;
  if (!result.is_null()) m["result"] = result;
  std::string text = m.dump(2);  // ends with "\n}"
  text.resize(text.size() - 2);
  text += fmt::format("{}{}{}", kCrcLead, hex(crc32_of(text.data(), text.size())), kCrcTail);
  const std::string path = checkpoint_path(dir, step);
  write_durably((fs::path(path) / kManifest).string(), "checkpoint manifest",
                [&](int fd) { write_all(fd, text.data(), text.size(), path); });
  // Keep the `keep` newest complete checkpoints; drop older ones, complete or not. A newer
  // incomplete one is another rank still writing (or a killed run's leftover, rewritten later).
  std::vector<fs::path> older_incomplete;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto s = step_of(entry.path());
    if (s && *s < step && !fs::exists(entry.path() / kManifest)) older_incomplete.push_back(entry);
  }
  const std::vector<int> complete = complete_steps(dir);
  for (std::size_t i = std::size_t(std::max(keep, 1)); i < complete.size(); ++i)
    fs::remove_all(checkpoint_path(dir, complete[i]), ec);
  for (const auto& p : older_incomplete)
    fs::remove_all(p, ec);
}

Manifest read_manifest(const std::string& dir, int step) {
  Manifest out;
  out.path = (fs::path(checkpoint_path(dir, step)) / kManifest).string();
  const std::string& path = out.path;
  const std::string text = read_file(path, "checkpoint manifest");
  const std::size_t n = text.size();
  const bool framed = n >= kCrcTrailer &&
                      text.compare(n - kCrcTail.size(), kCrcTail.size(), kCrcTail) == 0 &&
                      text.compare(n - kCrcTrailer, kCrcLead.size(), kCrcLead) == 0;
  if (!framed) {
    try {
      if (common::Json::parse(text).value("format", "") == "pipewright.checkpoint/1")
        throw OldCheckpoint(fmt::format(
            "{}: a checkpoint of an older format (pipewright.checkpoint/1, without checksums) "
            "that this version does not read; start a fresh run in another --checkpoint-dir",
            path));
    } catch (const common::Json::exception&) {
    }
    throw InputError(fmt::format("{}: damaged: no checksum at its end", path));
  }
  const auto stored = parse_hex(std::string_view(text).substr(n - 8 - kCrcTail.size(), 8));
  if (!stored) throw InputError(fmt::format("{}: damaged: its checksum is not 8 hex digits", path));
  const std::uint32_t crc = crc32_of(text.data(), n - kCrcTrailer);
  if (crc != *stored)
    throw InputError(
        fmt::format("{}: damaged: checksum {} read, {} stored", path, hex(crc), hex(*stored)));
  const common::Json m = common::parse_json(text, path);
  const common::JsonReader r(m, path);
  r.expect_format(kCheckpointFormat);
  const std::int64_t s = r.get_nonnegative_int("step");
  if (s != step)
    r.fail_member("step", fmt::format("{}, but the checkpoint's folder is of step {}", s, step));
  out.step = step;
  const std::int64_t ranks = r.get_positive_int("ranks");
  if (ranks > (std::int64_t(1) << 24)) r.fail_member("ranks", fmt::format("{} is too many", ranks));
  out.ranks = int(ranks);
  const common::JsonReader run = r.at("run");
  if (!run.value().is_object()) run.fail(fmt::format("expected an object"));
  out.run = run.value();
  if (const auto result = r.find("result")) {
    if (!result->value().is_object()) result->fail("expected an object");
    out.result = result->value();
  }
  return out;
}

void check_manifest(const Manifest& manifest, int ranks, const common::Json& identity) {
  const std::string& path = manifest.path;
  if (manifest.ranks != ranks)
    throw InputError(fmt::format("{}: field ranks: the checkpoint has {} ranks, this run {}", path,
                                 manifest.ranks, ranks));
  std::string field = "run";
  const common::Json* have = &manifest.run;
  const common::Json* want = &identity;
  // Descend to the first differing leaf, so the error names e.g. run.optimizer.lr.
  while (*have != *want && have->is_object() && want->is_object()) {
    const common::Json* next_have = nullptr;
    const common::Json* next_want = nullptr;
    std::string key;
    for (const auto& [k, v] : want->items())
      if (!have->contains(k) || (*have)[k] != v) {
        key = k;
        next_want = &v;
        next_have = have->contains(k) ? &(*have)[k] : nullptr;
        break;
      }
    if (next_want == nullptr) break;
    field += "." + key;
    want = next_want;
    if (next_have == nullptr) {
      have = nullptr;
      break;
    }
    have = next_have;
  }
  if (have == nullptr || *have != *want)
    throw InputError(fmt::format(
        "{}: field {}: the checkpoint was written with {}, this run has {}; resume with the same "
        "settings or use another --checkpoint-dir",
        path, field, have ? have->dump() : "nothing", want->dump()));
}

void check_manifest(const std::string& dir, int step, int ranks, const common::Json& identity) {
  check_manifest(read_manifest(dir, step), ranks, identity);
}

std::optional<std::string> verify_checkpoint(const std::string& dir, int step) {
  try {
    const Manifest m = read_manifest(dir, step);
    for (int r = 0; r < m.ranks; ++r) {
      const std::string path = shard_path(checkpoint_path(dir, step), r);
      ShardFile shard(path);
      if (shard.step() != step || shard.rank() != r)
        return fmt::format("{}: damaged: its header says rank {} of step {}", path, shard.rank(),
                           shard.step());
      for (std::size_t i = 0; i < shard.tensors().size(); ++i)
        shard.verify(i);
    }
    return std::nullopt;
  } catch (const OldCheckpoint&) {
    throw;
  } catch (const InputError& e) {
    return std::string(e.what());
  }
}

ResumePoint find_resume_point(const std::string& dir, bool tidy) {
  ResumePoint out;
  std::vector<std::pair<int, std::string>> damaged;
  for (int step : complete_steps(dir)) {
    if (auto problem = verify_checkpoint(dir, step)) {
      damaged.emplace_back(step, std::move(*problem));
      continue;
    }
    out.step = step;
    break;
  }
  const std::string then = out.step
                               ? fmt::format("resuming from {}", checkpoint_path(dir, *out.step))
                               : std::string("no intact checkpoint left: starting from step 0");
  for (const auto& [step, problem] : damaged) {
    const std::string from = checkpoint_path(dir, step), to = from + ".damaged";
    std::string kept;
    if (tidy) {
      std::error_code ec;
      fs::remove_all(to, ec);
      fs::rename(from, to, ec);
      if (!ec) kept = fmt::format(" (kept as {})", fs::path(to).filename().string());
    }
    out.warnings.push_back(
        fmt::format("warning: {}: skipping that checkpoint{}; {}", problem, kept, then));
  }
  return out;
}

void write_shard(const std::string& path, common::Json header,
                 const std::vector<ShardTensor>& tensors) {
  common::Json list = common::Json::array();
  for (const auto& t : tensors)
    list.push_back({{"name", t.name},
                    {"floats", t.size},
                    {"crc32", hex(crc32_of(t.data, std::size_t(t.size) * sizeof(float)))}});
  header["format"] = kShardFormat;
  header["tensors"] = list;
  const std::string text = header.dump();
  unsigned char prefix[kPrefix], crc[4];
  std::memcpy(prefix, kMagic, 8);
  put_u64(prefix + 8, text.size());
  put_u32(prefix + 16, crc32_of(prefix, 16));
  put_u32(crc, crc32_of(text.data(), text.size()));
  write_durably(path, "checkpoint", [&](int fd) {
    write_all(fd, prefix, sizeof prefix, path);
    write_all(fd, text.data(), text.size(), path);
    write_all(fd, crc, sizeof crc, path);
    const bool kill = kill_requested(header);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (kill && i == tensors.size() / 2) {
        ::fsync(fd);
        std::raise(SIGKILL);
      }
      write_all(fd, tensors[i].data, std::size_t(tensors[i].size) * sizeof(float), path);
    }
  });
}

common::Json read_shard(const std::string& path, const std::vector<ShardTensor>& tensors) {
  ShardFile shard(path);
  const auto& list = shard.tensors();
  if (list.size() != tensors.size())
    throw InputError(fmt::format("{}: holds {} tensors, this run expects {}", path, list.size(),
                                 tensors.size()));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (list[i].name != t.name || list[i].floats != t.size)
      throw InputError(fmt::format("{}: tensor {} is {} ({} floats), this run expects {} ({})",
                                   path, i, list[i].name, list[i].floats, t.name, t.size));
    shard.read(i, t.data);
  }
  return shard.header();
}

ShardLayout::ShardLayout(const std::vector<std::int64_t>& parameters, std::vector<int> versions,
                         std::vector<std::string> state,
                         const std::vector<std::int64_t>& state_sizes)
    : versions_(std::move(versions)), state_(std::move(state)), chunks_(parameters.size()) {
  if (state_sizes.size() != parameters.size())
    throw Error(fmt::format("checkpoint shard: {} state sizes for {} model chunks",
                            state_sizes.size(), parameters.size()));
  for (std::size_t i = 0; i < chunks_; ++i) {
    for (int version : versions_)
      tensors_.push_back({fmt::format("c{}.w{}", i, version), nullptr, parameters[i]});
    for (const std::string& name : state_)
      tensors_.push_back({fmt::format("c{}.{}", i, name), nullptr, state_sizes[i]});
  }
}

std::size_t ShardLayout::index(std::size_t chunk, std::size_t k) const {
  if (chunk >= chunks_ || k >= versions_.size() + state_.size())
    throw Error(fmt::format("checkpoint shard: no tensor {} of model chunk {} ({} chunks of {})", k,
                            chunk, chunks_, versions_.size() + state_.size()));
  return chunk * (versions_.size() + state_.size()) + k;
}

ShardTensor& ShardLayout::weights(std::size_t chunk, std::size_t i) {
  if (i >= versions_.size()) throw Error(fmt::format("checkpoint shard: no version {}", i));
  return tensors_[index(chunk, i)];
}
ShardTensor& ShardLayout::state(std::size_t chunk, std::size_t which) {
  if (which >= state_.size()) throw Error(fmt::format("checkpoint shard: no state {}", which));
  return tensors_[index(chunk, versions_.size() + which)];
}
const ShardTensor& ShardLayout::weights(std::size_t chunk, std::size_t i) const {
  return const_cast<ShardLayout*>(this)->weights(chunk, i);
}
const ShardTensor& ShardLayout::state(std::size_t chunk, std::size_t which) const {
  return const_cast<ShardLayout*>(this)->state(chunk, which);
}

void ShardLayout::zero_tied_copy(std::size_t chunk, std::int64_t offset, std::int64_t size,
                                 std::vector<std::vector<float>>* copies) {
  if (copies) copies->reserve(copies->size() + versions_.size());  // no reallocation below
  for (std::size_t i = 0; i < versions_.size(); ++i) {
    ShardTensor& t = weights(chunk, i);
    if (offset < 0 || size < 0 || offset + size > t.size || !t.data)
      throw Error(fmt::format("checkpoint shard: tied copy [{}, {}) outside {} ({} floats)", offset,
                              offset + size, t.name, t.size));
    if (copies) {
      copies->emplace_back(t.data, t.data + t.size);
      t.data = copies->back().data();
    }
    std::fill_n(t.data + offset, size, 0.0f);
  }
}

void ShardLayout::read_tied_copy(std::size_t chunk, std::int64_t offset, std::int64_t size,
                                 const std::string& source, std::int64_t source_offset) {
  for (std::size_t i = 0; i < versions_.size(); ++i) {
    ShardTensor& t = weights(chunk, i);
    if (offset < 0 || size < 0 || offset + size > t.size || !t.data)
      throw Error(fmt::format("checkpoint shard: tied copy [{}, {}) outside {} ({} floats)", offset,
                              offset + size, t.name, t.size));
    read_shard_slice(source, fmt::format("c0.w{}", versions_[i]), source_offset, t.data + offset,
                     size);
  }
}

void read_shard_slice(const std::string& path, const std::string& name, std::int64_t offset,
                      float* out, std::int64_t count) {
  ShardFile shard(path);
  const auto& list = shard.tensors();
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (list[i].name != name) continue;
    const std::int64_t floats = list[i].floats;
    if (offset < 0 || count < 0 || offset > floats || count > floats - offset)
      throw InputError(fmt::format("{}: tensor {} has {} floats, this run reads [{}, {})", path,
                                   name, floats, offset, offset + count));
    std::vector<float> whole(static_cast<std::size_t>(floats));
    shard.read(i, whole.data());
    std::copy_n(whole.begin() + offset, count, out);
    return;
  }
  throw InputError(fmt::format("{}: holds no tensor {}", path, name));
}

}  // namespace pw::exec
