"""Context (sequence) parallelism: fused_attn over q, k and v whose sequence dimension is sharded over a mesh axis.

Each device holds a contiguous shard of q, k and v along the sequence (or, with load balancing, two chunks: see
te_jax/load_balancing.py) and computes its own query rows. te_jax/sharding.py runs local_forward / local_backward on
each shard (inside shard_map or a custom_partitioning lowering), and unpartitioned_forward / unpartitioned_backward
where one device holds the whole sequence. docs/SHARDING.md derives the rules.

  layout.py         the ContextParallel layout of a call, and the checks of what it supports
  chunks.py         which chunks of the sequence a shard holds, and their orders
  blocks.py         one (query block, key block) pair as one kernel call: its geometry and dropout offsets
  all_gather.py     the all_gather strategy
  ring.py           the ring strategy
  packed.py         calls with segment ids or positions, either strategy
  local.py          the per-shard forward and backward: the packed path, or the call's strategy
  unpartitioned.py  the same meaning on one device
"""

from te_jax.context_parallel.layout import ContextParallel, check_lengths, check_supported, make
from te_jax.context_parallel.local import local_backward, local_forward
from te_jax.context_parallel.unpartitioned import unpartitioned_backward, unpartitioned_forward

__all__ = ["ContextParallel", "check_lengths", "check_supported", "make", "local_backward", "local_forward",
           "unpartitioned_backward", "unpartitioned_forward"]
