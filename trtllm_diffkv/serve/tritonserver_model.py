"""Triton Inference Server Python backend model: DiffKV generation through the trtllm-diffkv ``LLM`` API.

``trtllm-diffkv triton-repo`` copies this file to ``<repository>/<name>/1/model.py``; it runs inside
Triton's ``triton_python_backend_stub`` (not imported by the package). One model instance holds
one ``LLM``: its executor batches the requests of all clients in flight (Triton's dynamic batcher
is off). The model is decoupled: ``execute`` hands each request to an asyncio loop thread and
returns at once; the loop sends the responses (``stream`` true: one per new piece of text, then
the final flag; else one response with the whole text) and polls ``request.is_cancelled()``
every 0.1 s: a cancelled request is aborted in the LLM, which frees its pages before its next
step. Input/output tensors: :mod:`trtllm_diffkv.serve.tritonserver_requests`. The LLM's statistics are
exported as Triton custom metrics (:mod:`trtllm_diffkv.serve.metrics`, labels ``model`` and
``version``) every 0.25 s.

Shutdown: Triton counts a decoupled request as finished once ``execute`` returns, so at SIGTERM it
unloads at once, then waits (``--exit-timeout-secs``) for the streams still holding response senders:
``finalize`` never runs while one is open, and after the timeout tritonserver crashes (Signal 11,
then a hang until SIGKILL). So the model watches SIGTERM/SIGINT itself (:meth:`_watch_signals`: a
wakeup fd written by the C signal handler, read by the loop thread; the stub's own handler ignores
both): from the signal on, new requests get ``UNAVAILABLE`` ("the server is shutting down"),
requests in flight get ``shutdown_timeout_s`` (a ``config.pbtxt`` parameter, default
:data:`SHUTDOWN_TIMEOUT_S`; keep it below ``--exit-timeout-secs``) to finish, then are aborted in the
LLM (pages freed) and end with an ``UNAVAILABLE`` error and the final flag. Triton then finalizes the
model and exits 0, once the clients have closed their gRPC streams: an open bidirectional stream keeps
the model loaded even with no request in it (found with tritonserver 2.51: the same hang and crash
with zero requests in flight), so a client ends its stream (``stop_stream()``) after its last final
response, as tritonclient's examples do. The stub sees the signal when the whole process group is signalled, as
``trtllm-diffkv triton-repo --serve`` and ``TritonServer.stop`` do; where only ``tritonserver`` gets
it (PID 1 of a container), run it under an init that forwards to the group (``tini -g``,
``dumb-init``).

Errors: a request the model refuses (bad inputs, an empty or too long prompt, bad sampling values)
is answered with ``TritonError.INVALID_ARG`` (HTTP 400, gRPC ``INVALID_ARGUMENT``); a failure of
the server's own (a failed executor step) with ``INTERNAL`` (HTTP 500, gRPC ``INTERNAL``).
"""
import asyncio
import json
import signal
import socket
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

CANCEL_POLL_S = 0.1
METRICS_PERIOD_S = 0.25
SHUTDOWN_TIMEOUT_S = 5.0
SHUTDOWN_MESSAGE = "the server is shutting down"


def _send(sender, response, final: bool = False) -> None:
    """Send ``response`` (``None``: none) and/or the final flag; a client that is gone is not an error."""
    flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
    try:
        sender.send(response, flags=flags) if response is not None else sender.send(flags=flags)
    except Exception as exc:  # noqa: BLE001 - the request was cancelled or the stub is shutting down
        pb_utils.Logger.log_verbose(f"trtllm-diffkv: response not sent: {exc}")


def _error(message: str, client: bool = True, code_name: str | None = None):
    """A ``TritonError`` with code ``INVALID_ARG`` (``client``: the request's fault) or ``INTERNAL`` (or
    ``code_name``, e.g. ``"UNAVAILABLE"``); a stub without error codes (Python backend before 23.xx) gets the
    plain error, which Triton reports as internal."""
    code = getattr(pb_utils.TritonError, code_name or ("INVALID_ARG" if client else "INTERNAL"), None)
    if code is not None:
        try:
            return pb_utils.TritonError(message, code)
        except TypeError:  # a TritonError(message) only
            pass
    return pb_utils.TritonError(message)


def _errors(finals) -> tuple[list[str], bool]:
    """The failed rows' messages, and whether all are the client's (``trtllm_diffkv.serve.is_server_fault``)."""
    from trtllm_diffkv.serve import is_server_fault  # importable once initialize() set the path

    failed = [f for f in finals if f.error is not None and f.outputs[0].finish_reason == "error"]
    return [f.error for f in failed], not any(is_server_fault(f) for f in failed)


def _hide_packages_needing_numpy_2() -> list[str]:
    """Hide SciPy and scikit-learn from this process when they cannot import under the stub's NumPy 1.

    The stub environment holds NumPy 1 (the stub's C++ side needs it) over the machine's packages; where
    the machine's SciPy needs NumPy 2 (the H200 image, 2026-11-30: SciPy refuses NumPy 1.26), transformers
    5.17 imports scikit-learn -> SciPy while importing its generation module and fails. Neither package
    is used here, so they are marked absent (``sys.modules[name] = None``: ``find_spec`` then returns
    ``None`` and transformers treats them as not installed; a dotted ``find_spec("scipy.x")`` raises
    ``ModuleNotFoundError`` instead, and they stay hidden for the life of the stub process). Returns the
    names hidden.
    """
    if int(np.__version__.split(".")[0]) >= 2:
        return []
    try:
        import scipy.sparse  # noqa: F401
        import sklearn  # noqa: F401  (built for NumPy 2 beside a SciPy that still imports: hide both)
        return []
    except Exception:  # noqa: BLE001 - an ImportError or the packages' own NumPy version checks
        for name in [m for m in sys.modules if m in ("scipy", "sklearn") or m.startswith(("scipy.", "sklearn."))]:
            del sys.modules[name]
        sys.modules["scipy"] = None
        sys.modules["sklearn"] = None
        return ["scipy", "sklearn"]


class TritonPythonModel:
    """The Python backend's model class (``initialize`` / ``execute`` / ``finalize``)."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}
        if params.get("python_path") and params["python_path"] not in sys.path:
            sys.path.insert(0, params["python_path"])  # the trtllm_diffkv that wrote this repository
        _hide_packages_needing_numpy_2()
        from trtllm_diffkv.llmapi.llm import LLM
        from trtllm_diffkv.serve import metrics, tritonserver_requests

        self.requests_module, self.metrics_module = tritonserver_requests, metrics
        self.input_names = [spec.name for spec in tritonserver_requests.INPUTS]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.llm = LLM(**tritonserver_requests.llm_kwargs_from_parameters(params))
        self.shutdown_timeout_s = float(params.get("shutdown_timeout_s") or SHUTDOWN_TIMEOUT_S)
        self.live: set = set()  # handles of the requests in flight
        self.draining = self.shutdown_aborted = False
        self.families = [pb_utils.MetricFamily(name=m.name, description=m.help, kind=pb_utils.MetricFamily.GAUGE)
                         for m in metrics.METRICS]  # kept: a family is unregistered when collected
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.gauges = {m.name: family.Metric(labels=labels) for m, family in zip(metrics.METRICS, self.families)}
        self.last_metrics = {}  # a gauge with nothing to report keeps its last value
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trtllm-diffkv-triton", daemon=True)
        self.thread.start()
        self.metrics_task = asyncio.run_coroutine_threadsafe(self._export_metrics(), self.loop)
        self._watch_signals()

    def _watch_signals(self):
        """Start draining at SIGTERM/SIGINT (see the module doc). ``signal.set_wakeup_fd`` makes Python's C
        handler write the signal number to a socket the loop thread reads, so the drain starts at once
        although the stub's main thread rarely runs Python code. Only the main thread may set handlers:
        elsewhere nothing is watched (logged)."""
        if threading.current_thread() is not threading.main_thread():
            pb_utils.Logger.log_warn("trtllm-diffkv: initialize() is not on the main thread: SIGTERM is not "
                                     "watched, streams in flight at shutdown are not drained")
            return
        self.signal_reader, writer = socket.socketpair()
        self.signal_writer = writer
        for end in (self.signal_reader, writer):
            end.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # the C handler writes the wakeup fd; nothing else to do
        self.loop.call_soon_threadsafe(self.loop.add_reader, self.signal_reader.fileno(), self._on_signal)

    def _on_signal(self):
        try:
            self.signal_reader.recv(64)
        except (BlockingIOError, OSError):
            pass
        if not self.draining:
            self.draining = True
            from trtllm_diffkv.serve import DRAINING_MESSAGE  # importable once initialize() set the path

            pb_utils.Logger.log_info(f"{DRAINING_MESSAGE}: {len(self.live)} request(s) in flight get "
                                     f"{self.shutdown_timeout_s} s")
            asyncio.ensure_future(self._drain())

    async def _drain(self):
        deadline = time.monotonic() + self.shutdown_timeout_s
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.live:
            self.shutdown_aborted = True
            pb_utils.Logger.log_warn(f"trtllm-diffkv: aborting {len(self.live)} request(s) still in flight after "
                                     f"{self.shutdown_timeout_s} s")
            for handle in list(self.live):
                handle.abort()
        while self.live:  # the aborted requests end at the LLM's next step, their final flags sent
            await asyncio.sleep(0.05)
        from trtllm_diffkv.serve import DRAINED_MESSAGE  # importable once initialize() set the path

        stats = await asyncio.get_running_loop().run_in_executor(None, self.llm.stats)
        pb_utils.Logger.log_info(f"{DRAINED_MESSAGE}; KV pool pages held: {stats['used_pages']}")

    def _shutdown_error(self):
        return pb_utils.InferenceResponse(error=_error(f"{SHUTDOWN_MESSAGE}: the request was cancelled before it "
                                                       "finished", code_name="UNAVAILABLE"))

    def execute(self, requests):
        if not self.decoupled:  # one response per request, returned here; Triton queues the next requests
            futures = [asyncio.run_coroutine_threadsafe(self._whole(request), self.loop) for request in requests]
            return [future.result() for future in futures]
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)
        return None  # decoupled: the responses go through each request's response sender

    def finalize(self):
        self.metrics_task.cancel()
        if getattr(self, "signal_writer", None) is not None:
            signal.set_wakeup_fd(-1)
        self.llm.shutdown()  # cancels what is left; their loops send the final flags
        pb_utils.Logger.log_info(f"trtllm-diffkv: finalized; KV pool pages held: {self.llm.stats()['used_pages']}")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()

    # ------------------------------------------------------------------ one request
    def _rows(self, request):
        inputs = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        rows = self.requests_module.parse_request(inputs)
        if not rows:
            raise ValueError("input 'text_input' holds no prompt (batch size 0)")
        if rows[0].stream and not self.decoupled:
            raise ValueError("stream=true needs the decoupled model (trtllm-diffkv triton-repo without --no-decoupled)")
        return rows

    async def _whole(self, request):
        """Non-decoupled mode: the request's one response (its error, or all rows' whole text)."""
        try:
            rows = self._rows(request)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            return pb_utils.InferenceResponse(error=_error(str(exc), isinstance(exc, ValueError)))
        if self.draining:
            return pb_utils.InferenceResponse(error=_error(SHUTDOWN_MESSAGE, code_name="UNAVAILABLE"))
        handles = [self.llm.generate_async(row.prompt, row.sampling_params) for row in rows]
        self.live.update(handles)
        try:
            finals = await asyncio.gather(*(self._final(request, handle) for handle in handles))
            if self.shutdown_aborted and any(f.outputs[0].finish_reason == "cancelled" for f in finals):
                return self._shutdown_error()
            return self._whole_response(rows, finals)
        except Exception as exc:  # noqa: BLE001 - the request fails alone
            for handle in handles:
                handle.abort()
            return pb_utils.InferenceResponse(error=_error(f"internal error: {exc}", client=False))
        finally:
            self.live.difference_update(handles)

    async def _serve(self, request):
        sender = request.get_response_sender()
        try:
            rows = self._rows(request)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            _send(sender, pb_utils.InferenceResponse(error=_error(str(exc), isinstance(exc, ValueError))), final=True)
            return
        if self.draining:
            _send(sender, pb_utils.InferenceResponse(error=_error(SHUTDOWN_MESSAGE, code_name="UNAVAILABLE")),
                  final=True)
            return
        handles = [self.llm.generate_async(row.prompt, row.sampling_params, streaming=row.stream) for row in rows]
        self.live.update(handles)
        try:
            if rows[0].stream:  # the end: the final flag alone, or with the error of the rows that failed
                ends = await asyncio.gather(*(self._stream_row(request, sender, handle, index)
                                              for index, handle in enumerate(handles)))
                errors, client = _errors([f for f in ends if f is not None and f.error is not None])
                if self.shutdown_aborted and any(f is not None and f.error is None for f in ends):
                    _send(sender, self._shutdown_error(), final=True)
                else:
                    _send(sender, pb_utils.InferenceResponse(error=_error("; ".join(errors), client))
                          if errors else None, final=True)
            else:
                finals = await asyncio.gather(*(self._final(request, handle) for handle in handles))
                if self.shutdown_aborted and any(f.outputs[0].finish_reason == "cancelled" for f in finals):
                    _send(sender, self._shutdown_error(), final=True)
                else:
                    _send(sender, self._whole_response(rows, finals), final=True)
        except Exception as exc:  # noqa: BLE001 - never leave a request without its final flag
            for handle in handles:
                handle.abort()
            _send(sender, pb_utils.InferenceResponse(error=_error(f"internal error: {exc}", client=False)), final=True)
        finally:
            self.live.difference_update(handles)

    async def _outputs(self, request, handle):
        """The request's outputs, aborting it in the LLM once Triton reports the client cancelled."""
        iterator = handle.__aiter__()
        checked = time.monotonic()
        while True:
            task = asyncio.ensure_future(iterator.__anext__())
            while not task.done():
                await asyncio.wait({task}, timeout=CANCEL_POLL_S)
                if time.monotonic() - checked >= CANCEL_POLL_S:  # an IPC round trip: at most 10 per second
                    checked = time.monotonic()
                    if request.is_cancelled():
                        handle.abort()  # the LLM then ends the request with finish_reason "cancelled"
            try:
                output = task.result()
            except StopAsyncIteration:
                return
            yield output
            if output.finished:
                return

    async def _final(self, request, handle):
        final = None
        async for output in self._outputs(request, handle):
            final = output
        return final

    async def _stream_row(self, request, sender, handle, index):
        """Send one row's new text as it comes; returns the row's failed output, or ``None``."""
        async for output in self._outputs(request, handle):
            completion = output.outputs[0]
            if output.error is not None and completion.finish_reason == "error":
                return output
            if completion.finish_reason == "cancelled":  # the client is gone, or the shutdown cut it
                return output if self.shutdown_aborted else None
            if completion.text_diff or output.finished:
                logprobs = ([completion.token_ids_diff], [completion.logprobs_diff]) \
                    if completion.logprobs is not None else None
                _send(sender, self._response([completion.text_diff], [completion.finish_reason or ""],
                                           [len(output.prompt_token_ids)], [len(completion.token_ids)], [index],
                                           [output] if output.finished else None, logprobs))

    def _whole_response(self, rows, finals):
        errors, client = _errors(finals)
        if errors:
            return pb_utils.InferenceResponse(error=_error("; ".join(errors), client))
        texts = [f.outputs[0].text if row.exclude_input else row.prompt + f.outputs[0].text
                 for row, f in zip(rows, finals)]
        logprobs = ([f.outputs[0].token_ids for f in finals], [f.outputs[0].logprobs for f in finals]) \
            if any(row.return_log_probs for row in rows) else None
        return self._response(texts, [f.outputs[0].finish_reason or "" for f in finals],
                              [len(f.prompt_token_ids) for f in finals],
                              [len(f.outputs[0].token_ids) for f in finals], list(range(len(rows))), finals, logprobs)

    def _response(self, texts, reasons, num_input, num_output, batch_index, finals=None, logprobs=None):
        """One response's tensors; ``finals`` (the rows' final outputs) adds the DiffKV outputs, ``logprobs``
        (``(token ids, logprobs entries)`` per row, streaming: the new ones) ``cum_log_probs`` and
        ``output_log_probs``. In a stream, ``cum_log_probs`` is the sum over the new tokens."""
        def column(values, dtype):
            return np.array(values, dtype=dtype).reshape(len(values), 1)

        extra = []
        if finals is not None:
            values = [self.requests_module.diffkv_output_values(f.metrics) for f in finals]
            extra = [pb_utils.Tensor(name, column([v[name] for v in values],
                                                  np.int64 if name == "kv_pool_bytes" else np.float32))
                     for name in self.requests_module.DIFFKV_OUTPUTS]
        if logprobs is not None:
            cumulative, per_token = self.requests_module.log_prob_values(*logprobs)
            extra += [pb_utils.Tensor("cum_log_probs", cumulative), pb_utils.Tensor("output_log_probs", per_token)]
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", column([t.encode("utf-8") for t in texts], np.object_)),
            pb_utils.Tensor("finish_reason", column([r.encode() for r in reasons], np.object_)),
            pb_utils.Tensor("num_input_tokens", column(num_input, np.int32)),
            pb_utils.Tensor("num_output_tokens", column(num_output, np.int32)),
            pb_utils.Tensor("batch_index", column(batch_index, np.int32))] + extra)

    # ------------------------------------------------------------------ metrics
    async def _export_metrics(self):
        loop = asyncio.get_running_loop()
        while True:
            stats = await loop.run_in_executor(None, self.llm.stats)  # waits for a step in progress
            for name, value in self.metrics_module.metric_values(stats, self.last_metrics).items():
                self.gauges[name].set(value)
            await asyncio.sleep(METRICS_PERIOD_S)
