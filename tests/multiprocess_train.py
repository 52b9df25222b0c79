"""Trains a tiny attention model a few steps with context parallelism and prints the losses as JSON.

  python tests/multiprocess_train.py --num-processes 2 --process-id 0 --port 12345   (one of two processes)
  python tests/multiprocess_train.py --num-processes 1                                (the single-process baseline)

Every process contributes 8 // num_processes CPU devices; the global mesh is (dp=2, cp=4, tp=1) over all 8 devices,
the sequence is sharded over cp (ring strategy, causal, load balanced) and the batch over dp. tests/
test_multiprocess.py runs both and compares the losses.
"""

from __future__ import annotations

import argparse
import contextlib
import json


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--strategy", default="ring")
  parser.add_argument("--no-cp", action="store_true", help="the reference: one device, no sharding, natural order")
  args = parser.parse_args()

  import jax
  jax.config.update("jax_num_cpu_devices", 8 // args.num_processes)
  if args.num_processes > 1:
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  import te_jax

  assert jax.device_count() == 8, jax.devices()
  mesh = jax.make_mesh((2, 4, 1), ("dp", "cp", "tp"), axis_types=(AxisType.Auto,) * 3)
  cp = mesh.shape["cp"]
  batch, seqlen, model, heads, head_dim = 4, 32, 32, 4, 8
  rng = np.random.default_rng(0)
  x_np = rng.standard_normal((batch, seqlen, model)).astype(np.float32)
  y_np = rng.standard_normal((batch, seqlen, model)).astype(np.float32)
  params_np = {n: (rng.standard_normal((model, heads * head_dim)) / np.sqrt(model)).astype(np.float32)
               for n in ("wq", "wk", "wv")}
  params_np["wo"] = (rng.standard_normal((heads * head_dim, model)) / np.sqrt(heads * head_dim)).astype(np.float32)
  # Load balancing: the sequence is reordered once; the loss is a sum over positions, so it needs no inverse.
  if not args.no_cp:
    x_np = np.asarray(te_jax.reorder_for_load_balancing(x_np, cp))
    y_np = np.asarray(te_jax.reorder_for_load_balancing(y_np, cp))

  data_sharding = NamedSharding(mesh, P("dp", "cp", None))
  replicated = NamedSharding(mesh, P())

  def put(a, sharding):  # every process builds the same global array and contributes its addressable shards
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

  if args.no_cp:
    x, y, params = jnp.asarray(x_np), jnp.asarray(y_np), jax.tree.map(jnp.asarray, params_np)
  else:
    x, y = put(x_np, data_sharding), put(y_np, data_sharding)
    params = {n: put(p, replicated) for n, p in params_np.items()}
  cp_kwargs = {} if args.no_cp else dict(context_parallel_axis="cp", context_parallel_strategy=args.strategy,
                                         context_parallel_load_balanced=True)

  def loss_fn(params, x, y):
    b, s, _ = x.shape
    split = lambda t: t.reshape(b, s, heads, head_dim)
    q, k, v = (split(x @ params[n]) for n in ("wq", "wk", "wv"))
    out = te_jax.fused_attn(q, k, v, mask_type="causal", **cp_kwargs)
    pred = out.reshape(b, s, heads * head_dim) @ params["wo"]
    return jnp.mean((pred - y) ** 2)

  with jax.set_mesh(mesh) if not args.no_cp else contextlib.nullcontext():
    @jax.jit
    def step(params, x, y):
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

    losses = []
    for _ in range(args.steps):
      params, loss = step(params, x, y)
      losses.append(float(loss))  # replicated scalar: readable in every process
  print("LOSSES " + json.dumps(losses), flush=True)
  if args.num_processes > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
