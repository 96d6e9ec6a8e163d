// Typed errors with context. Library code throws these; only cli/ prints them and picks exit codes.
#pragma once

#include <stdexcept>
#include <string>

namespace pw {

// Base of every pipewright error. what() is one line that names the file, field, rank or op.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Malformed or inconsistent input: a file, a JSON field, a command-line value.
class InputError : public Error {
 public:
  using Error::Error;
};

// A well-formed plan that cannot run: w*d != devices, a stage with no blocks, m < d for 2bw ...
class PlanError : public Error {
 public:
  using Error::Error;
};

// A set of schedule programs that breaks an invariant (unmatched send, deadlock, third version).
class ScheduleError : public Error {
 public:
  using Error::Error;
};

}  // namespace pw
