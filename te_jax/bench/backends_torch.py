"""PyTorch backends, where torch is installed: SDPA restricted to one kernel (flash, cuDNN, memory-efficient) with
torch.nn.attention.sdpa_kernel, Dao's FlashAttention (flash_attn / FA3's flash_attn_interface) and FlexAttention. Inputs are
converted once in setup (NumPy -> tensors in the backend's native layout on the device); on a GPU calls are timed with
CUDA events after a synchronisation, on the CPU (SDPA's flash kernel has a CPU version) with the wall clock."""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import warnings

import numpy as np

from te_jax.bench.cases import Case
from te_jax.bench.registry import Backend, Capabilities, Prepared, register

HALF = ("bfloat16", "float16")


def _torch_dtype(torch, dtype: str):
  return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


class TorchPrepared(Prepared):

  def __init__(self, backend: "TorchBackend", inputs, mode: str, num_sets: int):
    import torch
    self._torch = torch
    case = inputs.case
    self._backend, self._mode, self._layout = backend, mode, backend.layout
    self._cuda = torch.cuda.is_available()
    device = torch.device("cuda" if self._cuda else "cpu")
    dtype = _torch_dtype(torch, case.dtype)

    def to_torch(x):  # [B, S, H, D] NumPy -> the backend's layout on the GPU, contiguous
      t = torch.from_numpy(np.ascontiguousarray(np.asarray(x, np.float32))).to(device=device, dtype=dtype)
      return t.permute(0, 2, 1, 3).contiguous() if self._layout == "bhsd" else t.contiguous()

    self._fn = backend.attention_fn(case, inputs.alibi, device)
    self._ctx = backend.kernel_context
    self._sets = []
    for s in inputs.sets[:num_sets]:
      q, k, v, dout = (to_torch(x) for x in (s.q, s.k, s.v, s.dout))
      if mode != "fwd":
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
      self._sets.append([q, k, v, dout, None])
    with self._ctx():
      if mode == "bwd":  # the forward runs in setup; the timed call is the backward alone
        for entry in self._sets:
          entry[4] = self._call_fwd(entry)
      if not self._cuda:
        self.memory_bytes = None
        self._next = 0
        return
      torch.cuda.synchronize()
      # Peak memory of one call: what it allocates on top of what is live, plus its own inputs.
      base = torch.cuda.memory_allocated()
      torch.cuda.reset_peak_memory_stats()
      result = self._call(self._sets[0])
      torch.cuda.synchronize()
      in_bytes = sum(t.numel() * t.element_size() for t in self._sets[0][:4])
      self.memory_bytes = int(torch.cuda.max_memory_allocated() - base + in_bytes)
      self.memory_source = "torch"
      del result
    self._next = 0

  def _call_fwd(self, entry):
    q, k, v = entry[:3]
    return self._fn(q, k, v)

  def _call(self, entry):
    torch = self._torch
    q, k, v, dout, out = entry
    if self._mode == "fwd":
      with torch.no_grad():
        return self._fn(q, k, v)
    if self._mode == "bwd":
      return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return torch.autograd.grad(self._fn(q, k, v), (q, k, v), dout)

  def run_calls(self, n: int) -> float:
    torch = self._torch
    sets, k, start = self._sets, len(self._sets), self._next
    if not self._cuda:  # CPU kernels run synchronously
      with self._ctx():
        t0 = time.perf_counter()
        for i in range(start, start + n):
          self._call(sets[i % k])
        elapsed = time.perf_counter() - t0
      self._next = (start + n) % k
      return elapsed
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with self._ctx():
      torch.cuda.synchronize()
      begin.record()
      for i in range(start, start + n):
        self._call(sets[i % k])
      end.record()
      end.synchronize()
    self._next = (start + n) % k
    return begin.elapsed_time(end) / 1e3

  def outputs(self) -> dict:
    with self._ctx():
      result = self._call(self._sets[0])
    names = ("out",) if self._mode == "fwd" else ("dq", "dk", "dv")
    result = result if isinstance(result, (tuple, list)) else (result,)
    outs = {}
    for name, t in zip(names, result):
      t = t.detach()
      if self._layout == "bhsd":
        t = t.permute(0, 2, 1, 3)
      outs[name] = t.float().cpu().numpy().astype(np.float64)
    return outs

  def close(self) -> None:
    self._sets = None
    if self._cuda:
      self._torch.cuda.empty_cache()


class TorchBackend(Backend):
  framework = "torch"
  requires = ("torch",)
  layout = "bhsd"
  torch_module = ""  # a torch module the backend needs, which older torches lack

  def platform_reason(self, platform: str) -> str | None:
    reason = super().platform_reason(platform)
    if reason:
      return reason
    import importlib
    import torch
    if platform == "gpu" and not torch.cuda.is_available():
      return f"torch {torch.__version__} sees no CUDA GPU"
    if platform == "cpu" and torch.cuda.is_available():
      return "JAX runs on the CPU here but torch would use the GPU"
    if self.torch_module:
      try:
        importlib.import_module(self.torch_module)
      except ImportError as e:
        return f"this torch has no {self.torch_module} ({e})"
    return None

  @contextlib.contextmanager
  def kernel_context(self):
    yield

  def attention_fn(self, case: Case, alibi, device):
    raise NotImplementedError

  def prepare(self, inputs, mode: str, num_sets: int) -> Prepared:
    return TorchPrepared(self, inputs, mode, num_sets)


def _sdpa_has_gqa() -> bool:
  """SDPA is a builtin without an inspectable signature; its docstring lists enable_gqa from torch 2.5 on."""
  import torch
  import torch.nn.functional as F
  try:
    return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
  except (TypeError, ValueError):
    pass
  if "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or ""):
    return True
  try:
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)
  except ValueError:
    return True  # let the call itself say


class TorchSdpaBackend(TorchBackend):
  """F.scaled_dot_product_attention with only one SDPA kernel allowed."""
  torch_module = "torch.nn.attention"

  def __init__(self, kernel: str, label: str, platforms: dict):
    self.kernel = kernel  # SDPBackend member name
    self.name = f"torch-{label.lower()}"
    self.label = f"torch SDPA {label}"
    self.url = f"torch.nn.functional.scaled_dot_product_attention + sdpa_kernel(SDPBackend.{kernel})"
    self.caps = Capabilities(platforms=platforms)

  def platform_reason(self, platform: str) -> str | None:
    reason = super().platform_reason(platform)
    if reason:
      return reason
    from torch.nn.attention import SDPBackend
    if not hasattr(SDPBackend, self.kernel):
      return f"this torch has no SDPBackend.{self.kernel}"
    return None

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    if case.gqa and not _sdpa_has_gqa():
      return "this torch's SDPA has no enable_gqa (torch >= 2.5)"
    return None

  @contextlib.contextmanager
  def kernel_context(self):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([getattr(SDPBackend, self.kernel)]):
      yield

  def attention_fn(self, case: Case, alibi, device):
    import torch.nn.functional as F
    kwargs = dict(is_causal=case.causal)
    if case.gqa:
      kwargs["enable_gqa"] = True

    def fn(q, k, v):
      try:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
      except RuntimeError as e:
        # With one kernel allowed SDPA raises "No available kernel" and *warns* why; rerun to keep the why.
        with warnings.catch_warnings(record=True) as caught:
          warnings.simplefilter("always")
          try:
            F.scaled_dot_product_attention(q, k, v, **kwargs)
          except RuntimeError:
            pass
        why = "; ".join(str(w.message).strip().splitlines()[0] for w in caught)
        raise RuntimeError(f"{e}".strip() + (f" ({why})" if why else "")) from None
    return fn


class FlashAttnBackend(TorchBackend):
  """Dao-AILab FlashAttention: flash_attn.flash_attn_func (FA2) or flash_attn_interface.flash_attn_func (FA3)."""
  layout = "bshd"

  def __init__(self, module: str, name: str, label: str):
    self.module = module
    self.name, self.label = name, label
    self.requires = (module, "torch")
    self.url = f"{module}.flash_attn_func"
    # Causal masks are bottom-right aligned there, which equals top-left only when Sq == Skv.
    self.caps = Capabilities(platforms={"gpu": HALF}, causal_cross=False, bottom_right=True, window=True, softcap=True,
                             alibi=True)

  def _params(self):
    import importlib
    fn = importlib.import_module(self.module).flash_attn_func
    return fn, set(inspect.signature(fn).parameters)

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    if case.window is not None and case.seq_q != case.seq_kv:
      return "windows are bottom-right aligned; this case needs top-left with Sq != Skv"
    _, params = self._params()
    for feature, wanted in (("window_size", case.window is not None), ("softcap", bool(case.softcap)),
                            ("alibi_slopes", case.alibi)):
      if wanted and feature not in params:
        return f"this {self.module} has no {feature}"
    return None

  def attention_fn(self, case: Case, alibi, device):
    import torch
    fn, params = self._params()
    kwargs = dict(softmax_scale=1.0 / math.sqrt(case.head_dim), causal=case.causal)
    if case.window is not None:
      kwargs["window_size"] = case.window
    if case.softcap:
      kwargs["softcap"] = case.softcap
    if alibi is not None:
      kwargs["alibi_slopes"] = torch.from_numpy(alibi).to(device)

    def call(q, k, v):
      out = fn(q, k, v, **kwargs)
      return out[0] if isinstance(out, tuple) else out
    return call


class TorchFlexBackend(TorchBackend):
  """PyTorch's FlexAttention (torch.nn.attention.flex_attention under torch.compile, its Triton kernels) with the
  case's mask as a mask_mod and its block mask made in setup: the peer of te_jax-block-mask."""
  torch_module = "torch.nn.attention.flex_attention"

  def __init__(self):
    self.name = "torch-flex"
    self.label = "torch FlexAttention (compiled), the mask as a mask_mod"
    self.url = "torch.compile(flex_attention)(q, k, v, block_mask=create_block_mask(mask_mod, ...))"
    self.caps = Capabilities(platforms={"gpu": HALF}, causal_cross=False)

  def attention_fn(self, case: Case, alibi, device):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
      return q_idx >= kv_idx

    block_mask = create_block_mask(causal, None, None, case.seq_q, case.seq_kv, device=device) if case.causal else None
    compiled = torch.compile(flex_attention)

    def call(q, k, v):
      return compiled(q, k, v, block_mask=block_mask, enable_gqa=case.gqa)
    return call


for _backend in (TorchSdpaBackend("FLASH_ATTENTION", "flash", {"gpu": HALF, "cpu": ("float32", "bfloat16")}),
                 TorchSdpaBackend("CUDNN_ATTENTION", "cudnn", {"gpu": HALF}),
                 TorchSdpaBackend("EFFICIENT_ATTENTION", "efficient", {"gpu": HALF + ("float32",)}),
                 FlashAttnBackend("flash_attn", "flash-attn", "FlashAttention 2"),
                 FlashAttnBackend("flash_attn_interface", "flash-attn-3", "FlashAttention 3"), TorchFlexBackend()):
  register(_backend)
