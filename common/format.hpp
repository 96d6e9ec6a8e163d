// Figures for people: "1.23 GiB", "12.345 ms", "4.56 TFLOP/s".
#pragma once

#include <string>

namespace pw::common {

std::string human_bytes(double bytes);
std::string human_seconds(double s);
std::string human_rate(double per_s, const std::string& unit);

}  // namespace pw::common
