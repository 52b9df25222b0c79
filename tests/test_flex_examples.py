"""docs/flex_attention.md's Examples run as written: each Python block of the section after the first (which sets up
the inputs), in one namespace on the CPU, and their outputs are finite."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
import pytest

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "flex_attention.md"


def _blocks() -> list[str]:
  section = DOC.read_text().split("## Examples", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_section_has_a_setup_and_five_examples():
  assert len(_blocks()) == 6


@pytest.mark.parametrize("index", range(1, 6))
def test_example_runs(index):
  setup, example = _blocks()[0], _blocks()[index]
  namespace: dict = {}
  with jax.default_device(jax.devices("cpu")[0]):
    exec(compile(setup, f"{DOC}:setup", "exec"), namespace)
    exec(compile(example, f"{DOC}:example {index}", "exec"), namespace)
  out = namespace.get("out", namespace.get("grad"))
  assert out is not None and np.isfinite(np.asarray(out)).all()
