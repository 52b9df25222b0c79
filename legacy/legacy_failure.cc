#include "legacy/legacy_failure.h"

#include <cstdio>
#include <mutex>

namespace te_jax::legacy {
namespace {

std::mutex& FailuresMutex() {
  static std::mutex mu;
  return mu;
}

std::string& PendingFailures() {
  static std::string failures;
  return failures;
}

}  // namespace

void RecordLegacyFailure(const char* target, const Status& status) {
  const std::string line = std::string(target) + ": " + status.message();
  std::fprintf(stderr, "te_jax: legacy custom call failed, its outputs are NaN: %s\n", line.c_str());
  std::lock_guard<std::mutex> lock(FailuresMutex());
  std::string& failures = PendingFailures();
  if (!failures.empty()) failures += "\n";
  failures += line;
}

std::optional<std::string> TakeLegacyFailures() {
  std::lock_guard<std::mutex> lock(FailuresMutex());
  std::string& failures = PendingFailures();
  if (failures.empty()) return std::nullopt;
  std::string taken;
  taken.swap(failures);
  return taken;
}

}  // namespace te_jax::legacy
