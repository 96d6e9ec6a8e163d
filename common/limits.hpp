// The limits every number read from a file, a command-line flag or --set is checked against, and
// checked 64-bit arithmetic for the sizes derived from them. The same constants serve the JSON
// readers (JsonReader::get_count ...) and the CLI11 validators (CLI::Range(1, kMaxCount)), so a
// value refused in a file is refused on the command line too. Documented in docs/formats.md
// ("Limits").
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "common/error.hpp"

namespace pw::common {

// Any count: w, d, b, m, v, t, nodes, gpus_per_node, ranks per GPU, steps, buckets, microbatch
// sizes, layers. Indices (rank, node, gpu, stage, replica) are below it.
inline constexpr std::int64_t kMaxCount = 1'000'000;
// A model dimension: hidden, ffn, heads, kv_heads, seq_len, max_positions, vocab, type_vocab,
// vocab_multiple (the same bound as --seq-len). Products of them are checked too
// (models::validate).
inline constexpr std::int64_t kMaxDim = std::int64_t(1) << 24;
// GPUs of a cluster (nodes x gpus_per_node) and of a plan (t*w*d).
inline constexpr std::int64_t kMaxDevices = 1'000'000;
// Byte counts read from files (memory sizes, report figures): at most 2^53, exact in a double,
// so sums of a few of them stay in int64.
inline constexpr std::int64_t kMaxBytes = std::int64_t(1) << 53;
// Pipeline ranks (w*d, programs) a run builds and simulates.
inline constexpr std::int64_t kMaxRanks = 65'536;
// Pipeline ranks one simulation replays: its time grows faster than linearly with the ranks of a
// data-parallel all-reduce (2,048 ranks: about 30 s on one core).
inline constexpr std::int64_t kMaxSimulatedRanks = 4'096;
// GPUs of a simulated cluster (a platform host each): 16,384 (dgx-h100:2048) take about 80 s.
inline constexpr std::int64_t kMaxSimulatedGpus = 16'384;
// Ops over all programs of a run (ranks x steps x ops per step), checked before any is built:
// about 1 GB of programs and minutes of simulation.
inline constexpr std::int64_t kMaxProgramOps = 20'000'000;
// Points of a sweep (the --vary cross product).
inline constexpr std::int64_t kMaxSweepPoints = 100'000;
// JSON input files: bytes and nesting depth.
inline constexpr std::int64_t kMaxJsonFileBytes = std::int64_t(256) << 20;
inline constexpr int kMaxJsonDepth = 64;

// a * b, or an InputError "`what`: a x b is too large" when it leaves int64 or passes `limit`.
std::int64_t checked_mul(std::int64_t a, std::int64_t b, std::string_view what,
                         std::int64_t limit = INT64_MAX);
// The product of non-negative factors, or an InputError as checked_mul.
std::int64_t checked_product(std::initializer_list<std::int64_t> factors, std::string_view what,
                             std::int64_t limit = INT64_MAX);
std::int64_t checked_add(std::int64_t a, std::int64_t b, std::string_view what,
                         std::int64_t limit = INT64_MAX);

// Whether `text` is valid UTF-8 (what JSON output needs).
bool is_utf8(const std::string& text);
// Throws InputError "`what`: not valid UTF-8" unless it is.
void require_utf8(const std::string& text, const std::string& what);

}  // namespace pw::common
