"""te_jax's logger. Kernel compiles at jit time take seconds, so they are announced by default: when the program has
not configured logging itself, the "te_jax" logger writes INFO lines to stderr (TE_JAX_LOG_LEVEL changes the level,
e.g. WARNING to silence them). A program that configures logging gets the records through its own handlers instead."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("te_jax")

if not logging.getLogger().handlers and not logger.handlers:
  _handler = logging.StreamHandler()
  _handler.setFormatter(logging.Formatter("%(message)s"))
  logger.addHandler(_handler)
  logger.setLevel(os.environ.get("TE_JAX_LOG_LEVEL", "INFO").upper())
