"""The attention masks. The integer values are shared with the C++ core (cpp/core/mask_type.h): never renumber."""

from __future__ import annotations

import enum


class MaskType(enum.IntEnum):
  NO_MASK = 0
  CAUSAL = 1
  CAUSAL_BOTTOM_RIGHT = 2
  PADDING = 3
  PADDING_CAUSAL = 4
  PADDING_CAUSAL_BOTTOM_RIGHT = 5

  @property
  def is_padding(self) -> bool:
    return self in (MaskType.PADDING, MaskType.PADDING_CAUSAL, MaskType.PADDING_CAUSAL_BOTTOM_RIGHT)

  @property
  def is_causal(self) -> bool:
    return self in (MaskType.CAUSAL, MaskType.CAUSAL_BOTTOM_RIGHT, MaskType.PADDING_CAUSAL,
                    MaskType.PADDING_CAUSAL_BOTTOM_RIGHT)

  @property
  def is_bottom_right(self) -> bool:
    return self in (MaskType.CAUSAL_BOTTOM_RIGHT, MaskType.PADDING_CAUSAL_BOTTOM_RIGHT)

  @classmethod
  def parse(cls, value: "MaskType | str") -> "MaskType":
    """Accepts a MaskType or its lower-case name ("padding_causal")."""
    if isinstance(value, cls):
      return value
    if isinstance(value, str):
      try:
        return cls[value.upper()]
      except KeyError:
        pass
    allowed = ", ".join(repr(m.name.lower()) for m in cls)
    raise ValueError(f"mask_type must be one of {allowed} (or a te_jax.MaskType), got {value!r}")
