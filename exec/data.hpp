// Training data: a token file (flat uint16 little-endian, as GPT-2 training commonly uses) or a
// built-in synthetic corpus. Sample i is a deterministic function of i, so every rank can read the
// inputs (first stage) and targets (last stage) of the samples it needs on its own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pw::exec {

class TokenSource {
 public:
  // `path` empty: the synthetic corpus over `vocab` tokens; else a token file (every token must be
  // < vocab: the reader checks and names the file and the offset of the first bad token).
  TokenSource(const std::string& path, std::int64_t vocab, std::uint64_t seed);
  // Sample `index`: T inputs and the T next tokens as targets.
  void sample(std::int64_t index, int T, std::int32_t* inputs, std::int32_t* targets) const;
  std::string describe() const;

 private:
  std::string path_;
  std::int64_t vocab_;
  std::uint64_t seed_;
  std::vector<std::uint16_t> tokens_;
};

}  // namespace pw::exec
