#include "cpp/cuda/jit_cache.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "cpp/cuda/sha256.h"

namespace te_jax::cuda {
namespace {

constexpr char kMagic[8] = {'T', 'E', 'J', 'X', 'C', 'U', 'B', '1'};
constexpr size_t kHeaderSize = 8 + 8 + 64;

}  // namespace

std::string CachePath(const std::string& name, const std::string& key) {
  return CacheDir() + "/" + name + "-" + key.substr(0, 24) + ".cubin";
}

bool ReadCacheEntry(const std::string& path, std::string* cubin) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  if (data.size() < kHeaderSize || std::memcmp(data.data(), kMagic, 8) != 0) return false;
  uint64_t size = 0;
  std::memcpy(&size, data.data() + 8, 8);
  if (size != data.size() - kHeaderSize || size == 0) return false;
  std::string payload = data.substr(kHeaderSize);
  if (Sha256Hex(payload) != data.substr(16, 64)) return false;
  *cubin = std::move(payload);
  return true;
}

Status WriteCacheEntry(const std::string& path, const std::string& cubin) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  if (ec) return Status::Internal("cannot create the te_jax kernel cache folder " + fs::path(path).parent_path().string() + ": " + ec.message());
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const std::string tmp = path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(rd()) + "." +
                          std::to_string(counter++);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status::Internal("cannot write " + tmp);
    const uint64_t size = cubin.size();
    out.write(kMagic, 8);
    out.write(reinterpret_cast<const char*>(&size), 8);
    out.write(Sha256Hex(cubin).data(), 64);
    out.write(cubin.data(), static_cast<std::streamsize>(cubin.size()));
    out.flush();
    if (!out) {
      fs::remove(tmp, ec);
      return Status::Internal("cannot write " + tmp);
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    return Status::Internal("cannot move a compiled kernel into the cache at " + path);
  }
  return Status::Ok();
}

}  // namespace te_jax::cuda
