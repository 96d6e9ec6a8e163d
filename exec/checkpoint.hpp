// Checkpoints: after a step, every rank writes a shard (each weight version it still needs, its
// optimizer state, its update count), each file atomically (temporary file, fsync, rename); a
// manifest written after the last shard marks the checkpoint complete. A run killed at any point
// resumes from the newest complete checkpoint and computes exactly what the unbroken run computes.
//
// Layout: <dir>/step-00000004/rank-00000.bin ... manifest.json. Shard: 8 bytes "PWCKPT02", the
// header length (uint64 little-endian), the CRC-32 of those 16 bytes, the JSON header (with each
// tensor's CRC-32), the header's CRC-32, then the tensors' fp32 values in header order (host byte
// order, little-endian on every supported machine). The manifest is JSON whose last member is the
// CRC-32 of every byte before it. A flipped bit anywhere is found on load (CRC-32 detects every
// single-bit error). Formats: docs/formats.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/json_reader.hpp"

namespace pw::exec {

// The manifest's "format".
inline constexpr const char* kCheckpointFormat = "pipewright.checkpoint/2";

// "<dir>/step-00000004".
std::string checkpoint_path(const std::string& dir, int step);

// Newest step in `dir` whose manifest exists (a checkpoint killed while being written has none);
// nullopt when there is none or `dir` does not exist. Says nothing about its integrity.
std::optional<int> latest_checkpoint(const std::string& dir);

// Removes the checkpoints without a manifest (a killed run's leftovers) from `dir`.
void remove_incomplete_checkpoints(const std::string& dir);

// Writes <checkpoint>/manifest.json (atomically, fsynced) after every shard of the step is
// written, then removes all but the `keep` newest complete checkpoints and any incomplete older
// one. `result` (a finished run's record, see TrainResult's to_json) goes into the final one.
void write_manifest(const std::string& dir, int step, int ranks, const common::Json& identity,
                    int keep = 2, const common::Json& result = nullptr);

struct Manifest {
  std::string path;  // of manifest.json
  int step = 0;
  int ranks = 0;
  common::Json run;     // the identity of the run that wrote it
  common::Json result;  // null unless the final checkpoint of a finished run
};

// Reads and checks a manifest: its CRC-32, then every field's type. Errors name the file and the
// field; a pipewright.checkpoint/1 manifest (no checksums) is refused with a line saying so.
Manifest read_manifest(const std::string& dir, int step);

// Checks that the manifest was written by a run with the same `identity` (model, plan,
// optimizer, seed, data) and `ranks`: an InputError names the first field that differs.
void check_manifest(const Manifest& manifest, int ranks, const common::Json& identity);
// The same, reading the manifest of `step` in `dir` first.
void check_manifest(const std::string& dir, int step, int ranks, const common::Json& identity);

// Reads the whole checkpoint of `step` (manifest, every shard's header and tensors) and checks
// every checksum and size: nullopt when intact, else the first problem in one line naming the
// file (and tensor).
std::optional<std::string> verify_checkpoint(const std::string& dir, int step);

// What --resume finds in `dir`: the newest intact checkpoint (nullopt: none), and one warning line
// per newer one that is damaged (each renamed to step-XXXXXXXX.damaged when `tidy`, so that it
// counts no more; under mpirun only one process tidies).
struct ResumePoint {
  std::optional<int> step;
  std::vector<std::string> warnings;
};
ResumePoint find_resume_point(const std::string& dir, bool tidy = true);

struct ShardTensor {
  std::string name;  // "c0.w3" (chunk 0, weight version 3), "c0.m", "c0.v"
  float* data = nullptr;
  std::int64_t size = 0;  // floats
};

// A rank's shard in file order, the one rule both workers' checkpoints follow: per model chunk i,
// each weight version it holds ("c{i}.w{v}", the chunk's `parameters[i]` floats each, in the
// order of `versions`: ascending), then its optimizer state (one tensor per name of `state`,
// "c{i}.{name}", `state_sizes[i]` floats each: the parameters whose state the rank keeps). The
// CPU's state is {"m", "v"}, the GPU's {"master", "m", "v"} (its fp32 master beside the bf16
// weights); "v" only with AdamW. Every tensor's data starts null: the worker points each at its
// bytes (`weights`, `state`) before write_shard or read_shard.
class ShardLayout {
 public:
  ShardLayout(const std::vector<std::int64_t>& parameters, std::vector<int> versions,
              std::vector<std::string> state, const std::vector<std::int64_t>& state_sizes);
  const std::vector<ShardTensor>& tensors() const { return tensors_; }
  const std::vector<int>& versions() const { return versions_; }
  std::size_t chunks() const { return chunks_; }
  std::size_t states() const { return state_.size(); }
  // Model chunk `chunk`'s weights of versions()[index]; its state tensor `which` (state's order).
  ShardTensor& weights(std::size_t chunk, std::size_t index);
  ShardTensor& state(std::size_t chunk, std::size_t which);
  const ShardTensor& weights(std::size_t chunk, std::size_t index) const;
  const ShardTensor& state(std::size_t chunk, std::size_t which) const;

  // The last stage's copy of the tied tensor, floats [offset, offset + size) of chunk `chunk`'s
  // weights, is stored as zeros (it may not have arrived yet for these versions, and what it holds
  // until then depends on the run's history; resume takes it from stage 0's shard): zeroes it in
  // every version's tensor. With `copies`, each of those tensors is first copied into it and
  // pointed there (the worker's live weights stay as they are); without, zeroed in place (the
  // tensors are the worker's scratch).
  void zero_tied_copy(std::size_t chunk, std::int64_t offset, std::int64_t size,
                      std::vector<std::vector<float>>* copies);
  // On load: the same floats of every version's tensor from `source`'s (stage 0's shard) tensor
  // "c0.w{v}" at `source_offset` (read_shard_slice).
  void read_tied_copy(std::size_t chunk, std::int64_t offset, std::int64_t size,
                      const std::string& source, std::int64_t source_offset);

 private:
  std::size_t index(std::size_t chunk, std::size_t k) const;
  std::vector<int> versions_;
  std::vector<std::string> state_;
  std::size_t chunks_ = 0;
  std::vector<ShardTensor> tensors_;
};

// Writes one rank's shard atomically. `header` gets "format" (pipewright.checkpoint-shard/2) set
// and "tensors" (names, sizes, CRC-32s) added.
void write_shard(const std::string& path, common::Json header,
                 const std::vector<ShardTensor>& tensors);

// Reads a shard into `tensors` (every name and size must match the file's, in order, and every
// checksum) and returns its header. Truncated, damaged or foreign files are InputErrors naming
// the file.
common::Json read_shard(const std::string& path, const std::vector<ShardTensor>& tensors);

// Reads floats [offset, offset + count) of the tensor `name` of a shard into `out` (the last stage
// of a tied model takes its copy of the tied tensor from stage 0's shard); the whole tensor's
// checksum is verified.
void read_shard_slice(const std::string& path, const std::string& name, std::int64_t offset,
                      float* out, std::int64_t count);

// "<checkpoint>/rank-00003.bin".
std::string shard_path(const std::string& checkpoint, int rank);

}  // namespace pw::exec
