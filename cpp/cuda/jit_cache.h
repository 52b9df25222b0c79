// The on-disk cubin cache. An entry is "<config name>-<first 24 hex digits of the key>.cubin" under CacheDir()
// (cpp/core/cache_dir.h: $TE_JAX_CACHE_DIR, default $XDG_CACHE_HOME/te_jax/cubin, else ~/.cache/te_jax/cubin). The
// file holds a header (magic, payload size, sha256 of the payload) and the cubin; a reader verifies both, so a
// truncated or corrupt entry reads as a miss and is rebuilt. Writers write a private temporary file and rename it into
// place (atomic on POSIX), so processes compiling the same key concurrently never see half a file and the last rename
// simply wins.
#pragma once

#include <string>

#include "cpp/core/cache_dir.h"
#include "cpp/core/status.h"

namespace te_jax::cuda {

std::string CachePath(const std::string& name, const std::string& key);

// True and the payload when a valid entry exists; false (a miss) when absent or corrupt.
bool ReadCacheEntry(const std::string& path, std::string* cubin);
Status WriteCacheEntry(const std::string& path, const std::string& cubin);

}  // namespace te_jax::cuda
