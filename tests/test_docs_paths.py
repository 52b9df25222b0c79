"""Every file path the README and docs/ name exists in the repository, so moving or removing a file without updating
the manual fails here. A path is resolved from the repository root, or for the kernel tree's short forms from
cpp/cuda/ (kernels/...), cpp/cuda/kernels/ (common/..., primitives/..., sm80/..., sm90/..., decode/...) and
cpp/ (cpu/..., core/..., cuda/...)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w./-])((?:cpp|te_jax|tests|scripts|docs|ffi|legacy|bindings|examples|kernels|common|"
                  r"primitives|sm80|sm90|decode|cpu|core|cuda|modules|cudnn)/(?:[\w./-]|\{[\w,]+\})*[\w}])")
BRACES = re.compile(r"\{([\w,]+)\}")
BASES = ("", "cpp/", "cpp/cuda/", "cpp/cuda/kernels/")


def _expanded(path: str) -> list[str]:
  """h100-decode-round{1,2}.json names two files."""
  match = BRACES.search(path)
  if match is None:
    return [path]
  return [p for alt in match.group(1).split(",") for p in _expanded(path[:match.start()] + alt + path[match.end():])]


def _exists(path: str) -> bool:
  return all(any((ROOT / base / p).exists() for base in BASES) for p in _expanded(path))


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc):
  text = (ROOT / doc).read_text()
  missing = sorted({p for p in PATH.findall(text) if not _exists(p.rstrip("."))})
  assert not missing, f"{doc} names paths that do not exist: {missing}"
