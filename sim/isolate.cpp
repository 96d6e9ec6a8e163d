// Runs each simulation in a child process (SimGrid's engine is once per process) and carries the
// result back as JSON over a pipe; errors come back with their type and message.
#include <algorithm>
#include <cerrno>
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
  int fd = -1;
  std::string text;
};

Running spawn(const SimJob& job, std::size_t index) {
  int fds[2];
  if (::pipe(fds) != 0) throw Error(fmt::format("simulate: pipe: {}", std::strerror(errno)));
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw Error(fmt::format("simulate: fork: {}", std::strerror(errno)));
  if (pid == 0) {
    ::close(fds[0]);
    child(fds[1], job);
  }
  ::close(fds[1]);
  return {index, pid, fds[0], {}};
}

SimOutcome finish(Running& r) {
  ::close(r.fd);
  int status = 0;
  while (::waitpid(r.pid, &status, 0) < 0 && errno == EINTR) {
  }
  SimOutcome o;
  o.error_kind = "error";
  if (WIFSIGNALED(status)) {
    o.error = fmt::format("simulation crashed (signal {})", WTERMSIG(status));
  } else if (r.text.empty()) {
    o.error = "simulation ended without a result";
  } else {
    const Json out = Json::parse(r.text);
    o.ok = out.at("ok").get<bool>();
    if (o.ok) {
      o.result = sim_result_from_json(out.at("result"));
      o.error_kind.clear();
    } else {
      o.error_kind = out.at("kind").get<std::string>();
      o.error = out.at("message").get<std::string>();
    }
  }
  return o;
}

// Reads what is available from the running children; returns the index of one that has finished
// writing (EOF), or -1.
int read_some(std::vector<Running>& running) {
  std::vector<pollfd> fds;
  for (const auto& r : running)
    fds.push_back({r.fd, POLLIN, 0});
  while (::poll(fds.data(), fds.size(), -1) < 0)
    if (errno != EINTR) throw Error(fmt::format("simulate: poll: {}", std::strerror(errno)));
  char buf[1 << 16];
  for (std::size_t i = 0; i < fds.size(); ++i) {
    if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
    if (n > 0) {
      running[i].text.append(buf, std::size_t(n));
    } else if (n == 0 || errno != EINTR) {
      return int(i);
    }
  }
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
