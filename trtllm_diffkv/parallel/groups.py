"""The tensor-parallel process group and the collectives the model and the executor use.

One process per rank (one GPU each on CUDA). The backend follows the device: ``gloo`` on the CPU,
``nccl`` on CUDA; NCCL's settings (``NCCL_*`` variables, NVLink multicast) are left as the machine
sets them. Collectives run on tensors of the rank's device (``torch.distributed`` docs: gloo takes
CPU tensors, NCCL CUDA tensors).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..validators import positive_int

DEFAULT_TIMEOUT_S = 300.0
"""How long a collective waits for the other ranks before it raises (seconds): a rank that died or
diverged ends the group instead of hanging it forever."""


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's view of the tensor-parallel group.

    Attributes:
        rank: this process's rank in ``[0, world_size)``.
        world_size: ranks in the group (``tensor_parallel_size``).
        device: the rank's device (``cuda:<rank>`` on CUDA, ``cpu``).
        group: the ``torch.distributed`` process group (``None``: the default group).
    """

    rank: int
    world_size: int
    device: torch.device
    group: object = None

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (every rank gets the same bits) and return it.

        The one collective of a row-parallel product (Megatron-LM section 3: after ``o_proj`` and
        ``down_proj``). ``tensor``: any shape and float dtype, on :attr:`device`.
        """
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[world_size, *tensor.shape]``: every rank's ``tensor`` (same shape and dtype on every rank)."""
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts)

    def all_min_max(self, value: int) -> tuple[int, int]:
        """(smallest, largest) of a host integer over the ranks (one all-gather)."""
        values = self.all_gather(torch.tensor([int(value)], dtype=torch.int64, device=self.device))
        return int(values.min()), int(values.max())


def local_init_method() -> str:
    """A rendezvous for ranks on this machine: ``"tcp://127.0.0.1:<a port free now>"``."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def backend_for(device: torch.device) -> str:
    """``"nccl"`` for a CUDA device, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device=None,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallelGroup:
    """Join the group (``torch.distributed.init_process_group``) and return this rank's view.

    Args:
        rank, world_size: this process's rank and the group's size (``world_size >= 1``).
        init_method: the rendezvous, e.g. ``"tcp://127.0.0.1:29500"`` (every rank the same).
        device: ``None``: ``cuda:<rank>`` when CUDA is available, else ``cpu``; the backend follows it
            (:func:`backend_for`); on CUDA the rank's current device is set to it.
        timeout_s: collective timeout (:data:`DEFAULT_TIMEOUT_S`).

    Raises:
        ValueError: a rank outside ``[0, world_size)``; a CUDA device when fewer GPUs than ranks are visible.
        RuntimeError: from ``torch.distributed`` when the rendezvous fails.
    """
    positive_int("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if device is None:
        device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs; "
                             f"{torch.cuda.device_count()} are visible")
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TensorParallelGroup(rank, world_size, device, None)


def destroy_tensor_parallel() -> None:
    """Leave the default process group (a no-op when none is initialized)."""
    if dist.is_initialized():
        dist.destroy_process_group()
