"""``TensorParallelExecutor``: N spawned rank processes driven like one
:class:`~trtllm_diffkv.runtime.executor.Executor` (``LLM(..., tensor_parallel_size=N)``).

The parent (the ``LLM``'s process) holds no weights: it resolves the checkpoint (a GGUF is converted
once, here, before any rank starts), checks the split (:func:`~.sharding.check_tensor_parallel`),
loads the tokenizer, and starts ``tensor_parallel_size`` processes with ``torch.multiprocessing``'s
``spawn`` context (no ``mpirun``/``torchrun``). Rank ``r`` joins the group over a TCP rendezvous on
127.0.0.1 (gloo on the CPU, NCCL on ``cuda:r``), loads its shard (:func:`~.sharding.load_model_shard`)
and runs an ``Executor`` with :class:`~.executor_hook.TensorParallelHook` over a pool for its heads.

Every command goes to every rank in the same order over one pipe each (``add``, ``abort``, ``step``,
``stats``, ``shutdown``), so the ranks' executors see the same inputs; a ``step`` returns rank 0's
updates, each finished result's ``pool_pages``/``pool_used_bytes`` summed over the ranks (its other
cache statistics are rank 0's heads). ``check_request`` asks rank 0's executor over a second pipe
(served by a thread there), so the request rules keep their one home
(:meth:`Executor.check_request`) and a check never waits for a step.

A rank that fails (an exception outside the executor's per-request handling, a collective timeout)
breaks the group: the step raises ``RuntimeError`` and every later call too; create a new ``LLM``.
"""
from __future__ import annotations

import threading
import traceback

import torch

from ..runtime.request import check_new_request_id
from .groups import DEFAULT_TIMEOUT_S, local_init_method
from ..engine_config import EngineConfig
from ..model.rotation import model_for_kv_config
from .groups import destroy_tensor_parallel, init_tensor_parallel

READY_TIMEOUT_S = 600.0
"""How long the parent waits for every rank to load its shard and build its executor (seconds)."""


class TensorParallelExecutor:
    """The executor interface the ``LLM`` drives, over ``tensor_parallel_size`` rank processes (module docstring).

    Args:
        model: a HF checkpoint folder, a ``.gguf`` file, or ``None`` (the default model).
        kv_config: a resolved :class:`~trtllm_diffkv.config.DiffKVConfig` (the whole model's).
        tensor_parallel_size: ranks (``>= 2`` for a split; ``1`` runs one rank process).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank ``r`` on ``cuda:r``); ``None``: CUDA when available.
        dtype: the model dtype (default float32 on the CPU, bfloat16 on CUDA).
        num_threads: each rank's ``torch.set_num_threads`` (``None``: torch's default).
        timeout_s: collective timeout (:data:`~.groups.DEFAULT_TIMEOUT_S`).
        **executor_kwargs: each rank's :class:`~trtllm_diffkv.engine_config.EngineConfig` fields (``max_batch_size``, ``kv_memory_bytes``
            per rank, ``max_seq_len``, ...); ``use_cuda_graphs`` is forced off (graphs over collectives
            are not wired).

    Attributes:
        tokenizer, model_config (the whole model's), kv_config, stop_token_ids, max_seq_len,
        max_batch_size, max_num_tokens, tensor_parallel_size; ``device`` is ``None`` (the parent runs nothing).

    Raises:
        FileNotFoundError, ValueError: the checkpoint cannot be read, the split is refused
            (:func:`~.sharding.check_tensor_parallel`), fewer GPUs than ranks, or a rank refused its
            configuration (its message).
        RuntimeError: a rank died or did not become ready within :data:`READY_TIMEOUT_S`.
    """

    device = None

    def __init__(self, model, kv_config, tensor_parallel_size: int, *, device=None, dtype=None,
                 num_threads: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, **executor_kwargs) -> None:
        from ..model.loader import checkpoint_folder, default_dtype, load_model_config, load_tokenizer, stop_token_ids
        from ..runtime.executor import check_overlap_setting
        from .sharding import check_tensor_parallel

        device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        folder = checkpoint_folder(model)
        self.model_config = load_model_config(folder)
        check_tensor_parallel(self.model_config, tensor_parallel_size, kv_config)
        check_overlap_setting(executor_kwargs.get("disable_overlap_scheduler"), tensor_parallel=True)
        if device.type == "cuda" and torch.cuda.device_count() < tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} GPUs; "
                             f"{torch.cuda.device_count()} are visible")
        self.tokenizer = load_tokenizer(folder)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.stop_token_ids = set(stop_token_ids(model)) | ({eos} if eos is not None else set())
        self.kv_config, self.tensor_parallel_size = kv_config, tensor_parallel_size
        dtype = dtype if dtype is not None else default_dtype(device)
        executor_kwargs = {k: v for k, v in executor_kwargs.items() if v is not None}
        executor_kwargs["use_cuda_graphs"] = False
        spec = dict(path=str(folder), kv_config=kv_config, dtype=dtype, device_type=device.type,
                    init_method=local_init_method(), world_size=tensor_parallel_size,
                    stop_token_ids=sorted(self.stop_token_ids), num_threads=num_threads, timeout_s=timeout_s,
                    executor_kwargs=executor_kwargs)
        ctx = torch.multiprocessing.get_context("spawn")
        self._conns, self._procs, self._check_conn = [], [], None
        self._lock, self._check_lock = threading.Lock(), threading.Lock()
        self._live: dict = {}  # request id -> True, until its final update
        self._broken: str | None = None
        for rank in range(tensor_parallel_size):
            parent, child = ctx.Pipe()
            check_parent, check_child = ctx.Pipe() if rank == 0 else (None, None)
            proc = ctx.Process(target=_worker_main, args=(rank, spec, child, check_child),
                               name=f"trtllm-diffkv-tp{rank}", daemon=True)
            proc.start()
            child.close()
            if check_child is not None:
                check_child.close()
                self._check_conn = check_parent
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            infos = [self._ready(rank) for rank in range(tensor_parallel_size)]
        except BaseException:
            self._terminate()
            raise
        info = infos[0]
        self.max_seq_len, self.max_batch_size = info["max_seq_len"], info["max_batch_size"]
        self.max_num_tokens, self.pool_pages = info["max_num_tokens"], info["pool_pages"]

    def _ready(self, rank: int) -> dict:
        conn, proc = self._conns[rank], self._procs[rank]
        waited = 0.0
        while not conn.poll(1.0):
            waited += 1.0
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before it was ready")
            if waited > READY_TIMEOUT_S:
                raise RuntimeError(f"tensor-parallel rank {rank} was not ready within {READY_TIMEOUT_S:.0f} s")
        try:
            msg = conn.recv()
        except EOFError:  # the rank died after its pipe became readable (closed): say why it usually does
            proc.join(5)
            raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before it was ready; a "
                               "script that starts tensor parallelism needs an `if __name__ == '__main__':` guard "
                               "(the ranks are spawned processes that re-import it)") from None
        if msg[0] == "failed":
            _kind, exc, trace = msg
            if isinstance(exc, (ValueError, FileNotFoundError)):
                raise exc
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {exc}\n{trace}")
        return msg[1]

    # ------------------------------------------------------------------ the executor interface
    @property
    def running(self) -> list:
        """Ids of the requests not yet finished (any of them may be in the running step)."""
        return list(self._live)

    @property
    def broken(self) -> str | None:
        """Why the group cannot run another step (a rank failed or exited, or it was closed), else ``None``.
        A rank process that exited is noticed here at once, also while no step runs (``/health``)."""
        if self._broken is None:
            dead = next((rank for rank, proc in enumerate(self._procs) if not proc.is_alive()), None)
            if dead is not None:
                return f"rank {dead} exited (code {self._procs[dead].exitcode})"
        return self._broken

    def has_unfinished(self) -> bool:
        """Whether any request added here has not had its final update."""
        return bool(self._live) and self._broken is None

    def check_request(self, prompt_token_ids, params) -> list[int]:
        """:meth:`Executor.check_request` of rank 0 (the ranks' limits are equal); raises what it raises."""
        self._check_alive()
        with self._check_lock:
            self._check_conn.send((prompt_token_ids, params))
            ok, value = self._check_conn.recv()
        if not ok:
            raise value
        return value

    def add_request(self, prompt_token_ids, sampling_params=None, request_id=None):
        """Queue a request on every rank; ``request_id`` is required (the ``LLM`` gives one).

        Raises:
            ValueError: no ``request_id``, or one already live.
            RuntimeError: the group is broken.
        """
        if request_id is None:
            raise ValueError("request_id is required with tensor parallelism")
        with self._lock:
            self._check_alive()
            check_new_request_id(request_id, self._live)
            self._live[request_id] = True
            self._send(("add", request_id, prompt_token_ids, sampling_params))
        return request_id

    def abort(self, request_id) -> None:
        """Abort on every rank now (pages freed on each before its next step); unknown ids are ignored."""
        with self._lock:
            if self._broken is None and request_id in self._live:
                self._send(("abort", request_id))

    def step(self) -> list:
        """One step on every rank; rank 0's :class:`RequestUpdate` list (pool pages summed over the ranks).

        Raises:
            RuntimeError: a rank failed (the group is broken from then on).
        """
        from dataclasses import replace

        with self._lock:
            self._check_alive()
            self._send(("step",))
            replies = self._recv_all()
        updates, pages = replies[0][0], [r[1] for r in replies]
        out = []
        for update in updates:
            if update.finished:
                self._live.pop(update.request_id, None)
                result = update.result
                if result is not None and getattr(result, "pool_pages", None) is not None:  # None: aborted/failed
                    per_rank = [p.get(update.request_id, (0, 0)) for p in pages]
                    result = replace(result, pool_pages=sum(p[0] for p in per_rank),
                                     pool_used_bytes=sum(p[1] for p in per_rank))
                    update = replace(update, result=result)
            out.append(update)
        return out

    def stats(self) -> dict:
        """Rank 0's :meth:`Executor.stats` (``free_pages``: the most loaded rank's; ``pool_pages``: one rank's
        pool) plus ``tensor_parallel_size`` and ``rank_used_pages`` (pages held on each rank)."""
        with self._lock:
            self._check_alive()
            self._send(("stats",))
            replies = self._recv_all()
        out = dict(replies[0][0])
        out.update(tensor_parallel_size=self.tensor_parallel_size, rank_used_pages=[r[1] for r in replies])
        return out

    def close(self) -> None:
        """Stop every rank (idempotent): a clean shutdown, then termination of any rank still alive after 30 s."""
        with self._lock:
            if self._broken is None:
                try:
                    self._send(("shutdown",))
                except OSError:
                    pass
            self._broken = self._broken or "the tensor-parallel executor was closed"
        for proc in self._procs:
            proc.join(timeout=30)
        self._terminate()

    shutdown = close

    # ------------------------------------------------------------------ plumbing
    def _check_alive(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken: {self._broken}")

    def _send(self, message) -> None:
        for conn in self._conns:
            conn.send(message)

    def _recv_all(self) -> list:
        replies, error = [], None
        for rank, conn in enumerate(self._conns):
            try:
                kind, *payload = conn.recv()
            except (EOFError, OSError) as exc:
                kind, payload = "error", [f"rank {rank} is gone ({type(exc).__name__})"]
            if kind == "error":
                error = error or f"rank {rank}: {payload[0]}"
            replies.append(payload)
        if error is not None:
            self._broken = error
            self._terminate()
            raise RuntimeError(f"the tensor-parallel step failed on {error}")
        return replies

    def _terminate(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)

    def __del__(self) -> None:
        try:
            self._terminate()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# ---------------------------------------------------------------------- the rank process


def _serve_checks(executor, conn) -> None:
    """Rank 0's check thread: ``Executor.check_request`` reads only fixed limits, so it runs beside the steps."""
    while True:
        try:
            ids, params = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, executor.check_request(ids, params))
        except Exception as exc:  # noqa: BLE001 - sent back to the caller
            reply = (False, exc)
        try:
            conn.send(reply)
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            conn.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")))


def _worker_main(rank: int, spec: dict, conn, check_conn) -> None:
    """One rank: join the group, load the shard, build the executor, then serve the parent's commands."""
    from ..runtime.executor import Executor
    from .executor_hook import TensorParallelHook
    from .sharding import load_model_shard, local_kv_config

    try:
        if spec["num_threads"] is not None:
            torch.set_num_threads(spec["num_threads"])
        device = torch.device(f"cuda:{rank}") if spec["device_type"] == "cuda" else torch.device("cpu")
        group = init_tensor_parallel(rank, spec["world_size"], spec["init_method"], device, spec["timeout_s"])
        model, tokenizer, local_config = load_model_shard(spec["path"], group, spec["dtype"])
        model = model_for_kv_config(model, spec["kv_config"], in_place=True)  # the rank's own: no second copy
        executor = Executor(model, local_config, local_kv_config(spec["kv_config"], spec["world_size"]),
                            EngineConfig(**spec["executor_kwargs"]), tokenizer=tokenizer,
                            stop_token_ids=spec["stop_token_ids"], parallel=TensorParallelHook(group))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        try:
            conn.send(("failed", exc, traceback.format_exc()))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            conn.send(("failed", RuntimeError(f"{type(exc).__name__}: {exc}"), traceback.format_exc()))
        return
    rm = executor.rm
    conn.send(("ready", dict(max_seq_len=executor.max_seq_len, max_batch_size=executor.max_batch_size,
                             max_num_tokens=executor.max_num_tokens, pool_pages=rm.get_max_resource_count())))
    if check_conn is not None:
        threading.Thread(target=_serve_checks, args=(executor, check_conn), daemon=True).start()
    deferred = None  # an add/abort that raised (they send no reply): reported by the next reply
    try:
        while True:
            try:
                kind, *args = conn.recv()
            except (EOFError, OSError):
                return
            if kind == "shutdown":
                return
            try:
                if kind == "add":
                    executor.add_request(args[1], args[2], request_id=args[0])
                elif kind == "abort":
                    executor.abort(args[0])
                elif deferred is not None:
                    raise deferred
                elif kind == "step":
                    updates = executor.step()
                    pages = {u.request_id: (u.result.pool_pages, u.result.pool_used_bytes) for u in updates
                             if u.finished and hasattr(u.result, "pool_pages")}
                    conn.send(("ok", updates if rank == 0 else [], pages))
                elif kind == "stats":
                    stats = executor.stats()
                    conn.send(("ok", stats if rank == 0 else {}, rm.get_max_resource_count() - rm.local_free_pages()))
            except Exception as exc:  # noqa: BLE001 - reported; the group is broken from here on
                if kind in ("add", "abort"):
                    deferred = exc
                    continue
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
                return
    finally:
        destroy_tensor_parallel()
