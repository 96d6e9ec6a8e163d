// How busy the machine was with other work while something ran: what validate prints so that a
// noisy machine shows in its output rather than in its error (docs/formulas.md, section 10).
#pragma once

#include <string>
#include <vector>

namespace pw::exec {

// The machine's CPU counters at one moment (the first line of /proc/stat, in seconds) and this
// process's own CPU time (getrusage: every thread, finished ones included).
struct CpuCounters {
  double wall_s = 0;         // steady clock
  double busy_s = 0;         // user + nice + system + irq + softirq over all CPUs
  double steal_s = 0;        // time the hypervisor ran something else on this VM's CPUs
  double total_s = 0;        // every state, idle and iowait included
  double process_cpu_s = 0;  // this process: user + system
  double tick_s = 0.01;      // one count of /proc/stat (1 / USER_HZ)
  int cpus = 0;              // online CPUs
  std::string host;          // gethostname
  std::string machine;  // which machine: its boot id (the same in every namespace of it), else host
};

// Reads the counters now. Where /proc/stat cannot be read, busy_s and total_s stay 0 (the load is
// then reported as unknown).
CpuCounters read_cpu_counters();

// Parses /proc/stat's "cpu " line (USER_HZ ticks) into busy, steal and total seconds. Returns false
// when the line is not there.
bool parse_proc_stat(const std::string& text, double ticks_per_s, CpuCounters& out);

// The machine's load by others between two readings: the CPU time the machine spent busy minus
// what `job_cpu_s` (this job's processes together) used, as a fraction of the CPUs' time
// (wall x cpus), clamped to [0, 1]; steal as a fraction of all CPU time. known is false when the
// counters were not readable.
struct OtherLoad {
  bool known = false;
  double others = 0;  // fraction of the machine's CPU time used by other processes
  double steal = 0;   // fraction taken by the hypervisor
  double wall_s = 0;
  double resolution = 0;  // of `others`: a count of every CPU, tick_s / wall_s
};
OtherLoad other_load(const CpuCounters& before, const CpuCounters& after, double job_cpu_s);

// Binds the calling thread to one CPU core (sched_setaffinity). Throws InputError naming the core
// when it is not one this process may run on.
void pin_current_thread(int core);

// The CPU cores this process may run on (sched_getaffinity), ascending.
std::vector<int> allowed_cores();

// A core for each of `ranks` threads among `cores`: rank r on cores[r] while there are enough;
// with more ranks than cores, consecutive ranks (neighbouring stages) share one, as evenly as
// the counts allow (index r * cores / ranks), as validate's placement puts them.
std::vector<int> cores_for_ranks(int ranks, const std::vector<int>& cores);

}  // namespace pw::exec
