// te_jax's on-disk cache folder: the CUDA backend's cubins (cpp/cuda/jit_cache.h) and the CPU's score_mod /
// mask_mod libraries (te_jax/flex/cpu_library.py) live there. $TE_JAX_CACHE_DIR, default $XDG_CACHE_HOME/te_jax/cubin,
// else ~/.cache/te_jax/cubin.
#pragma once

#include <cstdlib>
#include <string>

namespace te_jax {

inline std::string CacheDir() {
  if (const char* dir = std::getenv("TE_JAX_CACHE_DIR"); dir != nullptr && *dir != '\0') return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    return std::string(xdg) + "/te_jax/cubin";
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return std::string(home) + "/.cache/te_jax/cubin";
  }
  return "/tmp/te_jax_cache/cubin";
}

}  // namespace te_jax
