// exec/machine_load: the machine's CPU counters and the load other processes put on it.
#include "exec/machine_load.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <fstream>
#include <sstream>

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

}  // namespace pw::exec
