// Helpers shared by the test suites: catching an error's message and a scratch folder.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <unistd.h>

#include "common/error.hpp"
#include "common/json_reader.hpp"

namespace pw::testing {

// Runs `f`, expects it to throw E, and returns the message ("" and a test failure otherwise).
template <class E = InputError, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

// A scratch folder under the system temp dir, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& tag)
      : path_(std::filesystem::temp_directory_path() /
              ("pw_test_" + tag + "_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name) << text;
    return file(name);
  }
  std::string write(const std::string& name, const common::Json& j) const {
    return write(name, j.dump(2));
  }

 private:
  std::filesystem::path path_;
};

}  // namespace pw::testing
