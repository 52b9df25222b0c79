// Byte-order-explicit field I/O for the legacy descriptors (descriptor.h, flex_descriptor.h), so their formats do not
// depend on the host's struct layout or endianness, and their FNV-1a checksum.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace te_jax::legacy {

inline uint32_t Fnv1a(const char* data, size_t size) {
  uint32_t hash = 2166136261u;
  for (size_t i = 0; i < size; ++i) {
    hash ^= static_cast<uint8_t>(data[i]);
    hash *= 16777619u;
  }
  return hash;
}

inline bool LittleEndian() {
  const uint16_t one = 1;
  uint8_t first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

class Writer {
 public:
  template <typename T>
  void Put(T value) {
    uint8_t bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    if (!LittleEndian()) std::reverse(bytes, bytes + sizeof(T));
    out_.append(reinterpret_cast<const char*>(bytes), sizeof(T));
  }
  void PutBytes(const std::string& bytes) { out_ += bytes; }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
};

// Reads fields in order from `size` bytes; reading past them gives zeros and sets overrun().
class Reader {
 public:
  Reader(const char* data, size_t size) : data_(data), size_(size) {}
  template <typename T>
  T Get() {
    T value{};
    if (pos_ + sizeof(T) > size_) {
      overrun_ = true;
      return value;
    }
    uint8_t bytes[sizeof(T)];
    std::memcpy(bytes, data_ + pos_, sizeof(T));
    if (!LittleEndian()) std::reverse(bytes, bytes + sizeof(T));
    pos_ += sizeof(T);
    std::memcpy(&value, bytes, sizeof(T));
    return value;
  }
  std::string GetBytes(size_t n) {
    if (pos_ + n > size_) {
      overrun_ = true;
      return {};
    }
    pos_ += n;
    return std::string(data_ + pos_ - n, n);
  }
  bool overrun() const { return overrun_; }
  size_t position() const { return pos_; }

 private:
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
  bool overrun_ = false;
};

}  // namespace te_jax::legacy
