// SHA-256 (FIPS 180-4), for the JIT cache key: a hash of the rendered source, the kernel headers, the options, the arch
// and the NVRTC version names a cubin on disk, and checks that a cache file's payload was not corrupted.
#pragma once

#include <string>

namespace te_jax::cuda {

std::string Sha256Hex(const std::string& data);

}  // namespace te_jax::cuda
