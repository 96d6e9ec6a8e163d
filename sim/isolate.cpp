// Runs each simulation in a child process (SimGrid's engine is once per process) and carries the
// result back as JSON over a pipe; errors come back with their type and message.
#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>

#include <fmt/format.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sim/simulator.hpp"

namespace pw::sim {

using common::Json;

Json to_json(const SimResult& r) {
  Json links = Json::array();
  for (const auto& l : r.links)
    links.push_back({{"name", l.name},
                     {"kind", l.kind},
                     {"bandwidth_bytes_per_s", l.bandwidth_bytes_per_s},
                     {"bytes", l.bytes},
                     {"utilization", l.utilization}});
  return {{"report", planner::to_json(r.report)},
          {"timeline", r.timeline},
          {"links", links},
          {"simulated_s", r.simulated_s},
          {"step_end_s", r.step_end_s},
          {"activities", r.activities},
          {"wall_s", r.wall_s},
          {"peak_rss_bytes", r.peak_rss_bytes}};
}

SimResult sim_result_from_json(const Json& j) {
  SimResult r;
  r.report = planner::parse_report(j.at("report"), "simulation result");
  r.timeline = j.at("timeline");
  for (const auto& l : j.at("links"))
    r.links.push_back({l.at("name").get<std::string>(), l.at("kind").get<std::string>(),
                       l.at("bandwidth_bytes_per_s").get<double>(), l.at("bytes").get<double>(),
                       l.at("utilization").get<double>()});
  r.simulated_s = j.at("simulated_s").get<double>();
  r.step_end_s = j.at("step_end_s").get<std::vector<double>>();
  r.activities = j.at("activities").get<std::int64_t>();
  r.wall_s = j.at("wall_s").get<double>();
  r.peak_rss_bytes = j.at("peak_rss_bytes").get<std::int64_t>();
  return r;
}

namespace {

void write_all(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += std::size_t(n);
  }
}

// In the child: run, send {"ok": ...} back, and leave without running the parent's exit handlers.
[[noreturn]] void child(int fd, const SimJob& job) {
  Json out;
  try {
    out = {{"ok", true},
           {"result", to_json(simulate_in_process(job.model, job.trace, job.cluster, job.plan,
                                                  job.options))}};
  } catch (const PlanError& e) {
    out = {{"ok", false}, {"kind", "plan"}, {"message", e.what()}};
  } catch (const InputError& e) {
    out = {{"ok", false}, {"kind", "input"}, {"message", e.what()}};
  } catch (const std::exception& e) {
    out = {{"ok", false}, {"kind", "error"}, {"message", e.what()}};
  }
  write_all(fd, out.dump());
  ::close(fd);
  ::_exit(0);
}

struct Running {
  std::size_t job = 0;
  pid_t pid = -1;
  int fd = -1;      // the result; -1 once at its end
  int err_fd = -1;  // the child's stderr; -1 once at its end
  std::string text;
  std::string err;  // its first kMaxErr bytes
};

constexpr std::size_t kMaxErr = 1 << 16;

Running spawn(const SimJob& job, std::size_t index) {
  int fds[2], errs[2];
  if (::pipe(fds) != 0) throw Error(fmt::format("simulate: pipe: {}", std::strerror(errno)));
  if (::pipe(errs) != 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw Error(fmt::format("simulate: pipe: {}", std::strerror(errno)));
  }
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw Error(fmt::format("simulate: fork: {}", std::strerror(errno)));
  if (pid == 0) {
    ::close(fds[0]);
    ::close(errs[0]);
    // SimGrid's messages (and, should it abort, its backtrace) go to the parent, which passes
    // them on, or sums a crash up in one line.
    ::dup2(errs[1], STDERR_FILENO);
    ::close(errs[1]);
    child(fds[1], job);
  }
  ::close(fds[1]);
  ::close(errs[1]);
  return {index, pid, fds[0], errs[0], {}, {}};
}

std::string trim(std::string s) {
  const auto first = s.find_first_not_of(" \t\r");
  if (first == std::string::npos) return "";
  s.erase(0, first);
  s.erase(s.find_last_not_of(" \t\r") + 1);
  return s;
}

// The line of a dead child's stderr that says why: an uncaught exception's what(), else
// SimGrid's failed assertion or critical message, else the first line; "" when there is none.
std::string crash_cause(const std::string& err) {
  std::vector<std::string> lines;
  std::size_t at = 0;
  while (at < err.size()) {
    std::size_t end = err.find('\n', at);
    if (end == std::string::npos) end = err.size();
    std::string line = trim(err.substr(at, end - at));
    if (!line.empty()) lines.push_back(std::move(line));
    at = end + 1;
  }
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const auto what = lines[i].find("what():");
    if (what != std::string::npos) return trim(lines[i].substr(what + 7));
  }
  // "[n0g0:rank0:(1) 0.000000] ./src/s4u/s4u_Actor.cpp:310: [root/CRITICAL] duration is not
  // finite!" says "duration is not finite!".
  for (const auto& line : lines) {
    const auto critical = line.find("/CRITICAL] ");
    if (critical != std::string::npos) return "SimGrid: " + trim(line.substr(critical + 11));
  }
  for (const char* mark : {"Assertion", "Error", "error"})
    for (const auto& line : lines)
      if (line.find(mark) != std::string::npos) return line;
  return lines.empty() ? "" : lines.front();
}

std::string shorten(std::string s) {
  constexpr std::size_t kMax = 300;
  if (s.size() > kMax) s = s.substr(0, kMax) + "...";
  return s;
}

SimOutcome finish(Running& r) {
  int status = 0;
  while (::waitpid(r.pid, &status, 0) < 0 && errno == EINTR) {
  }
  SimOutcome o;
  o.error_kind = "error";
  const std::string cause = crash_cause(r.err);
  const std::string because = cause.empty() ? "" : ": " + shorten(cause);
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    o.error = fmt::format("simulation crashed (signal {}, {}){}", sig, ::strsignal(sig),
                          cause.empty() && sig == SIGKILL ? " (out of memory?)" : because);
    return o;
  }
  // SimGrid's critical messages (a deadlock it detected, say) mean a broken simulation, even
  // from a child that ended normally: one line, as a crash.
  if (r.err.find("/CRITICAL]") != std::string::npos) {
    o.error = fmt::format("simulation failed{}", because);
    return o;
  }
  // Otherwise what SimGrid said on the way (warnings) passes on as it was.
  if (!r.err.empty()) {
    std::fwrite(r.err.data(), 1, r.err.size(), stderr);
    std::fflush(stderr);
  }
  if (r.text.empty()) {
    o.error = fmt::format("simulation ended without a result (exit status {}){}",
                          WIFEXITED(status) ? WEXITSTATUS(status) : -1, because);
    return o;
  }
  try {
    const Json out = Json::parse(r.text);
    o.ok = out.at("ok").get<bool>();
    if (o.ok) {
      o.result = sim_result_from_json(out.at("result"));
      o.error_kind.clear();
    } else {
      o.error_kind = out.at("kind").get<std::string>();
      o.error = out.at("message").get<std::string>();
    }
  } catch (const std::exception& e) {
    o.ok = false;
    o.error_kind = "error";
    o.error = fmt::format("simulation returned a bad result: {}", e.what());
  }
  return o;
}

// Reads what is available from the running children (results and stderr); returns the index of
// one whose both pipes reached their end, or -1.
int read_some(std::vector<Running>& running) {
  std::vector<pollfd> fds;
  std::vector<std::pair<std::size_t, bool>> owner;  // (running index, is stderr)
  for (std::size_t i = 0; i < running.size(); ++i) {
    if (running[i].fd >= 0) {
      fds.push_back({running[i].fd, POLLIN, 0});
      owner.emplace_back(i, false);
    }
    if (running[i].err_fd >= 0) {
      fds.push_back({running[i].err_fd, POLLIN, 0});
      owner.emplace_back(i, true);
    }
  }
  for (std::size_t i = 0; i < running.size(); ++i)
    if (running[i].fd < 0 && running[i].err_fd < 0) return int(i);
  while (::poll(fds.data(), fds.size(), -1) < 0)
    if (errno != EINTR) throw Error(fmt::format("simulate: poll: {}", std::strerror(errno)));
  char buf[1 << 16];
  for (std::size_t k = 0; k < fds.size(); ++k) {
    if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    Running& r = running[owner[k].first];
    const bool is_err = owner[k].second;
    const ssize_t n = ::read(fds[k].fd, buf, sizeof buf);
    if (n > 0) {
      if (!is_err)
        r.text.append(buf, std::size_t(n));
      else if (r.err.size() < kMaxErr)
        r.err.append(buf, std::min(std::size_t(n), kMaxErr - r.err.size()));
    } else if (n == 0 || errno != EINTR) {
      ::close(fds[k].fd);
      (is_err ? r.err_fd : r.fd) = -1;
    }
  }
  for (std::size_t i = 0; i < running.size(); ++i)
    if (running[i].fd < 0 && running[i].err_fd < 0) return int(i);
  return -1;
}

}  // namespace

std::vector<SimOutcome> simulate_batch(const std::vector<SimJob>& jobs, int parallel,
                                       const std::function<void(int, int)>& progress) {
  if (parallel <= 0) parallel = std::max(1, int(::sysconf(_SC_NPROCESSORS_ONLN)));
  std::vector<SimOutcome> outcomes(jobs.size());
  std::vector<Running> running;
  std::size_t next = 0, done = 0;
  while (done < jobs.size()) {
    while (next < jobs.size() && int(running.size()) < parallel) {
      running.push_back(spawn(jobs[next], next));
      ++next;
    }
    const int ended = read_some(running);
    if (ended < 0) continue;
    outcomes[running[std::size_t(ended)].job] = finish(running[std::size_t(ended)]);
    running.erase(running.begin() + ended);
    ++done;
    if (progress) progress(int(done), int(jobs.size()));
  }
  return outcomes;
}

SimResult simulate(const models::ModelSpec& model, const traces::Trace& trace,
                   const clusters::Cluster& cluster, const planner::Plan& plan,
                   const SimOptions& options) {
  SimOutcome o = simulate_batch({SimJob{model, trace, cluster, plan, options}}, 1).front();
  if (o.ok) return std::move(o.result);
  if (o.error_kind == "plan") throw PlanError(o.error);
  if (o.error_kind == "input") throw InputError(o.error);
  throw Error(o.error);
}

}  // namespace pw::sim
