// Runs each simulation in a child process (SimGrid's engine is once per process) and carries the
// result back as JSON over a pipe; errors come back with their type and message.
#include <cerrno>
#include <cstring>
#include <string>

#include <fmt/format.h>
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

std::string read_all(int fd) {
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, std::size_t(n));
  }
  return out;
}

// In the child: run, send {"ok": ...} back, and leave without running the parent's exit handlers.
[[noreturn]] void child(int fd, const models::ModelSpec& model, const traces::Trace& trace,
                        const clusters::Cluster& cluster, const planner::Plan& plan,
                        const SimOptions& options) {
  Json out;
  try {
    out = {{"ok", true},
           {"result", to_json(simulate_in_process(model, trace, cluster, plan, options))}};
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

}  // namespace

SimResult simulate(const models::ModelSpec& model, const traces::Trace& trace,
                   const clusters::Cluster& cluster, const planner::Plan& plan,
                   const SimOptions& options) {
  int fds[2];
  if (::pipe(fds) != 0) throw Error(fmt::format("simulate: pipe: {}", std::strerror(errno)));
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw Error(fmt::format("simulate: fork: {}", std::strerror(errno)));
  if (pid == 0) {
    ::close(fds[0]);
    child(fds[1], model, trace, cluster, plan, options);
  }
  ::close(fds[1]);
  const std::string text = read_all(fds[0]);
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status))
    throw Error(fmt::format("simulation crashed (signal {})", WTERMSIG(status)));
  if (text.empty()) throw Error("simulation ended without a result");
  const Json out = Json::parse(text);
  if (out.at("ok").get<bool>()) return sim_result_from_json(out.at("result"));
  const std::string kind = out.at("kind").get<std::string>();
  const std::string message = out.at("message").get<std::string>();
  if (kind == "plan") throw PlanError(message);
  if (kind == "input") throw InputError(message);
  throw Error(message);
}

}  // namespace pw::sim
