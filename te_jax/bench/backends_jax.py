"""JAX backends: te_jax (FFI and legacy custom calls; a batch packed into one row; context parallelism over several
devices; a paged KV cache), jax.nn.dot_product_attention (cuDNN and XLA), Pallas GPU flash attention, flash-attn-jax
and tokamax (its Mosaic-GPU, Triton and XLA implementations); and two rows that compute no attention: kv-read, the K/V read alone (a bandwidth ceiling), and
cp-ring-permutes, the context-parallel ring's communication alone. All are timed and measured by JaxPrepared, so they
differ only in the call and where its operands live."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import time

import numpy as np

from te_jax.bench.cases import Case
from te_jax.bench.registry import Backend, Capabilities, Prepared, register

ALL = ("float32", "bfloat16", "float16")
HALF = ("bfloat16", "float16")
# Calls of one timing sample keep their outputs alive until the sample ends; bound what that can hold.
_MAX_LIVE_OUTPUT_BYTES = 2 << 30


class JaxPrepared(Prepared):
  """Inputs placed on the default device once, the mode's function compiled ahead of time (so no compile can land in
  the timed region), and calls dispatched back to back with one block at the end. The case's other operands (slopes,
  a bias, sinks, the dropout key) are arguments of the compiled call too, by fused_attn's names, not constants folded
  into it (a bias can be as large as q)."""

  def __init__(self, backend: "JaxBackend", inputs, mode: str, num_sets: int):
    import jax
    case = inputs.case
    self._jax, self._backend, self._case = jax, backend, case
    fn = backend.attention_fn(case)
    named = {name: jax.device_put(np.asarray(x)) for name, x in inputs.operands().items()}
    host = [(s.q, s.k, s.v, s.dout) for s in inputs.sets[:num_sets]]
    if mode == "fwd":
      host = [backend.fwd_operands(case, q, k, v) for q, k, v, _ in host]
    sets = [backend.place(case, tuple(np.asarray(x) for x in operands)) for operands in host]
    with backend.lowering_context():
      if mode == "fwd":
        args = [(operands, named) for operands in sets]
        compiled = jax.jit(lambda operands, named: fn(*operands, **named)).lower(*args[0]).compile()
        self._names = ("out",)
      elif mode == "fwd+bwd":
        def fwd_bwd(operands, named):
          q, k, v, dout = operands
          return jax.vjp(lambda q, k, v: fn(q, k, v, **named), q, k, v)[1](dout)
        args = [(operands, named) for operands in sets]
        compiled = jax.jit(fwd_bwd).lower(*args[0]).compile()
        self._names = ("dq", "dk", "dv")
      elif mode == "bwd":
        # The forward runs here, in setup; only the backward (the VJP applied to saved residuals) is timed. Every set's
        # residuals have the same structure, so one compiled backward serves them all.
        fwd = jax.jit(fn)
        args, treedef0 = [], None
        for q, k, v, dout in sets:
          _, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, **named), q, k, v)
          leaves, treedef = jax.tree_util.tree_flatten(vjp)
          treedef0 = treedef0 or treedef
          args.append((leaves, dout))
        jax.block_until_ready(args)
        compiled = jax.jit(lambda leaves, dout: jax.tree_util.tree_unflatten(treedef0, leaves)(dout)).lower(
            *args[0]).compile()
        self._names = ("dq", "dk", "dv")
      else:
        raise ValueError(f"unknown mode {mode!r}")
    self._compiled, self._args, self._next = compiled, args, 0
    self._out_bytes = None
    try:
      stats = compiled.memory_analysis()
      self.memory_bytes = int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
                              - stats.alias_size_in_bytes)
      self.memory_source = "xla"
      self._out_bytes = int(stats.output_size_in_bytes)
    except Exception:  # not every platform or version reports it
      self.memory_bytes = None

  def max_calls(self) -> int:
    return max(1, _MAX_LIVE_OUTPUT_BYTES // max(1, self._out_bytes or 1))

  def run_calls(self, n: int) -> float:
    compiled, args, k = self._compiled, self._args, len(self._args)
    start = self._next
    outs = []
    t0 = time.perf_counter()
    for i in range(start, start + n):
      outs.append(compiled(*args[i % k]))
    self._jax.block_until_ready(outs)
    elapsed = time.perf_counter() - t0
    self._next = (start + n) % k
    return elapsed

  def outputs(self) -> dict:
    result = self._compiled(*self._args[0])
    result = result if isinstance(result, (tuple, list)) else (result,)
    return {name: np.asarray(self._backend.restore(self._case, np.asarray(x).astype(np.float32)), np.float64)
            for name, x in zip(self._names, result)}

  def close(self) -> None:
    self._compiled = self._args = None


class JaxBackend(Backend):
  framework = "jax"
  requires = ("jax",)

  def attention_fn(self, case: Case):
    """A JAX-traceable (q, k, v, **operands) -> out in [B, S, H, D] layout, operands being the case's others by
    fused_attn's names (Inputs.operands: only those the backend declares it serves); forward-only backends may take
    other positional operands (those of fwd_operands)."""
    raise NotImplementedError

  def fwd_operands(self, case: Case, q, k, v) -> tuple:
    """The forward's operands, made from the NumPy q, k, v in setup (outside the timed region)."""
    return q, k, v

  def lowering_context(self):
    return contextlib.nullcontext()

  def place(self, case: Case, arrays: tuple) -> tuple:
    """The operands on the device(s), in setup."""
    import jax
    return tuple(jax.device_put(x) for x in arrays)

  def restore(self, case: Case, x):
    """An output (as a NumPy array) in the case's layout and sequence order, for the error check."""
    return x

  def platform_reason(self, platform: str) -> str | None:
    return super().platform_reason(platform)

  def prepare(self, inputs, mode: str, num_sets: int) -> Prepared:
    return JaxPrepared(self, inputs, mode, num_sets)


class TeJaxBackend(JaxBackend):
  """te_jax.fused_attn on one custom-call path with one engine: te_jax-ffi / te_jax-legacy run the default engine
  ("auto": the faster that serves the call, measured on the GPU), te_jax-te and te_jax-cudnn pin one (FFI path)."""

  def __init__(self, path: str, engine: str = "auto"):
    self.path = path
    self.engine = engine
    self.name = f"te_jax-{path}" if engine == "auto" else f"te_jax-{engine}"
    self.label = f"te_jax ({path}, engine {engine})"
    self.url = f'te_jax.fused_attn(engine="{engine}")'
    if engine == "cudnn":
      # cuDNN's fused attention through te_jax: no soft-cap, no arbitrary ALiBi slopes, no bias, not te_jax's dropout
      # (README "Engines"); sinks join after its kernel.
      self.caps = Capabilities(platforms={"gpu": HALF}, window=True, bottom_right=True, sinks=True)
    else:
      self.caps = Capabilities(platforms={"cpu": ALL, "gpu": HALF}, window=True, softcap=True, alibi=True,
                               bottom_right=True, bias=True, sinks=True, dropout=True)

  def platform_reason(self, platform: str) -> str | None:
    reason = super().platform_reason(platform)
    if reason or self.engine != "cudnn":
      return reason
    try:
      from te_jax._cuda import ext
    except ImportError as e:
      return f"te_jax was built without its CUDA backend: {e}"
    available, why = ext.cudnn_available()
    return None if available else why

  def fused_attn_kwargs(self, case: Case) -> dict:
    """fused_attn's keyword arguments besides the operands: the case's, and this backend's."""
    return dict(case.te_jax_kwargs(), engine=self.engine)

  def attention_fn(self, case: Case):
    import te_jax
    kwargs = self.fused_attn_kwargs(case)

    def fn(q, k, v, **operands):
      return te_jax.fused_attn(q, k, v, **kwargs, **operands)
    return fn

  def lowering_context(self):
    import te_jax
    return te_jax.custom_call_path(self.path)


class ContextParallelBackend(TeJaxBackend):
  """te_jax.fused_attn with context parallelism (te_jax-cp-ring, te_jax-cp-all_gather): q, k, v and dout sharded
  along the sequence over a 1-D mesh of the first N devices (`--cp-devices N`, default all), in the load-balanced
  order (te_jax.reorder_for_load_balancing, done in setup; the outputs are put back in natural order for the error
  check). Against te_jax-ffi on one device, its speedup over N is the scaling efficiency."""

  DEVICES_ENV = "TE_JAX_BENCH_CP_DEVICES"  # set by --cp-devices; an environment variable, so --isolate workers see it

  def __init__(self, strategy: str):
    super().__init__("ffi")
    self.strategy = strategy
    self.name = f"te_jax-cp-{strategy}"
    self.label = f"te_jax context parallelism ({strategy}, load-balanced)"
    self.url = f'te_jax.fused_attn(context_parallel_axis=..., context_parallel_strategy="{strategy}")'
    # The core's context-parallel layouts: Sq == Skv, no bottom-right diagonal; windows only with all_gather; no bias.
    self.caps = Capabilities(platforms={"cpu": ALL, "gpu": HALF}, window=strategy == "all_gather", softcap=True,
                             alibi=True, causal_cross=False, sinks=True, dropout=True)

  @classmethod
  def devices(cls):
    import jax
    devices = jax.devices()
    return devices[:int(os.environ.get(cls.DEVICES_ENV) or len(devices))]

  def platform_reason(self, platform: str) -> str | None:
    reason = super().platform_reason(platform)
    if reason:
      return reason
    n = len(self.devices())
    return None if n >= 2 else f"context parallelism needs 2 or more devices; {n} here (--cp-devices, and on the CPU " \
                                "XLA_FLAGS=--xla_force_host_platform_device_count=N)"

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    chunks = 2 * len(self.devices())
    if case.seq_q != case.seq_kv or case.seq_q % chunks:
      return f"Sq = Skv, a multiple of 2 x {chunks // 2} devices (load-balanced chunks)"
    return None

  def _mesh(self):
    import jax
    return jax.sharding.Mesh(np.asarray(self.devices()), ("cp",))

  def place(self, case: Case, arrays: tuple) -> tuple:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from te_jax import reorder_for_load_balancing
    n, sharding = len(self.devices()), NamedSharding(self._mesh(), PartitionSpec(None, "cp"))
    return tuple(jax.device_put(reorder_for_load_balancing(x, n, 1), sharding) for x in arrays)

  def restore(self, case: Case, x):
    from te_jax import inverse_reorder_for_load_balancing
    return np.asarray(inverse_reorder_for_load_balancing(x, len(self.devices()), 1))

  def fused_attn_kwargs(self, case: Case) -> dict:
    return dict(case.te_jax_kwargs(), context_parallel_axis="cp", context_parallel_strategy=self.strategy,
                context_parallel_load_balanced=True)


class PackedBackend(TeJaxBackend):
  """te_jax.fused_attn on the case's batch of B documents packed into one row of B * S tokens, told apart by segment
  ids (te_jax.segment_ids_from_lengths): beside te_jax-te on the batch itself, what packing costs. te_jax's kernels
  (the cuDNN engine takes no segment ids); each document is a whole sequence, so Sq = Skv."""

  def __init__(self):
    super().__init__("ffi", "te")
    self.name = "te_jax-packed"
    self.label = "te_jax, the batch packed into one row (segment ids)"
    self.url = 'te_jax.fused_attn(q_segment_ids=..., engine="te")'
    self.caps = Capabilities(platforms={"cpu": ALL, "gpu": HALF}, window=True, softcap=True, alibi=True,
                             causal_cross=False, sinks=True)

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    if case.seq_q != case.seq_kv:
      return "a packed row holds whole documents: Sq = Skv"
    if case.batch == 1:
      return "one document: the packed row is the batch"
    return None

  def error_case(self, case: Case) -> Case:
    """Three documents (the small case has one, which packs into itself): one lies between two others."""
    return dataclasses.replace(case.small(), batch=3)

  def place(self, case: Case, arrays: tuple) -> tuple:
    import jax
    return tuple(jax.device_put(x.reshape(1, -1, *x.shape[2:])) for x in arrays)

  def restore(self, case: Case, x):
    return x.reshape(case.batch, -1, *x.shape[2:])

  def fused_attn_kwargs(self, case: Case) -> dict:
    return dict(super().fused_attn_kwargs(case), q_segment_ids=self.segment_ids(case))

  def segment_ids(self, case: Case):
    import te_jax
    return te_jax.segment_ids_from_lengths(np.full((1, case.batch), case.seq_q), case.batch * case.seq_q)


class UnsortedPackedBackend(PackedBackend):
  """te_jax-packed with the documents' ids falling (B, ..., 1): the same attention, but ids that do not rise, which the
  sm90 forward does not read as documents, so its token tables serve the row: what sorted ids save."""

  def __init__(self):
    super().__init__()
    self.name = "te_jax-unsorted-packed"
    self.label = "te_jax, the batch packed into one row, ids falling"

  def segment_ids(self, case: Case):
    ids = super().segment_ids(case)
    return (case.batch + 1 - ids).astype(ids.dtype)


class DeterministicBackend(TeJaxBackend):
  """te_jax's kernels with fused_attn(deterministic=True): a backward that gives the same bits on every run. The flag
  changes only the backward, so only the backward modes run (the forward is te_jax-te's)."""

  def __init__(self):
    super().__init__("ffi", "te")
    self.name = "te_jax-deterministic"
    self.label = "te_jax, deterministic backward"
    self.url = 'te_jax.fused_attn(deterministic=True, engine="te")'
    self.caps = dataclasses.replace(self.caps, modes=("bwd", "fwd+bwd"))

  def fused_attn_kwargs(self, case: Case) -> dict:
    return dict(super().fused_attn_kwargs(case), deterministic=True)


class MaskModBackend(TeJaxBackend):
  """te_jax's kernels with the case's mask written as a mask_mod (te_jax-mask-mod; no mask: one that keeps every key),
  and with a block mask of it made in setup and reused (te_jax-block-mask): what a mask costs as a Python function
  against the built-in one (te_jax-ffi)."""

  def __init__(self, block_mask: bool):
    super().__init__("ffi")
    self.block_mask = block_mask
    self.name = "te_jax-block-mask" if block_mask else "te_jax-mask-mod"
    self.label = "te_jax, the mask as a mask_mod" + (" with a block mask" if block_mask else "")
    self.url = "te_jax.fused_attn(mask_mod=..." + (", block_mask=te_jax.create_block_mask(...))" if block_mask else ")")
    self.caps = Capabilities(platforms={"cpu": ALL, "gpu": HALF}, causal_cross=False)

  def fused_attn_kwargs(self, case: Case) -> dict:
    import te_jax
    causal = case.causal

    def mask_mod(b, h, i, j):
      return j <= i if causal else j >= 0

    kwargs = dict(super().fused_attn_kwargs(case), mask_type="no_mask")
    if self.block_mask:
      kwargs["block_mask"] = te_jax.create_block_mask(mask_mod, None, None, case.seq_q, case.seq_kv)
    else:
      kwargs["mask_mod"] = mask_mod
    return kwargs


class ScoreModBackend(TeJaxBackend):
  """te_jax's kernels with a T5-style relative-position bias written as a score_mod (te_jax-score-mod): a float32
  table [H, 256] of learned values read at the clipped distance, whose gradient the backward adds up too. Beside
  te_jax-ffi (plain attention), what a score_mod with a captured table costs."""

  def __init__(self):
    super().__init__("ffi")
    self.name = "te_jax-score-mod"
    self.label = "te_jax, a relative-position table as a score_mod"
    self.url = "te_jax.fused_attn(score_mod=lambda s, b, h, q, kv: s + table[h, clip(q - kv)])"
    self.caps = Capabilities(platforms={"cpu": ALL, "gpu": HALF}, causal_cross=False)

  @staticmethod
  def _table(case: Case) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((case.heads, 256)) * 0.1).astype(np.float32)

  def fused_attn_kwargs(self, case: Case) -> dict:
    import jax.numpy as jnp
    table = jnp.asarray(self._table(case))

    def score_mod(s, b, h, i, j):
      return s + table[h, jnp.clip(i - j + 128, 0, 255)]

    return dict(super().fused_attn_kwargs(case), score_mod=score_mod)

  def reference_bias(self, case: Case):
    i, j = np.arange(case.seq_q)[:, None], np.arange(case.seq_kv)[None, :]
    return self._table(case)[:, np.clip(i - j + 128, 0, 255)][None]


class RingPermutesBackend(ContextParallelBackend):
  """Not attention: te_jax-cp-ring's communication alone, its N - 1 steps each passing every device's K and V shard to
  the next (lax.ppermute under shard_map), on the ring's sharded inputs, nothing computed. Beside te_jax-cp-ring and
  te_jax-ffi on one device, what the ring leaves exposed (ring - one / N) reads against what its permutes cost
  unhidden. Forward only."""
  computes_attention = False

  def __init__(self):
    super().__init__("ring")
    self.name = "cp-ring-permutes"
    self.label = "the context-parallel ring's K/V permutes alone"
    self.url = "lax.ppermute of K and V under shard_map, N - 1 steps"
    self.caps = dataclasses.replace(self.caps, modes=("fwd",))

  def attention_fn(self, case: Case):
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec
    mesh = self._mesh()
    n = mesh.shape["cp"]
    to_next = [(i, (i + 1) % n) for i in range(n)]
    spec = PartitionSpec(None, "cp")

    def steps(k, v):
      for _ in range(n - 1):
        k, v = lax.ppermute(k, "cp", to_next), lax.ppermute(v, "cp", to_next)
      return k, v
    ring = jax.shard_map(steps, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))

    def fn(q, k, v, **operands):
      return ring(k, v)
    return fn


def _jax_nn_kwargs() -> set[str]:
  import jax
  return set(inspect.signature(jax.nn.dot_product_attention).parameters)


class PagedBackend(JaxBackend):
  """te_jax.paged_attention on the case's K/V in pages of page_size tokens, shuffled through one pool (paging.py).
  Forward only; queries sit at the end of their sequence, so causal masks are bottom-right (or Sq == Skv)."""

  def __init__(self, page_size: int):
    self.page_size = page_size
    self.name = f"te_jax-paged{page_size}"
    self.label = f"te_jax paged attention ({page_size}-token pages)"
    self.url = "te_jax.paged_attention"
    self.caps = Capabilities(platforms={"cpu": ALL, "gpu": HALF}, modes=("fwd",), causal_cross=False,
                             bottom_right=True, window=True, softcap=True, alibi=True)

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    if case.seq_kv % self.page_size:
      return f"Skv ({case.seq_kv}) is not a multiple of the page size ({self.page_size})"
    if case.window is not None and case.seq_q != case.seq_kv and not case.bottom_right:
      return "a window here is aligned at the end of the keys; this case aligns it at the start (Sq != Skv)"
    return None

  def fwd_operands(self, case: Case, q, k, v) -> tuple:
    from te_jax.bench.paging import paged_layout
    paged = paged_layout(k, v, self.page_size)
    return q, paged.k_pages, paged.v_pages, paged.page_table, paged.kv_lengths

  def attention_fn(self, case: Case):
    import te_jax
    # paged_attention has the two masks of queries at the end of the keys: bottom-right causal, or none.
    kwargs = dict(case.te_jax_kwargs(), mask_type="causal_bottom_right" if case.causal else "no_mask")

    def fn(q, k_pages, v_pages, page_table, kv_lengths, **operands):
      return te_jax.paged_attention(q, k_pages, v_pages, page_table, kv_lengths, **kwargs, **operands)
    return fn


def _fp8_cache_workload(charged: dict, case: Case) -> dict:
  """An FP8 KV cache's workload: its K/V bytes one byte an element instead of the case dtype's."""
  if charged.get("kv_bytes"):
    return dict(charged, kv_bytes=charged["kv_bytes"] / np.dtype(case.dtype).itemsize)
  return charged


def _fp8_cache_why_not(case: Case, platform: str) -> str | None:
  """The GPU reads an FP8 KV cache in its decode kernels only (cpp/cuda/kernel_config.cc Fp8Refusal): beyond them
  fused_attn refuses the call and paged_attention dequantizes the pages, which measures no FP8 read."""
  if platform == "gpu" and (case.seq_q > 16 or case.head_dim % 16):
    return "the GPU reads an FP8 KV cache in its decode kernels: at most 16 queries, head dims multiples of 16"
  return None


class Fp8CacheBackend(TeJaxBackend):
  """te_jax.fused_attn over a contiguous FP8 KV cache: k and v quantized to e4m3 per kv head in setup
  (te_jax.quantize_fp8), q in the case's dtype; the kernels read the cache as it is. Forward only (its gradient is q's
  alone)."""

  def __init__(self):
    super().__init__("ffi", "te")
    self.name = "te_jax-fp8-cache"
    self.label = "te_jax, FP8 KV cache (e4m3, a descale per kv head)"
    self.url = "te_jax.fused_attn(k_descale=..., v_descale=...) on te_jax.quantize_fp8(per_head=True)"
    self.caps = dataclasses.replace(self.caps, modes=("fwd",))
    self.fp8 = True

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    return super().extra_why_not(case, mode, platform) or _fp8_cache_why_not(case, platform)

  def fwd_operands(self, case: Case, q, k, v) -> tuple:
    import te_jax
    (k8, k_descale), (v8, v_descale) = (te_jax.quantize_fp8(x, per_head=True) for x in (k, v))
    return q, k8, v8, k_descale, v_descale

  def attention_fn(self, case: Case):
    plain = super().attention_fn(case)

    def fn(q, k8, v8, k_descale, v_descale, **operands):
      return plain(q, k8, v8, k_descale=k_descale, v_descale=v_descale, **operands)
    return fn

  def workload(self, case: Case, mode: str) -> dict:
    return _fp8_cache_workload(super().workload(case, mode), case)


class Fp8AttentionBackend(TeJaxBackend):
  """te_jax.fused_attn on FP8 q, k and v: quantized to e4m3 per tensor in setup (te_jax.quantize_fp8, as
  jax-fp8-cudnn's), out in bfloat16; on Hopper the sm90 FP8 kernel (while it is reached through
  TE_JAX_CUDA_FP8_ATTENTION=1, te_jax/fp8.py), elsewhere the dequantized reference. Forward only."""

  def __init__(self):
    super().__init__("ffi", "te")
    self.name = "te_jax-fp8-qkv"
    self.label = "te_jax, FP8 q, k, v (e4m3, a descale per tensor)"
    self.url = "te_jax.fused_attn(q8, k8, v8, q_descale=..., k_descale=..., v_descale=...)"
    self.caps = dataclasses.replace(self.caps, modes=("fwd",))
    self.fp8 = True

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    why = super().extra_why_not(case, mode, platform)
    if why is None and platform == "gpu" and (case.head_dim != 128 or case.seq_kv % 16):
      why = "the GPU's FP8 kernel takes d 128 and key counts that are multiples of 16"
    return why

  def fwd_operands(self, case: Case, q, k, v) -> tuple:
    import te_jax
    (q8, qd), (k8, kd), (v8, vd) = (te_jax.quantize_fp8(x) for x in (q, k, v))
    return q8, k8, v8, qd, kd, vd

  def attention_fn(self, case: Case):
    plain = super().attention_fn(case)

    def fn(q8, k8, v8, qd, kd, vd, **operands):
      return plain(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **operands)
    return fn


class PagedFp8Backend(PagedBackend):
  """te_jax.paged_attention over an FP8 KV cache: the paged layout's pools quantized to e4m3 in setup
  (te_jax.quantize_kv_pages) with a descale per page and kv head (te_jax-fp8-paged64), or per kv head
  (te_jax-fp8-perhead-paged64: the contiguous FP8 row's scaling, so the two differ by the paging alone), q in the case's
  dtype. Its K/V bytes are the FP8 pools'."""

  def __init__(self, page_size: int, granularity: str = "page"):
    super().__init__(page_size)
    self.granularity = granularity
    self.name = f"te_jax-fp8-paged{page_size}" if granularity == "page" else f"te_jax-fp8-perhead-paged{page_size}"
    self.label = f"te_jax paged attention, FP8 cache ({page_size}-token pages, a descale per {granularity})"
    self.url = ("te_jax.paged_attention(k_descale=..., v_descale=...) on "
                f"te_jax.quantize_kv_pages(granularity='{granularity}')")
    self.fp8 = True

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    return super().extra_why_not(case, mode, platform) or _fp8_cache_why_not(case, platform)

  def fwd_operands(self, case: Case, q, k, v) -> tuple:
    import te_jax
    q, k_pages, v_pages, page_table, kv_lengths = super().fwd_operands(case, q, k, v)
    (k8, k_descale), (v8, v_descale) = (te_jax.quantize_kv_pages(p, granularity=self.granularity)
                                        for p in (k_pages, v_pages))
    return q, k8, v8, page_table, kv_lengths, k_descale, v_descale

  def attention_fn(self, case: Case):
    paged = super().attention_fn(case)

    def fn(q, k_pages, v_pages, page_table, kv_lengths, k_descale, v_descale, **operands):
      return paged(q, k_pages, v_pages, page_table, kv_lengths, k_descale=k_descale, v_descale=v_descale, **operands)
    return fn

  def workload(self, case: Case, mode: str) -> dict:
    return _fp8_cache_workload(super().workload(case, mode), case)


class JaxNNBackend(JaxBackend):
  def __init__(self, implementation: str):
    self.implementation = implementation
    self.name = f"jax-{implementation}"
    self.label = f"JAX {'cuDNN' if implementation == 'cudnn' else 'XLA'}"
    self.url = f'jax.nn.dot_product_attention(implementation="{implementation}")'
    if implementation == "cudnn":
      # cuDNN flash attention: fp16/bf16, D <= 256 on Hopper (128 before), windows only as (left, 0). jax.nn takes a
      # bias, but no sinks or dropout.
      self.caps = Capabilities(platforms={"gpu": HALF}, window=True, window_needs_causal=True, bias=True)
    else:
      self.caps = Capabilities(platforms={"cpu": ALL, "gpu": ALL}, window=True, bias=True)

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    params = _jax_nn_kwargs()
    if "implementation" not in params:
      return "this JAX's dot_product_attention has no implementation= argument"
    if case.window is not None and "local_window_size" not in params:
      return "this JAX's dot_product_attention has no local_window_size"
    return None

  def attention_fn(self, case: Case):
    import jax
    kwargs = dict(is_causal=case.causal, implementation=self.implementation)
    if case.window is not None:
      kwargs["local_window_size"] = case.window

    def fn(q, k, v, bias=None):
      return jax.nn.dot_product_attention(q, k, v, bias=bias, **kwargs)
    return fn


class PallasBackend(JaxBackend):
  name = "pallas"
  label = "Pallas GPU flash"
  url = "jax.experimental.pallas.ops.gpu.attention.mha"
  # Same-size Q/K/V heads, block sizes dividing the sequences, Sq == Skv for the fused backward.
  caps = Capabilities(platforms={"gpu": HALF + ("float32",)}, gqa=False, seq_multiple=128, equal_seq_for_bwd=True,
                      causal_cross=False)

  def attention_fn(self, case: Case):
    # The signature has moved between JAX releases (block_q/block_k ints, then a BlockSizes dataclass); adapt to it.
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    mha = pallas_attention.mha
    params = inspect.signature(mha).parameters
    kwargs = dict(sm_scale=1.0 / math.sqrt(case.head_dim), causal=case.causal)
    small_tiles = case.head_dim > 128  # 128x128 tiles of a 256-wide head exceed shared memory; use 64x64
    if "block_sizes" in params:
      sizes_cls = getattr(pallas_attention, "BlockSizes", None)
      if sizes_cls is not None and hasattr(sizes_cls, "get_default"):
        block_sizes = sizes_cls.get_default()
        if small_tiles and dataclasses.is_dataclass(block_sizes):
          fields = {f.name for f in dataclasses.fields(block_sizes)}
          block_sizes = dataclasses.replace(block_sizes, **{f: 64 for f in ("block_q", "block_k") if f in fields})
        kwargs["block_sizes"] = block_sizes
    elif small_tiles and "block_q" in params and "block_k" in params:
      kwargs.update(block_q=64, block_k=64)

    def fn(q, k, v):
      return mha(q, k, v, None, **kwargs)
    return fn


class FlashAttnJaxBackend(JaxBackend):
  name = "flash-attn-jax"
  label = "flash-attn-jax"
  requires = ("flash_attn_jax",)
  url = "flash_attn_jax.flash_mha"
  # Causal masks are bottom-right aligned there (flash-attn's convention), which equals top-left only when Sq == Skv.
  caps = Capabilities(platforms={"gpu": HALF}, window=True, causal_cross=False, bottom_right=True)

  def attention_fn(self, case: Case):
    from flash_attn_jax import flash_mha
    kwargs = dict(softmax_scale=1.0 / math.sqrt(case.head_dim), is_causal=case.causal)
    if case.window is not None:
      kwargs["window_size"] = case.window

    def fn(q, k, v):
      return flash_mha(q, k, v, **kwargs)
    return fn


class TokamaxBackend(JaxBackend):
  """Google's kernel library for JAX: tokamax.dot_product_attention, jax.nn's contract plus a soft-cap, with one of
  its implementations pinned: "mosaic" (Pallas Mosaic-GPU kernels for Hopper), "triton" (Pallas Triton), "xla"."""
  requires = ("tokamax",)

  def __init__(self, implementation: str):
    self.implementation = implementation
    self.name = f"tokamax-{implementation}"
    self.label = f"tokamax {implementation}"
    self.url = f'tokamax.dot_product_attention(implementation="{implementation}")'
    platforms = {"cpu": ALL, "gpu": ALL} if implementation == "xla" else {"gpu": HALF}
    self.caps = Capabilities(platforms=platforms, window=True, softcap=True, bias=True)

  def attention_fn(self, case: Case):
    import tokamax
    kwargs = dict(is_causal=case.causal, implementation=self.implementation)
    if case.window is not None:
      kwargs["local_window_size"] = case.window
    if case.softcap:
      kwargs["logits_soft_cap"] = case.softcap

    def fn(q, k, v, bias=None):
      return tokamax.dot_product_attention(q, k, v, bias=bias, **kwargs)
    return fn


class CudnnFp8Backend(JaxBackend):
  """cuDNN's FP8 forward through JAX's private call (jax._src.cudnn.fused_attention_stablehlo.dot_product_attention with
  use_fp8=True), the peer of te_jax's FP8 forward: q, k and v quantized to e4m3 per tensor in setup
  (te_jax.quantize_fp8), the probabilities quantized by cuDNN with scale 448 (p in [0, 1] onto e4m3's max), out e4m3 with v's descale (|out|
  <= max |v|), dequantized for the error check only. No mask but causal; forward only (its backward wants FP8
  gradients' scales, which the harness's modes do not model)."""
  name = "jax-fp8-cudnn"
  label = "JAX's private cuDNN FP8 attention"
  url = "jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True)"
  caps = Capabilities(platforms={"gpu": ("bfloat16",)}, modes=("fwd",), causal_cross=False)
  fp8 = True

  def __init__(self):
    self._out_descale = {}  # per case: its input set 0's (the one the error check reads)

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    try:
      from jax._src.cudnn import fused_attention_stablehlo as cudnn
    except ImportError as e:
      return f"this JAX has no private cuDNN attention module: {e}"
    return None if hasattr(cudnn, "FP8Params") else "this JAX's private cuDNN attention has no FP8"

  def fwd_operands(self, case: Case, q, k, v) -> tuple:
    import te_jax
    (q8, qd), (k8, kd), (v8, vd) = (te_jax.quantize_fp8(x) for x in (q, k, v))
    self._out_descale.setdefault(case, float(vd))
    return q8, k8, v8, qd, kd, vd

  def restore(self, case: Case, x):
    return x * self._out_descale[case]

  def attention_fn(self, case: Case):
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    mask = cudnn.MaskType.CAUSAL if case.causal else cudnn.MaskType.NO_MASK
    scale = 1.0 / math.sqrt(case.head_dim)

    def fn(q8, k8, v8, qd, kd, vd):
      one = jnp.ones((1, 1, 1, 1), jnp.float32)
      params = {key: one for key in cudnn.FP8Params.__annotations__}
      params.update(descale_q=qd.reshape(one.shape), descale_k=kd.reshape(one.shape), descale_v=vd.reshape(one.shape),
                    descale_s=one / 448.0, scale_s=one * 448.0, scale_o=(1.0 / vd).reshape(one.shape))
      out, _, _ = cudnn.dot_product_attention(q8, k8, v8, fp8_params=params, scale=scale, mask_type=mask,
                                              use_fp8=True)
      return out
    return fn


class KvReadBackend(JaxBackend):
  """Not attention: XLA reads the case's K and V once (a max over each), the bytes a forward of the case reads at least.
  Its bandwidth is the ceiling a memory-bound forward (decoding) is held to on this device, timed the same way on the
  same rotating inputs."""
  name = "kv-read"
  label = "K/V read by XLA (a bandwidth ceiling)"
  url = "jnp.max(k), jnp.max(v)"
  computes_attention = False
  # Masks and variants change what attention computes, not the K/V it reads: every case is served.
  caps = Capabilities(platforms={"cpu": ALL, "gpu": ALL}, modes=("fwd",), bottom_right=True, window=True, softcap=True,
                      alibi=True, bias=True, sinks=True, dropout=True)

  def attention_fn(self, case: Case):
    import jax.numpy as jnp

    def fn(q, k, v, **operands):
      return jnp.max(k), jnp.max(v)
    return fn


for _backend in (TeJaxBackend("ffi"), TeJaxBackend("legacy"), TeJaxBackend("ffi", "te"), TeJaxBackend("ffi", "cudnn"),
                 DeterministicBackend(), MaskModBackend(False), MaskModBackend(True), ScoreModBackend(), PackedBackend(), UnsortedPackedBackend(), ContextParallelBackend("ring"),
                 ContextParallelBackend("all_gather"), PagedBackend(16), PagedBackend(64), PagedFp8Backend(64),
                 PagedFp8Backend(64, "head"),
                 Fp8CacheBackend(), Fp8AttentionBackend(),
                 JaxNNBackend("cudnn"),
                 JaxNNBackend("xla"), PallasBackend(), FlashAttnJaxBackend(), TokamaxBackend("mosaic"),
                 TokamaxBackend("triton"), TokamaxBackend("xla"), KvReadBackend(), RingPermutesBackend(),
                 CudnnFp8Backend()):
  register(_backend)
