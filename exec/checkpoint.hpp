// Checkpoints: after a step, every rank writes a shard (each weight version it still needs, its
// optimizer state, its update count), each file atomically (temporary file, fsync, rename); a
// manifest written after the last shard marks the checkpoint complete. A run killed at any point
// resumes from the newest complete checkpoint and computes exactly what the unbroken run computes.
//
// Layout: <dir>/step-00000004/rank-00000.bin ... manifest.json. Shard: 8 bytes "PWCKPT01", the
// header length (uint64 little-endian), the JSON header, then the tensors' fp32 values in header
// order (host byte order, little-endian on every supported machine). Formats: docs/formats.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/json_reader.hpp"

namespace pw::exec {

// "<dir>/step-00000004".
std::string checkpoint_path(const std::string& dir, int step);

// Newest step in `dir` whose manifest exists (a checkpoint killed while being written has none);
// nullopt when there is none or `dir` does not exist.
std::optional<int> latest_checkpoint(const std::string& dir);

// Removes the checkpoints without a manifest (a killed run's leftovers) from `dir`.
void remove_incomplete_checkpoints(const std::string& dir);

// Writes <checkpoint>/manifest.json (atomically) after every shard of the step is written, then
// removes all but the `keep` newest complete checkpoints and any incomplete older one.
void write_manifest(const std::string& dir, int step, int ranks, const common::Json& identity,
                    int keep = 2);

// Reads the manifest of `step` and checks that it was written by a run with the same `identity`
// (model, plan, optimizer, seed, data): an InputError names the first field that differs.
void check_manifest(const std::string& dir, int step, int ranks, const common::Json& identity);

struct ShardTensor {
  std::string name;  // "c0.w3" (chunk 0, weight version 3), "c0.m", "c0.v"
  float* data = nullptr;
  std::int64_t size = 0;  // floats
};

// Writes one rank's shard atomically. `header` gets "tensors" added.
void write_shard(const std::string& path, common::Json header,
                 const std::vector<ShardTensor>& tensors);

// Reads a shard into `tensors` (every name and size must match the file's, in order) and returns
// its header. Truncated or foreign files are InputErrors naming the file.
common::Json read_shard(const std::string& path, const std::vector<ShardTensor>& tensors);

// Reads floats [offset, offset + count) of the tensor `name` of a shard into `out` (the last stage
// of a tied model takes its copy of the tied tensor from stage 0's shard).
void read_shard_slice(const std::string& path, const std::string& name, std::int64_t offset,
                      float* out, std::int64_t count);

// "<checkpoint>/rank-00003.bin".
std::string shard_path(const std::string& checkpoint, int rank);

}  // namespace pw::exec
