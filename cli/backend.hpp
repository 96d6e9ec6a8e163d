// --backend: which executor backend a command runs on, and a one-line error when it cannot.
#pragma once

#include <string>

namespace pw::cli {

// "cpu" passes. "cuda": an InputError saying why it cannot run here — a build without CUDA, no
// CUDA device (with cudaGetDeviceCount's answer), or a GPU the runtime does not drive yet.
// Anything else: an InputError naming the value.
void check_backend(const std::string& backend);

}  // namespace pw::cli
