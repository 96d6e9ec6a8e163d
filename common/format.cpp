// Figures for people (see format.hpp).
#include "common/format.hpp"

#include <cmath>

#include <fmt/format.h>

namespace pw::common {

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[u]);
}

std::string human_seconds(double s) {
  if (s >= 1) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.3f} ms", s * 1e3);
  return fmt::format("{:.3f} us", s * 1e6);
}

std::string human_rate(double per_s, const std::string& unit) {
  const char* prefixes[] = {"", "k", "M", "G", "T", "P"};
  int p = 0;
  while (per_s >= 1000 && p < 5) {
    per_s /= 1000;
    ++p;
  }
  return fmt::format("{:.2f} {}{}/s", per_s, prefixes[p], unit);
}

}  // namespace pw::common
