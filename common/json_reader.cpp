// Strict JSON reading with file + JSON-path context, and atomic JSON writing.
#include "common/json_reader.hpp"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <cerrno>
#include <cstring>
#include <unordered_set>

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/limits.hpp"

namespace pw::common {

namespace {

const char* type_name(const Json& v) {
  return v.type_name();
}

std::string child_path(const std::string& path, const std::string& key) {
  return path + "/" + key;
}

}  // namespace

void JsonReader::fail(const std::string& message) const {
  throw InputError(fmt::format("{}: {}: {}", source_, path(), message));
}

void JsonReader::fail_member(const std::string& key, const std::string& message) const {
  throw InputError(fmt::format("{}: {}: {}", source_, child_path(path_, key), message));
}

void JsonReader::require_object() const {
  if (!value_->is_object()) fail(fmt::format("expected an object, found {}", type_name(*value_)));
}

bool JsonReader::has(const std::string& key) const {
  return value_->is_object() && value_->contains(key);
}

JsonReader JsonReader::at(const std::string& key) const {
  require_object();
  auto it = value_->find(key);
  if (it == value_->end()) fail_member(key, "missing required field");
  return JsonReader(*it, source_, child_path(path_, key));
}

std::optional<JsonReader> JsonReader::find(const std::string& key) const {
  require_object();
  auto it = value_->find(key);
  if (it == value_->end() || it->is_null()) return std::nullopt;
  return JsonReader(*it, source_, child_path(path_, key));
}

JsonReader JsonReader::at(std::size_t index) const {
  if (!value_->is_array()) fail(fmt::format("expected an array, found {}", type_name(*value_)));
  if (index >= value_->size()) fail(fmt::format("index {} out of range", index));
  return JsonReader((*value_)[index], source_, child_path(path_, std::to_string(index)));
}

std::size_t JsonReader::size() const {
  if (!value_->is_array()) fail(fmt::format("expected an array, found {}", type_name(*value_)));
  return value_->size();
}

std::string JsonReader::as_string() const {
  if (!value_->is_string()) fail(fmt::format("expected a string, found {}", type_name(*value_)));
  return value_->get<std::string>();
}

double JsonReader::as_number() const {
  if (!value_->is_number()) fail(fmt::format("expected a number, found {}", type_name(*value_)));
  double v = value_->get<double>();
  if (!std::isfinite(v)) fail("expected a finite number");
  return v;
}

std::int64_t JsonReader::as_int() const {
  if (value_->is_number_unsigned()) {
    const auto u = value_->get<std::uint64_t>();
    if (u > std::uint64_t(INT64_MAX)) fail(fmt::format("{} is too large", u));
    return std::int64_t(u);
  }
  if (value_->is_number_integer()) return value_->get<std::int64_t>();
  double v = as_number();
  if (v != std::floor(v) || std::fabs(v) > 9.0e18)
    fail(fmt::format("expected an integer, found {}", v));
  return static_cast<std::int64_t>(v);
}

std::int64_t JsonReader::as_int_in(std::int64_t lo, std::int64_t hi) const {
  const std::int64_t v = as_int();
  if (v < lo && lo == 0) fail(fmt::format("must not be negative, found {}", v));
  if (v < lo && lo == 1) fail(fmt::format("must be at least 1, found {}", v));
  if (v < lo || v > hi) fail(fmt::format("must be in {} .. {}, found {}", lo, hi, v));
  return v;
}

bool JsonReader::as_bool() const {
  if (!value_->is_boolean())
    fail(fmt::format("expected true or false, found {}", type_name(*value_)));
  return value_->get<bool>();
}

std::string JsonReader::get_string(const std::string& key) const {
  return at(key).as_string();
}
double JsonReader::get_number(const std::string& key) const {
  return at(key).as_number();
}
std::int64_t JsonReader::get_int(const std::string& key) const {
  return at(key).as_int();
}
bool JsonReader::get_bool(const std::string& key) const {
  return at(key).as_bool();
}

double JsonReader::get_nonnegative(const std::string& key) const {
  double v = get_number(key);
  if (v < 0) fail_member(key, fmt::format("must not be negative, found {}", v));
  return v;
}

double JsonReader::get_positive(const std::string& key) const {
  double v = get_number(key);
  if (v <= 0) fail_member(key, fmt::format("must be positive, found {}", v));
  return v;
}

std::int64_t JsonReader::get_positive_int(const std::string& key) const {
  std::int64_t v = get_int(key);
  if (v < 1) fail_member(key, fmt::format("must be at least 1, found {}", v));
  return v;
}

std::int64_t JsonReader::get_nonnegative_int(const std::string& key) const {
  std::int64_t v = get_int(key);
  if (v < 0) fail_member(key, fmt::format("must not be negative, found {}", v));
  return v;
}

std::int64_t JsonReader::get_int_in(const std::string& key, std::int64_t lo,
                                    std::int64_t hi) const {
  return at(key).as_int_in(lo, hi);
}

int JsonReader::get_count(const std::string& key) const {
  return int(get_int_in(key, 1, kMaxCount));
}

int JsonReader::get_index(const std::string& key) const {
  return int(get_int_in(key, 0, kMaxCount - 1));
}

void JsonReader::expect_format(const std::string& expected) const {
  require_object();
  if (!has("format")) fail_member("format", fmt::format("missing; expected \"{}\"", expected));
  std::string got = get_string("format");
  if (got != expected)
    fail_member("format", fmt::format("unknown format \"{}\"; expected \"{}\"", got, expected));
}

namespace {

// Follows the parser's events to know the JSON path it is at, refuse nesting deeper than
// kMaxJsonDepth (before a deep document can reach anything recursive) and keys given twice.
class ParseGuard {
 public:
  explicit ParseGuard(const std::string& source) : source_(source) {}

  bool operator()(int depth, nlohmann::detail::parse_event_t event, Json& parsed) {
    using E = nlohmann::detail::parse_event_t;
    switch (event) {
      case E::object_start:
      case E::array_start:
        if (depth >= kMaxJsonDepth)
          fail(fmt::format("nested deeper than {} levels", kMaxJsonDepth));
        frames_.push_back({event == E::array_start, 0, {}, {}});
        break;
      case E::key: {
        Frame& f = frames_.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second) fail("key given twice in one object");
        break;
      }
      case E::value:
        if (!frames_.empty() && frames_.back().array) ++frames_.back().index;
        break;
      case E::object_end:
      case E::array_end:
        frames_.pop_back();
        if (!frames_.empty() && frames_.back().array) ++frames_.back().index;
        break;
    }
    return true;
  }

  std::string path() const {
    std::string p;
    for (const Frame& f : frames_)
      if (f.array)
        p += "/" + std::to_string(f.index);
      else if (!f.keys.empty())
        p += "/" + f.key;
    return p.empty() ? "/" : p;
  }

  [[noreturn]] void fail(const std::string& message) const {
    throw InputError(fmt::format("{}: {}: invalid JSON: {}", source_, path(), message));
  }

 private:
  struct Frame {
    bool array = false;
    std::size_t index = 0;
    std::string key;
    std::unordered_set<std::string> keys;
  };
  const std::string& source_;
  std::vector<Frame> frames_;
};

}  // namespace

Json parse_json(const std::string& text, const std::string& source) {
  ParseGuard guard(source);
  try {
    return Json::parse(text, [&guard](int depth, nlohmann::detail::parse_event_t event,
                                      Json& parsed) { return guard(depth, event, parsed); });
  } catch (const nlohmann::json::exception& e) {
    // Any of nlohmann's errors: parse_error (syntax, invalid UTF-8), out_of_range (1e400), ...
    // Its message is "[json.exception.parse_error.101] parse error at line 3, column 5: ...".
    std::string msg = e.what();
    auto pos = msg.find("] ");
    if (pos != std::string::npos) msg = msg.substr(pos + 2);
    guard.fail(msg);
  }
}

std::string read_regular_file(const std::string& path, std::int64_t max_bytes,
                              const std::string& what) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    throw InputError(fmt::format("{}: cannot open {}: {}", path, what, std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    throw InputError(fmt::format("{}: cannot read {}: {}", path, what, std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    throw InputError(fmt::format("{}: not a regular file ({} expected)", path, what));
  if (st.st_size > max_bytes)
    throw InputError(fmt::format("{}: {} bytes is over the {} MiB limit for a {}", path, st.st_size,
                                 max_bytes >> 20, what));
  std::string text;
  text.resize(std::size_t(st.st_size));
  std::size_t got = 0;
  while (true) {
    if (got == text.size()) {
      // The file may have grown since fstat: read on, within the limit.
      if (std::int64_t(got) >= max_bytes + 1) break;
      text.resize(std::min<std::size_t>(std::size_t(max_bytes + 1), got + 65536));
    }
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw InputError(fmt::format("{}: read error: {}", path, std::strerror(errno)));
    }
    if (n == 0) break;
    got += std::size_t(n);
  }
  if (std::int64_t(got) > max_bytes)
    throw InputError(
        fmt::format("{}: over the {} MiB limit for a {}", path, max_bytes >> 20, what));
  text.resize(got);
  return text;
}

Json read_json_file(const std::string& path) {
  return parse_json(read_regular_file(path, kMaxJsonFileBytes, "JSON file"), path);
}

void write_file_atomic(const std::string& path, const std::string& text) {
  namespace fs = std::filesystem;
  fs::path target(path);
  fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::string tmp =
      (dir / fmt::format(".{}.tmp.{}", target.filename().string(), ::getpid())).string();
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError(fmt::format("{}: cannot write file", path));
    out << text;
    out.flush();
    if (!out) {
      out.close();
      std::remove(tmp.c_str());
      throw InputError(fmt::format("{}: write failed", path));
    }
  }
  std::error_code ec;
  fs::rename(tmp, target, ec);
  if (ec) {
    std::remove(tmp.c_str());
    throw InputError(fmt::format("{}: cannot write file: {}", path, ec.message()));
  }
}

void write_json_file(const std::string& path, const Json& value) {
  write_file_atomic(path, value.dump(2) + "\n");
}

}  // namespace pw::common
