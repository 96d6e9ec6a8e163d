// exec/machine_load: the machine's CPU counters and the load other processes put on it.
#include "exec/machine_load.hpp"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "common/error.hpp"

namespace pw::exec {

bool parse_proc_stat(const std::string& text, double ticks_per_s, CpuCounters& out) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("cpu ", 0) != 0) continue;
    std::istringstream fields(line.substr(4));
    // user nice system idle iowait irq softirq steal (guest time is inside user already)
    std::array<double, 8> v{};
    std::size_t n = 0;
    while (n < v.size() && fields >> v[n])
      ++n;
    if (n < 4 || ticks_per_s <= 0) return false;
    const double user = v[0], nice = v[1], system = v[2], idle = v[3], iowait = v[4], irq = v[5],
                 softirq = v[6], steal = v[7];
    out.busy_s = (user + nice + system + irq + softirq) / ticks_per_s;
    out.steal_s = steal / ticks_per_s;
    out.total_s = (user + nice + system + idle + iowait + irq + softirq + steal) / ticks_per_s;
    return true;
  }
  return false;
}

CpuCounters read_cpu_counters() {
  CpuCounters c;
  c.wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  std::ifstream in("/proc/stat");
  std::stringstream text;
  text << in.rdbuf();
  const long hz = sysconf(_SC_CLK_TCK);
  c.tick_s = 1.0 / double(hz > 0 ? hz : 100);
  if (!parse_proc_stat(text.str(), 1.0 / c.tick_s, c)) c.busy_s = c.total_s = 0;
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) == 0)
    c.process_cpu_s = double(u.ru_utime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec) +
                      double(u.ru_stime.tv_sec) + 1e-6 * double(u.ru_stime.tv_usec);
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  c.cpus = int(std::max<long>(cpus, 1));
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) == 0) c.host = name;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  if (!std::getline(boot, c.machine) || c.machine.empty()) c.machine = c.host;
  return c;
}

OtherLoad other_load(const CpuCounters& before, const CpuCounters& after, double job_cpu_s) {
  OtherLoad r;
  r.wall_s = after.wall_s - before.wall_s;
  const double total = after.total_s - before.total_s;
  if (before.total_s <= 0 || after.total_s <= 0 || total <= 0 || r.wall_s <= 0) return r;
  r.known = true;
  const double capacity = r.wall_s * std::max(after.cpus, 1);
  const double others = (after.busy_s - before.busy_s) - job_cpu_s;
  r.others = std::clamp(others / capacity, 0.0, 1.0);
  r.resolution = after.tick_s / r.wall_s;
  r.steal = std::clamp((after.steal_s - before.steal_s) / total, 0.0, 1.0);
  return r;
}

void pin_current_thread(int core) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || core < 0 || core >= CPU_SETSIZE ||
      !CPU_ISSET(core, &allowed))
    throw InputError(
        fmt::format("cannot pin a rank to CPU core {}: this process may not run there", core));
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(core, &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0)
    throw InputError(
        fmt::format("cannot pin a rank to CPU core {}: sched_setaffinity failed", core));
}

std::vector<int> allowed_cores() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof allowed, &allowed) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &allowed)) out.push_back(c);
  if (out.empty()) out.push_back(0);
  return out;
}

std::vector<int> cores_for_ranks(int ranks, const std::vector<int>& cores) {
  const auto n = std::int64_t(cores.size());
  std::vector<int> out;
  for (std::int64_t r = 0; r < ranks && n > 0; ++r)
    out.push_back(cores[std::size_t(ranks <= n ? r : r * n / ranks)]);
  return out;
}

}  // namespace pw::exec
