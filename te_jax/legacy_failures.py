"""Surfaces failures of legacy custom calls, which XLA gives no way to report (legacy/legacy_failure.h)."""

from __future__ import annotations

from te_jax._backends import loaded_extensions


class LegacyCustomCallError(RuntimeError):
  """A legacy te_jax custom call failed at run time; its outputs were filled with NaN."""


def raise_legacy_failures() -> None:
  """Raises LegacyCustomCallError if any legacy te_jax call failed since the last check.

  The legacy path cannot fail the XLA program (XLA does not export the status API to plugins), so a failed call fills
  its outputs with NaN, prints the reason to stderr and records it; call this after a step to turn it into an error.
  """
  failures = [f for ext in loaded_extensions() if (f := ext.take_legacy_failures())]
  if failures:
    raise LegacyCustomCallError("\n".join(failures))
