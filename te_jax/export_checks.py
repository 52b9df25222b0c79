"""Serialising functions that call te_jax with `jax.export`.

JAX refuses to export a custom call that has no compatibility guarantee unless the caller disables that check for its
target. te_jax gives no guarantee across its own versions: run a serialised function with the te_jax version that
exported it, in a process that has imported te_jax (the import registers its targets with XLA). A mismatch fails
loudly rather than misreading: the FFI path's handlers decode typed attributes by name, and the legacy path's decoder
refuses a descriptor of another size or version."""

from __future__ import annotations

from jax import export

from te_jax._backends import registered_targets


def disabled_export_checks() -> list[export.DisabledSafetyCheck]:
  """The checks `jax.export.export` must skip for a function that calls te_jax, one per te_jax custom-call target:

    exported = jax.export.export(jax.jit(f), disabled_checks=te_jax.disabled_export_checks())(*args)
  """
  return [export.DisabledSafetyCheck.custom_call(name) for name in registered_targets()]
