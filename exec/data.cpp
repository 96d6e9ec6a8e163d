// Token file and synthetic corpus (see data.hpp).
#include "exec/data.hpp"

#include <fstream>

#include <fmt/format.h>

#include "common/error.hpp"
#include "common/json_reader.hpp"

namespace pw::exec {

namespace {
std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

TokenSource::TokenSource(const std::string& path, std::int64_t vocab, std::uint64_t seed)
    : path_(path), vocab_(vocab), seed_(seed) {
  if (path.empty()) return;
  // A regular file of at most 4 GiB (2^31 tokens): a directory, a FIFO or /dev/zero is refused.
  const std::string bytes =
      common::read_regular_file(path, std::int64_t(4) << 30, "token file (uint16 tokens)");
  if (bytes.size() % 2 != 0)
    throw InputError(fmt::format("{}: odd size {}: not uint16 tokens", path, bytes.size()));
  tokens_.resize(bytes.size() / 2);
  for (std::size_t i = 0; i < tokens_.size(); ++i) {
    tokens_[i] = std::uint16_t(std::uint8_t(bytes[2 * i]) | (std::uint8_t(bytes[2 * i + 1]) << 8));
    if (tokens_[i] >= vocab)
      throw InputError(fmt::format("{}: token {} at offset {} is not below the vocabulary {}", path,
                                   tokens_[i], 2 * i, vocab));
  }
  if (tokens_.size() < 2) throw InputError(fmt::format("{}: fewer than 2 tokens", path));
}

void TokenSource::sample(std::int64_t index, int T, std::int32_t* inputs,
                         std::int32_t* targets) const {
  if (!tokens_.empty()) {
    const std::int64_t n = std::int64_t(tokens_.size()) - 1;
    std::int64_t start = (index * T) % n;
    for (int t = 0; t < T; ++t) {
      const std::int64_t at = (start + t) % n;
      inputs[t] = tokens_[std::size_t(at)];
      targets[t] = tokens_[std::size_t(at + 1)];
    }
    return;
  }
  // Synthetic: each sample follows x' = (a x + c) mod V from a random start, with an occasional
  // random token; a model can learn it, so the loss falls.
  const std::uint64_t h = splitmix(seed_ ^ splitmix(std::uint64_t(index)));
  const std::int64_t a = 5, c = 1 + std::int64_t(h % 3);
  std::int64_t x = std::int64_t(h >> 8) % vocab_;
  for (int t = 0; t <= T; ++t) {
    const std::uint64_t r = splitmix(h + std::uint64_t(t));
    const std::int64_t tok = (r % 16 == 0) ? std::int64_t(r >> 16) % vocab_ : x;
    if (t < T) inputs[t] = std::int32_t(tok);
    if (t > 0) targets[t - 1] = std::int32_t(tok);
    x = (a * tok + c) % vocab_;
  }
}

std::string TokenSource::describe() const {
  return path_.empty() ? "synthetic corpus" : fmt::format("{} ({} tokens)", path_, tokens_.size());
}

}  // namespace pw::exec
