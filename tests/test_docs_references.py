"""What the README and docs/ cite exists: every file path they name is in the repository, and every harness command
(`python -m te_jax.bench ...`) parses, with backends and presets the harness has; so moving a file or renaming a flag
without updating the manual fails here. A path is resolved from the repository root, or for the kernel tree's short forms from
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


def _harness_commands(text: str) -> list[str]:
  """The `python -m te_jax.bench ...` commands of a doc: inline `...` spans (which may wrap lines) and code lines
  (with their backslash continuations), without environment prefixes, comments and [a | b] alternatives."""
  text = re.sub(r"\\\n\s*", " ", text)
  spans = [" ".join(span.split()) for span in re.findall(r"`([^`]*)`", text)]
  lines = re.sub(r"`[^`]*`", "", text).splitlines()
  # (the harness's own command, not one of its modules': te_jax.bench.first_call)
  found = [c for piece in spans + lines for c in re.findall(r"python -m te_jax\.bench(?![.\w])([^#]*)", piece)]
  return [re.sub(r"\[[^\]]*\|[^\]]*\]", "", args).strip() for args in found]


@pytest.mark.parametrize("doc", DOCS)
def test_every_harness_command_a_doc_cites_parses(doc):
  import shlex

  from te_jax.bench import __main__ as harness
  from te_jax.bench import registry
  from te_jax.bench.presets import PRESETS, CaseList
  commands = _harness_commands((ROOT / doc).read_text())
  known = {b.name for b in registry.all_backends()}
  for command in commands:
    args = harness.parse_args(shlex.split(command))
    for name in filter(None, (args.backends or "").split(",")):
      assert name in known or any(k.startswith(name + "-") for k in known), f"{doc}: {command}: backend {name}"
    if args.baseline:
      assert args.baseline in known, f"{doc}: {command}: baseline {args.baseline}"
    if isinstance(PRESETS[args.preset]("gpu"), CaseList):
      harness.refuse_shape_flags(args)  # an explicit case list takes no shape flags
