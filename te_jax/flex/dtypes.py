"""The JAX dtypes generated code computes in, their C++ types, and literals written bit-exactly."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

# The C++ type a value of each dtype is held in. bfloat16 and float16 values are floats holding the rounded value
# (cpp/core/flex_math.h); int64 and uint64 appear only with jax_enable_x64.
VALUE_TYPES = {
    np.dtype(jnp.float32): "float",
    np.dtype(jnp.bfloat16): "float",
    np.dtype(jnp.float16): "float",
    np.dtype(np.bool_): "bool",
    np.dtype(np.int8): "int8_t",
    np.dtype(np.int16): "int16_t",
    np.dtype(np.int32): "int32_t",
    np.dtype(np.int64): "int64_t",
    np.dtype(np.uint8): "uint8_t",
    np.dtype(np.uint16): "uint16_t",
    np.dtype(np.uint32): "uint32_t",
    np.dtype(np.uint64): "uint64_t",
}
# The C++ element type of a captured array's pointer: a half-precision element is read as its bits and widened.
ELEMENT_TYPES = {**VALUE_TYPES, np.dtype(jnp.bfloat16): "uint16_t", np.dtype(jnp.float16): "uint16_t"}
# The function widening a half-precision element's bits to its float value.
WIDEN = {np.dtype(jnp.bfloat16): "BFloat16Value", np.dtype(jnp.float16): "Float16Value"}
# The function rounding a float to a half-precision dtype's value.
ROUND = {np.dtype(jnp.bfloat16): "RoundToBFloat16", np.dtype(jnp.float16): "RoundToFloat16"}
# The C++ type of positions in captured arrays (cpp/core/flex_math.h: 64 bits on the host, 32 in the CUDA kernels).
INDEX = "FlexIndex"
# Index dtypes whose values a FlexIndex holds on both sides; wider ones are clamped as int64_t.
_NARROW_INDEXES = {np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16)}


def allowed_names() -> str:
  return ", ".join(str(d) for d in VALUE_TYPES)


def is_float(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)  # numpy's issubdtype does not know bfloat16


def value_type(dtype, where: str) -> str:
  """The C++ type of a value of dtype, or a TypeError naming where the dtype appeared."""
  dtype = np.dtype(dtype)
  if dtype not in VALUE_TYPES:
    raise TypeError(f"{where} has dtype {dtype}, which te_jax cannot compile into a kernel; supported dtypes: "
                    f"{allowed_names()}")
  return VALUE_TYPES[dtype]


def index_cast(index) -> tuple[str, str]:
  """A scalar index (a Dense) as ClampIndex takes it: (its C++ type, the expression converting it)."""
  ctype = INDEX if np.dtype(index.dtype) in _NARROW_INDEXES else "int64_t"
  return ctype, f"{ctype}({index.expr()})"


def literal(value, dtype) -> str:
  """A C++ expression of exactly this value: floats as hex literals (NaN and infinities by their bits), integers in
  their own type so templates deduce it."""
  dtype = np.dtype(dtype)
  value = np.asarray(value).astype(dtype)
  if dtype == np.bool_:
    return "true" if value else "false"
  if is_float(dtype):
    single = np.float32(value)
    if not np.isfinite(single):
      return f"FloatFromBits(0x{int(single.view(np.uint32)):08x}u)"
    mantissa, exponent = float(single).hex().split("p")
    return f"{mantissa.rstrip('0').rstrip('.')}p{exponent}f"
  ctype = VALUE_TYPES[dtype]
  number = int(value)
  if number == np.iinfo(dtype).min and np.iinfo(dtype).min < 0:
    return f"IntMin<{ctype}>()"  # -2147483648 is not a literal: it is the negation of one too large for int
  return f"{ctype}({number}{'u' if dtype.kind == 'u' else ''}{'ll' if dtype.itemsize == 8 else ''})"
