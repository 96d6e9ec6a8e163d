// Checkpoint shards and manifests (see checkpoint.hpp).
#include "exec/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "common/error.hpp"

namespace pw::exec {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'P', 'W', 'C', 'K', 'P', 'T', '0', '1'};
constexpr const char* kManifest = "manifest.json";

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

// A test hook: PIPEWRIGHT_TEST_KILL_IN_CHECKPOINT=<step> kills the process (SIGKILL, as a
// preemption would) half-way through rank 0's shard of that step.
bool kill_requested(const common::Json& header) {
  const char* env = std::getenv("PIPEWRIGHT_TEST_KILL_IN_CHECKPOINT");
  return env != nullptr && header.value("rank", -1) == 0 &&
         std::to_string(header.value("step", -1)) == env;
}

// Members of a JSON object read with their types checked: a missing member, one of another type
// or a value that is not an object gives `fallback` (the caller's mismatch error then names the
// file), never nlohmann's type_error (an "internal error").
std::string string_member(const common::Json& j, const char* key, const std::string& fallback) {
  if (!j.is_object()) return fallback;
  const auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : fallback;
}

std::int64_t int_member(const common::Json& j, const char* key, std::int64_t fallback) {
  if (!j.is_object()) return fallback;
  const auto it = j.find(key);
  return it != j.end() && it->is_number_integer() ? it->get<std::int64_t>() : fallback;
}

// Tensor sizes in a shard header: 0 to 2^40 floats (more than any device holds), so offsets in
// bytes never overflow.
constexpr std::int64_t kMaxTensorFloats = std::int64_t(1) << 40;

std::optional<int> step_of(const fs::path& entry) {
  const std::string name = entry.filename().string();
  if (name.size() != 13 || name.rfind("step-", 0) != 0) return std::nullopt;
  if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return std::stoi(name.substr(5));
}

}  // namespace

std::string checkpoint_path(const std::string& dir, int step) {
  return (fs::path(dir) / fmt::format("step-{:08d}", step)).string();
}

std::string shard_path(const std::string& checkpoint, int rank) {
  return (fs::path(checkpoint) / fmt::format("rank-{:05d}.bin", rank)).string();
}

std::optional<int> latest_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return std::nullopt;
  std::optional<int> best;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto step = step_of(entry.path());
    if (step && fs::exists(entry.path() / kManifest) && (!best || *step > *best)) best = step;
  }
  return best;
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
                    int keep) {
  common::Json m = common::Json::object();
  m["format"] = "pipewright.checkpoint/1";
  m["step"] = step;
  m["ranks"] = ranks;
  m["run"] = identity;
  const std::string path = checkpoint_path(dir, step);
  common::write_json_file((fs::path(path) / kManifest).string(), m);
  fsync_dir(path);
  // Keep the `keep` newest complete checkpoints; drop older ones, complete or not. A newer
  // incomplete one is another rank still writing (or a killed run's leftover, rewritten later).
  std::vector<int> complete;
  std::vector<fs::path> older_incomplete;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto s = step_of(entry.path());
    if (!s) continue;
    if (fs::exists(entry.path() / kManifest))
      complete.push_back(*s);
    else if (*s < step)
      older_incomplete.push_back(entry.path());
  }
  std::sort(complete.rbegin(), complete.rend());
  for (std::size_t i = std::size_t(std::max(keep, 1)); i < complete.size(); ++i)
    fs::remove_all(checkpoint_path(dir, complete[i]), ec);
  for (const auto& p : older_incomplete)
    fs::remove_all(p, ec);
}

void check_manifest(const std::string& dir, int step, int ranks, const common::Json& identity) {
  const std::string path = (fs::path(checkpoint_path(dir, step)) / kManifest).string();
  const common::Json m = common::read_json_file(path);
  if (string_member(m, "format", "") != "pipewright.checkpoint/1")
    throw InputError(fmt::format("{}: not a pipewright.checkpoint/1 manifest", path));
  if (int_member(m, "ranks", -1) != ranks)
    throw InputError(fmt::format("{}: field ranks: the checkpoint has {} ranks, this run {}", path,
                                 m.contains("ranks") ? m["ranks"].dump() : "none", ranks));
  const common::Json run = m.contains("run") ? m["run"] : common::Json::object();
  std::string field = "run";
  const common::Json* have = &run;
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

void write_shard(const std::string& path, common::Json header,
                 const std::vector<ShardTensor>& tensors) {
  common::Json list = common::Json::array();
  for (const auto& t : tensors)
    list.push_back({{"name", t.name}, {"floats", t.size}});
  header["tensors"] = list;
  const std::string text = header.dump();
  const fs::path target(path);
  fs::create_directories(target.parent_path());
  const std::string tmp =
      (target.parent_path() / fmt::format(".{}.tmp.{}", target.filename().string(), ::getpid()))
          .string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0)
    throw InputError(fmt::format("{}: cannot write checkpoint: {}", path, std::strerror(errno)));
  try {
    const std::uint64_t n = text.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i)
      len[i] = static_cast<unsigned char>(n >> (8 * i));
    write_all(fd, kMagic, sizeof kMagic, path);
    write_all(fd, len, sizeof len, path);
    write_all(fd, text.data(), text.size(), path);
    const bool kill = kill_requested(header);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (kill && i == tensors.size() / 2) {
        ::fsync(fd);
        std::raise(SIGKILL);
      }
      write_all(fd, tensors[i].data, std::size_t(tensors[i].size) * sizeof(float), path);
    }
    if (::fsync(fd) != 0)
      throw InputError(fmt::format("{}: fsync failed: {}", path, std::strerror(errno)));
  } catch (...) {
    ::close(fd);
    std::remove(tmp.c_str());
    throw;
  }
  ::close(fd);
  std::error_code ec;
  fs::rename(tmp, target, ec);
  if (ec) {
    std::remove(tmp.c_str());
    throw InputError(fmt::format("{}: cannot write checkpoint: {}", path, ec.message()));
  }
}

namespace {

// Opens a shard and reads its header; `in` is left at the first tensor's values.
common::Json read_header(const std::string& path, std::ifstream& in) {
  in.open(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot open checkpoint shard", path));
  char magic[8];
  unsigned char len[8];
  if (!in.read(magic, 8) || std::memcmp(magic, kMagic, 8) != 0 ||
      !in.read(reinterpret_cast<char*>(len), 8))
    throw InputError(fmt::format("{}: not a pipewright checkpoint shard", path));
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= std::uint64_t(len[i]) << (8 * i);
  // Checked against the file's size before allocating: a corrupt length costs nothing.
  std::error_code ec;
  const std::uintmax_t file_size = fs::file_size(path, ec);
  if (n > (std::uint64_t(1) << 30) || (!ec && n > file_size - 16))
    throw InputError(fmt::format("{}: corrupt shard header length {}", path, n));
  std::string text(n, '\0');
  if (!in.read(text.data(), std::streamsize(n)))
    throw InputError(fmt::format("{}: truncated shard header", path));
  common::Json header;
  try {
    header = common::Json::parse(text);
  } catch (const std::exception&) {
    throw InputError(fmt::format("{}: corrupt shard header", path));
  }
  return header;
}

}  // namespace

common::Json read_shard(const std::string& path, const std::vector<ShardTensor>& tensors) {
  std::ifstream in;
  const common::Json header = read_header(path, in);
  const common::Json& list = header.contains("tensors") ? header["tensors"] : common::Json();
  if (!list.is_array() || list.size() != tensors.size())
    throw InputError(fmt::format("{}: holds {} tensors, this run expects {}", path,
                                 list.is_array() ? list.size() : 0, tensors.size()));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (string_member(list[i], "name", "") != t.name || int_member(list[i], "floats", -1) != t.size)
      throw InputError(fmt::format("{}: tensor {} is {} ({} floats), this run expects {} ({})",
                                   path, i, string_member(list[i], "name", "?"),
                                   int_member(list[i], "floats", -1), t.name, t.size));
    if (!in.read(reinterpret_cast<char*>(t.data), std::streamsize(t.size * 4)))
      throw InputError(fmt::format("{}: truncated in tensor {}", path, t.name));
  }
  if (in.peek() != std::char_traits<char>::eof())
    throw InputError(fmt::format("{}: trailing bytes after the last tensor", path));
  return header;
}

void read_shard_slice(const std::string& path, const std::string& name, std::int64_t offset,
                      float* out, std::int64_t count) {
  std::ifstream in;
  const common::Json header = read_header(path, in);
  const common::Json& list = header.contains("tensors") ? header["tensors"] : common::Json();
  std::int64_t before = 0;  // floats ahead of the tensor
  for (std::size_t i = 0; list.is_array() && i < list.size(); ++i) {
    const std::int64_t floats = int_member(list[i], "floats", -1);
    if (floats < 0 || floats > kMaxTensorFloats || before > kMaxTensorFloats * 64)
      throw InputError(
          fmt::format("{}: corrupt shard header: tensor {} has no valid size", path, i));
    if (string_member(list[i], "name", "") != name) {
      before += floats;
      continue;
    }
    if (offset < 0 || count < 0 || offset + count > floats)
      throw InputError(fmt::format("{}: tensor {} has {} floats, this run reads [{}, {})", path,
                                   name, floats, offset, offset + count));
    in.seekg(std::streamoff((before + offset) * 4), std::ios::cur);
    if (!in.read(reinterpret_cast<char*>(out), std::streamsize(count * 4)))
      throw InputError(fmt::format("{}: truncated in tensor {}", path, name));
    return;
  }
  throw InputError(fmt::format("{}: holds no tensor {}", path, name));
}

}  // namespace pw::exec
