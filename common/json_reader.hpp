// Strict JSON reading: every accessor names the file and the JSON path of what is wrong.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.hpp"

namespace pw::common {

// Insertion-ordered, so written files keep "format" first and read in the order they were made.
using Json = nlohmann::ordered_json;

// A JSON value plus where it came from ("gpt2.json", "/blocks/0"), for error messages.
class JsonReader {
 public:
  JsonReader(const Json& value, std::string source, std::string path = "")
      : value_(&value), source_(std::move(source)), path_(std::move(path)) {}

  const Json& value() const { return *value_; }
  const std::string& source() const { return source_; }
  // "/a/b" or "/" for the root.
  std::string path() const { return path_.empty() ? "/" : path_; }
  bool has(const std::string& key) const;

  JsonReader at(const std::string& key) const;  // required member of an object
  JsonReader at(std::size_t index) const;       // element of an array
  std::optional<JsonReader> find(const std::string& key) const;
  std::size_t size() const;  // array length (throws if not an array)

  std::string get_string(const std::string& key) const;
  double get_number(const std::string& key) const;              // finite number
  double get_nonnegative(const std::string& key) const;         // finite, >= 0
  double get_positive(const std::string& key) const;            // finite, > 0
  std::int64_t get_int(const std::string& key) const;           // integral number
  std::int64_t get_positive_int(const std::string& key) const;  // integral, >= 1
  std::int64_t get_nonnegative_int(const std::string& key) const;
  // Integral and in [lo, hi] (read as 64-bit; out of range is an error, never wrapped).
  std::int64_t get_int_in(const std::string& key, std::int64_t lo, std::int64_t hi) const;
  // A count: integral, 1 .. kMaxCount (common/limits.hpp), as an int.
  int get_count(const std::string& key) const;
  // An index (rank, node, gpu, stage, replica): integral, 0 .. kMaxCount - 1, as an int.
  int get_index(const std::string& key) const;
  bool get_bool(const std::string& key) const;

  std::string as_string() const;
  double as_number() const;
  std::int64_t as_int() const;
  std::int64_t as_int_in(std::int64_t lo, std::int64_t hi) const;
  bool as_bool() const;

  // Throws if the object's "format" is not `expected` (e.g. "pipewright.model/1").
  void expect_format(const std::string& expected) const;
  // Throws InputError "source: /path: message".
  [[noreturn]] void fail(const std::string& message) const;
  [[noreturn]] void fail_member(const std::string& key, const std::string& message) const;

 private:
  void require_object() const;
  const Json* value_;
  std::string source_;
  std::string path_;
};

// Reads and parses a JSON file; a missing file, a non-regular file (a directory, /dev/zero, a
// FIFO), one over kMaxJsonFileBytes or any parse error is an InputError naming the file.
Json read_json_file(const std::string& path);
// Parses JSON text. Any error (syntax, invalid UTF-8, a number out of double's range such as
// 1e400, nesting deeper than kMaxJsonDepth, a key given twice in one object) is a one-line
// InputError naming `source` and the JSON path where it happened.
Json parse_json(const std::string& text, const std::string& source);

// The contents of a regular file of at most `max_bytes`; anything else (missing, a directory, a
// device, a FIFO, too large, unreadable) is an InputError naming `path` and `what` it should be.
std::string read_regular_file(const std::string& path, std::int64_t max_bytes,
                              const std::string& what = "file");

// Writes `text` to `path` atomically: a temporary file beside it, then rename. On any failure the
// temporary is removed and nothing is left at `path` that was not there before.
void write_file_atomic(const std::string& path, const std::string& text);
// Pretty-printed JSON (2-space indent, trailing newline), written atomically.
void write_json_file(const std::string& path, const Json& value);

}  // namespace pw::common
