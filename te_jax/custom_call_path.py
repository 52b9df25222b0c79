"""Which custom-call path the lowering emits: the XLA FFI (default) or the legacy opaque-descriptor call.

The choice is read when a function is lowered, from `custom_call_path(...)` if one is active, else from the environment
variable TE_JAX_CUSTOM_CALL. It is a JAX configuration state that is part of jit's cache key, so a function jitted once
and called under both paths is compiled once per path. Both paths call the same C++ core and give bitwise equal results.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from jax._src import config as jax_config

PATHS = ("ffi", "legacy")
ENV_VAR = "TE_JAX_CUSTOM_CALL"


def _checked(path: object, source: str) -> str:
  if path not in PATHS:
    raise ValueError(f"{source} must be one of {', '.join(map(repr, PATHS))}, got {path!r}")
  return path  # type: ignore[return-value]


# Checked here first so a bad value gets this message rather than JAX's generic flag error.
_checked(os.environ.get(ENV_VAR, "ffi"), f"environment variable {ENV_VAR}")

_path_state = jax_config.enum_state(
    name=ENV_VAR.lower(),
    enum_values=list(PATHS),
    default="ffi",
    help="te_jax custom-call path: 'ffi' (XLA FFI, api_version 4) or 'legacy' (opaque descriptor).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


def current_custom_call_path() -> str:
  """The path a lowering started now would use."""
  return _path_state.value


@contextlib.contextmanager
def custom_call_path(path: str) -> Iterator[None]:
  """Lowers te_jax calls inside the block through `path` ("ffi" or "legacy")."""
  with _path_state(_checked(path, "custom_call_path")):
    yield
