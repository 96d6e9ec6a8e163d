// Strict JSON reading with file + JSON-path context, and atomic JSON writing.
#include "common/json_reader.hpp"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <unistd.h>

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
  if (value_->is_number_integer()) return value_->get<std::int64_t>();
  double v = as_number();
  if (v != std::floor(v) || std::fabs(v) > 9.0e18)
    fail(fmt::format("expected an integer, found {}", v));
  return static_cast<std::int64_t>(v);
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

void JsonReader::expect_format(const std::string& expected) const {
  require_object();
  if (!has("format")) fail_member("format", fmt::format("missing; expected \"{}\"", expected));
  std::string got = get_string("format");
  if (got != expected)
    fail_member("format", fmt::format("unknown format \"{}\"; expected \"{}\"", got, expected));
}

Json parse_json(const std::string& text, const std::string& source) {
  try {
    return Json::parse(text);
  } catch (const Json::parse_error& e) {
    // nlohmann's message is "[json.exception.parse_error.101] parse error at line 3, column 5: ..."
    std::string msg = e.what();
    auto pos = msg.find("] ");
    if (pos != std::string::npos) msg = msg.substr(pos + 2);
    throw InputError(fmt::format("{}: invalid JSON: {}", source, msg));
  }
}

Json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot open file", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw InputError(fmt::format("{}: read error", path));
  return parse_json(ss.str(), path);
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
