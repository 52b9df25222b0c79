// How a legacy custom call fails. XLA does not export XlaCustomCallStatusSetFailure to plugins (see docs/
// ARCHITECTURE.md), so a legacy handler cannot make the XLA program fail the way an FFI handler does. Everything that
// can be checked is therefore checked while lowering; a failure that is only visible at run time is made impossible to
// miss instead: the handler fills every output but the backward's workspace with 0xFF bytes (NaN in float32, bfloat16
// and float16, so the result cannot pass as data), prints the message to stderr, and records it so
// te_jax.raise_legacy_failures() raises it.
#pragma once

#include <optional>
#include <string>

#include "cpp/core/status.h"

namespace te_jax::legacy {

void RecordLegacyFailure(const char* target, const Status& status);

// Returns and clears the failures recorded since the last call (joined by newlines), if any.
std::optional<std::string> TakeLegacyFailures();

}  // namespace te_jax::legacy
