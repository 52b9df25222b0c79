"""--plot out.png: throughput against sequence length, one line per backend (the same colour in every panel), one panel
per (mode, mask, head dim / model). Decode panels (one query, or queries at the end of the keys, forward) plot the K/V
bandwidth against the KV length: they are memory-bound, and their FLOP rate says little."""

from __future__ import annotations

from te_jax.bench.cases import short_dtype
from te_jax.bench.results import Result
from te_jax.bench.table import bandwidth_unit, throughput_unit

_MARKERS = "osD^v<>ph*"


def _seq_label(n: int) -> str:
  return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _col_key(r: Result):
  c = r.case
  return (c.label, c.head_dim, c.heads, c.kv_heads)


def _is_decode(group: list[Result]) -> bool:
  """Queries at the end of a KV cache: plotted against the KV length."""
  return bool(group) and all(r.case.seq_q == 1 or r.case.bottom_right for r in group)


def _row_key(r: Result):
  return (("fwd", "bwd", "fwd+bwd").index(r.mode), r.case.causal, r.case.mask_label, r.case.dtype)


def plot(path: str, results: list[Result], platform: str, baseline: str, title: str, backend_order: list[str]) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  flop_axis, bandwidth_axis = throughput_unit(platform), bandwidth_unit(platform)
  ok = [r for r in results if r.status == "ok" and (r.tflops or r.tbps)]  # a data-movement row has bandwidth only
  panels: dict[tuple, list[Result]] = {}
  for r in sorted(results, key=lambda r: (_row_key(r), _col_key(r))):
    panels.setdefault((_row_key(r), _col_key(r)), [])
  for r in ok:
    panels[(_row_key(r), _col_key(r))].append(r)
  keys = list(panels)
  n_cols = len({k[1] for k in keys})
  n_cols = n_cols if n_cols <= 4 else 3
  if n_cols == 1:
    n_cols = 2
  n_cols = max(1, min(n_cols, len(keys)))
  n_rows = max(1, -(-len(keys) // n_cols))
  fig_w = max(4.2 * n_cols, 9.0)
  try:
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(fig_w, 3.3 * n_rows + 1.2), squeeze=False, layout="constrained")
    outside = True
  except TypeError:  # matplotlib < 3.5
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(fig_w, 3.3 * n_rows + 1.2), squeeze=False)
    outside = False
  names = [b for b in backend_order if any(r.backend == b for r in ok)]
  names += sorted({r.backend for r in ok} - set(names))
  cmap = plt.get_cmap("tab10")
  style = {b: dict(color=cmap(i % 10), marker=_MARKERS[i % len(_MARKERS)]) for i, b in enumerate(names)}
  handles = {}
  any_bandwidth = False
  for ax, key in zip(axes.flat, keys):
    (mode_index, _, mask, dtype), (label, head_dim, heads, kv_heads) = key
    group = panels[key]
    decode = _is_decode(group)
    bandwidth = decode and all(r.tbps for r in group)  # forward decoding: memory-bound
    any_bandwidth |= bandwidth
    unit, factor = bandwidth_axis if bandwidth else flop_axis
    xs_all = set()
    for b in names:
      values = (((r.case.seq_kv if decode else r.case.seq_q), r.tbps if bandwidth else r.tflops)
                for r in group if r.backend == b)
      pts = sorted((x, y * factor) for x, y in values if y)
      if not pts:
        continue
      xs, ys = zip(*pts)
      xs_all.update(xs)
      te = b.startswith("te_jax")
      (line,) = ax.plot(xs, ys, label=b, linewidth=2.4 if te else 1.4, markersize=5 if te else 4,
                        linestyle="--" if b == baseline else "-", **style[b])
      handles[b] = line
    heads_label = f"H={heads}" + (f"/{kv_heads}" if kv_heads != heads else "")
    ax.set_title(f"{label + ', ' if label else ''}D={head_dim} {heads_label}, {mask}, "
                 f"{('fwd', 'bwd', 'fwd+bwd')[mode_index]}", fontsize=9)
    ax.set_xscale("log", base=2)
    if xs_all:
      ticks = sorted(xs_all)
      ax.set_xticks(ticks)
      ax.set_xticklabels([_seq_label(t) for t in ticks], fontsize=8)
    ax.minorticks_off()
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("KV length" if decode else "sequence length", fontsize=8)
    ax.set_ylabel(unit, fontsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if not group:
      ax.text(0.5, 0.5, "no successful runs", ha="center", va="center", transform=ax.transAxes, fontsize=8)
  for ax in list(axes.flat)[len(keys):]:
    ax.axis("off")
  dtypes = sorted({short_dtype(r.case.dtype) for r in results})
  fig.suptitle(f"{title}, {', '.join(dtypes)}\nhigher is better; dashed: the baseline ({baseline}); "
               f"FLOPs = 4·B·H·Sq·Skv·D (x0.5 causal, x2.5 bwd, x3.5 fwd+bwd)"
               f"{'; bandwidth = K/V bytes read / time' if any_bandwidth else ''}", fontsize=10)
  if handles:
    labels = [b for b in names if b in handles]
    kwargs = dict(ncol=min(len(labels), 6), fontsize=9, frameon=False)
    try:
      if not outside:
        raise ValueError
      fig.legend([handles[b] for b in labels], labels, loc="outside lower center", **kwargs)
    except ValueError:  # matplotlib < 3.7 has no "outside" locations
      fig.legend([handles[b] for b in labels], labels, loc="upper center", bbox_to_anchor=(0.5, 0.93), **kwargs)
      fig.tight_layout(rect=(0, 0, 1, 0.88))
  import os
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
