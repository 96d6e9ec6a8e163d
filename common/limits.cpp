// Checked 64-bit arithmetic and UTF-8 checking for input-derived sizes and strings.
#include "common/limits.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace pw::common {

std::int64_t checked_mul(std::int64_t a, std::int64_t b, std::string_view what,
                         std::int64_t limit) {
  std::int64_t p = 0;
  if (__builtin_mul_overflow(a, b, &p) || p > limit)
    throw InputError(limit == INT64_MAX
                         ? fmt::format("{}: {} x {} is too large", what, a, b)
                         : fmt::format("{}: {} x {} is more than {}", what, a, b, limit));
  return p;
}

std::int64_t checked_product(std::initializer_list<std::int64_t> factors, std::string_view what,
                             std::int64_t limit) {
  std::int64_t p = 1;
  for (std::int64_t f : factors) {
    if (__builtin_mul_overflow(p, f, &p) || p > limit) {
      std::string list;
      for (std::int64_t g : factors)
        list += (list.empty() ? "" : " x ") + std::to_string(g);
      throw InputError(limit == INT64_MAX
                           ? fmt::format("{}: {} is too large", what, list)
                           : fmt::format("{}: {} is more than {}", what, list, limit));
    }
  }
  return p;
}

std::int64_t checked_add(std::int64_t a, std::int64_t b, std::string_view what,
                         std::int64_t limit) {
  std::int64_t s = 0;
  if (__builtin_add_overflow(a, b, &s) || s > limit)
    throw InputError(fmt::format("{}: {} + {} is too large", what, a, b));
  return s;
}

bool is_utf8(const std::string& text) {
  // nlohmann's serializer checks UTF-8 (type_error 316 on a bad byte).
  try {
    (void)nlohmann::json(text).dump();
    return true;
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
}

void require_utf8(const std::string& text, const std::string& what) {
  if (!is_utf8(text)) throw InputError(fmt::format("{}: not valid UTF-8", what));
}

}  // namespace pw::common
