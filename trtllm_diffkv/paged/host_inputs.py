"""A step's small host integer inputs (slots, positions, prompt lengths, reserved pages) in ONE host-to-device copy.

``torch.tensor(list, device="cuda")`` copies from pageable memory: the copy is synchronous, so the host waits
for the stream (the previous step's forward) at each such call, and a plan made several. :class:`StepInputs`
gathers the step's integers into a pinned host buffer and makes one ``non_blocking`` copy per step; the plan
slices the device tensor (:meth:`~.cache.PagedDiffKVCache.plan`, :func:`.prefill.host_inputs`,
:func:`.decode.host_inputs`). Not routed here: the prompt bounds the prefill attention reads on the host
(:func:`.prefill.host_bounds`, pinned already) and the token-sized packed rows of a chunked step's whole prompts
(their own non-blocking copy).

Reuse must be safe: a pinned buffer must not be rewritten while an earlier asynchronous copy may still read it
(the copy runs when the stream reaches it, possibly a whole step later). So the buffers rotate (two by default)
and each copy records a ``torch.cuda.Event``; before a buffer is written again the host waits for its event
(``event.synchronize()``), which has normally completed long before: the host waits only when it runs more
than ``num_buffers`` steps ahead of the device. On the CPU (or with ``pinned=False``) the values become a plain
tensor on the device, no pinning (the reference path the pinned one is compared with on the GPU).
"""
from __future__ import annotations

import torch


class StepInputs:
    """Pinned host staging of the integer inputs of one step, copied to ``device`` in one ``non_blocking`` copy.

    Args:
        device: the cache device.
        num_buffers: pinned buffers in rotation (>= 2: the one being filled while the last copy may be pending).
        pinned: stage through pinned buffers (default: ``device`` is CUDA); otherwise :meth:`to_device` makes
            a plain tensor on ``device`` (a blocking copy on CUDA).

    Raises:
        ValueError: ``num_buffers < 2``, or ``pinned`` on a non-CUDA device.
    """

    def __init__(self, device: torch.device, num_buffers: int = 2, pinned: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda" if pinned is None else bool(pinned)
        if num_buffers < 2:
            raise ValueError(f"num_buffers={num_buffers} must be >= 2 (a buffer may still be read by the last copy)")
        if self.pinned and self.device.type != "cuda":
            raise ValueError(f"pinned step inputs need a CUDA device, got {self.device}")
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self._events: list = [None] * num_buffers
        self._next = 0
        self.copies = 0  # host-to-device copies made (tests count one per step)

    def to_device(self, lists: list[list[int]]) -> list[torch.Tensor]:
        """One int64 ``[len(l)]`` tensor on the device per list of ``lists``: views of ONE device tensor made by one
        copy (non-blocking from a pinned buffer when :attr:`pinned`).

        The returned tensors are the caller's (their values never change afterwards); the pinned buffer they came
        from is rewritten only after its copy has completed (module docstring).
        """
        values = [x for part in lists for x in part]
        flat = self._copy(values)
        out, at = [], 0
        for part in lists:
            out.append(flat[at:at + len(part)])
            at += len(part)
        return out

    def _copy(self, values: list[int]) -> torch.Tensor:
        self.copies += 1
        if not self.pinned:
            return torch.tensor(values, dtype=torch.int64, device=self.device)
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        event = self._events[i]
        if event is None:
            event = self._events[i] = torch.cuda.Event()
        else:
            event.synchronize()  # the copy that last read buffer i has finished: safe to overwrite it
        buf, n = self._buffers[i], len(values)
        if buf is None or buf.numel() < n:
            size = max(n, 64, 2 * (0 if buf is None else buf.numel()))
            buf = self._buffers[i] = torch.empty(size, dtype=torch.int64, pin_memory=True)
        host = buf[:n]
        host.copy_(torch.tensor(values, dtype=torch.int64))
        out = host.to(self.device, non_blocking=True)
        event.record(torch.cuda.current_stream(self.device))  # after the copy: its completion frees buffer i
        return out


__all__ = ["StepInputs"]
