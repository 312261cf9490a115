"""Tensor parallelism (Megatron-style) over ``torch.distributed``: heads and MLP columns split across ranks.

- :mod:`.groups`: :class:`TensorParallelGroup`, the process group (gloo on the CPU, NCCL on CUDA) and
  the few collectives the model and the executor use.
- :mod:`.sharding`: which rows/columns of each weight a rank holds (:class:`WeightShard`, read shard by
  shard by the loader), the refusals (:func:`check_tensor_parallel`), :class:`RowParallelLinear`.
- :mod:`.executor_hook`: :class:`TensorParallelHook` for the executor (the most loaded rank's free
  pages, rank 0's tokens, the non-finite flags of every rank) and its resource manager.
- :mod:`.launcher`: :class:`TensorParallelExecutor`, N spawned worker processes driven like one
  executor (``LLM(..., tensor_parallel_size=N)``).

The paper's design (DiffKV section 7: one worker per GPU owns a memory manager for its attention heads);
the layout and the collectives follow Megatron-LM (arXiv:1909.08053, section 3). docs/RUNTIME.md
"Tensor parallelism" says what ran and what did not. Names are imported on first use.
"""
from ..lazy import lazy_exports

_LAZY = {
    "TensorParallelGroup": ".groups", "init_tensor_parallel": ".groups",
    "WeightShard": ".sharding", "RowParallelLinear": ".sharding", "check_tensor_parallel": ".sharding",
    "load_model_shard": ".sharding",
    "TensorParallelHook": ".executor_hook", "TensorParallelResourceManager": ".executor_hook",
    "TensorParallelExecutor": ".launcher",
}
__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
