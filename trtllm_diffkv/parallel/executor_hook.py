"""The executor's tensor-parallel hook: every rank runs the same executor loop and takes the same decisions (SPMD).

Each rank owns a :class:`~trtllm_diffkv.runtime.resource_manager.DiffKVResourceManager` (pool, page
manager, row metadata) for its own KV heads (DiffKV section 7: one memory manager per worker). Ranks
receive the same requests and aborts in the same order (:mod:`.launcher`), so the executor's host
state (queues, slots, stop checks) stays identical if three inputs are made identical every step:

* free pages: the scheduler admits and preempts from the MOST LOADED rank's free count
  (:meth:`TensorParallelResourceManager.free_pages`, and the step status' ring counters replaced by
  that minimum). Since each rank's free count is at least the minimum and a step's page need is the
  same on every rank (same geometry), no rank refuses a step another rank plans;
* sampled tokens: rank 0's (the logits are equal on every rank, but unseeded requests draw from a
  generator seeded per process);
* non-finite K/V flags: a request fails on every rank when one rank's heads saw a NaN/Inf.

The last two and the first ride on ONE all-gather of the step's status vector per step
(:meth:`TensorParallelHook.step_status`), next to the model's two all-reduces per layer. Aborts,
finishes and preemptions then free the request's pages on every rank in the same step.
"""
from __future__ import annotations

import torch

from ..runtime.resource_manager import DiffKVResourceManager
from .groups import TensorParallelGroup


class TensorParallelResourceManager(DiffKVResourceManager):
    """A rank's resource manager whose free count is the most loaded rank's (a collective call).

    Args:
        *args, **kwargs: as :class:`DiffKVResourceManager` (the rank's ``model_config``: its heads).
        group: the tensor-parallel group.

    Raises:
        ValueError: as :class:`DiffKVResourceManager`; ranks whose pools hold different page counts
            (the budgets or shapes differ).
    """

    def __init__(self, *args, group: TensorParallelGroup, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        low, high = group.all_min_max(self.get_max_resource_count())
        if low != high:
            raise ValueError(f"the ranks' pools hold between {low} and {high} pages; every rank needs the same "
                             "kv budget and shape")

    def local_free_pages(self) -> int:
        """This rank's free pages now (a device read on the GPU)."""
        return super().free_pages()

    def free_pages(self) -> int:
        """The smallest free page count over the ranks (every rank must call it at the same point)."""
        return self.group.all_min_max(self.local_free_pages())[0]


class TensorParallelHook:
    """The executor's ``parallel`` hook for one rank (module docstring).

    Args:
        group: the tensor-parallel group.
    """

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group

    def resource_manager(self, *args, **kwargs) -> TensorParallelResourceManager:
        """The rank's resource manager (:class:`TensorParallelResourceManager`)."""
        return TensorParallelResourceManager(*args, group=self.group, **kwargs)

    def step_status(self, status: torch.Tensor, num_requests: int) -> torch.Tensor:
        """The step's status agreed by every rank (one all-gather).

        Args:
            status: int64 ``[num_requests + max_batch_size + 2]`` on the rank's device: the sampled tokens,
                the per-slot non-finite flags, the ring's (start, end).
            num_requests: requests in the step.

        Returns:
            int64, same shape and device: rank 0's tokens, each slot's flag OR-ed over the ranks, then
            ``(0, the smallest free page count over the ranks)`` as (start, end).
        """
        gathered = self.group.all_gather(status)  # [world_size, n]
        n = num_requests
        tokens, flags = gathered[0, :n], gathered[:, n:-2].amax(0)
        free = (gathered[:, -1] - gathered[:, -2]).amin().reshape(1)
        return torch.cat([tokens, flags, torch.zeros_like(free), free])
