"""Load a running server with concurrent streaming clients: throughput, TTFT, TPOT, ITL and end-to-end
latency percentiles (the measures of vLLM's ``benchmark_serving`` and genai-perf).

``api="openai"``: ``POST {url}/v1/completions`` with ``"stream": true``, ``"ignore_eos": true`` and
``stream_options.include_usage`` (the generated-token count comes from the usage chunk);
``api="triton"``: ``POST {url}/v2/models/{model}/generate_stream`` with ``"end_id": -1`` (no end token,
TensorRT-LLM's convention; the count comes from ``num_output_tokens``). Greedy, fixed ``max_tokens`` (one
for all, or one per prompt: ``bench --prompts-file``). An OpenAI prompt may be a list of token ids
(OpenAI's form; a prompts file's ``input_ids`` / ``input_length`` lines); Triton takes text only.
Each of ``concurrency`` clients sends its next request when its previous one ends (a closed loop).

Per request: TTFT = request sent -> first chunk with text; ITL = the gaps between successive chunks
with text; TPOT = (end - first text) / (generated tokens - 1); e2e = sent -> end (seconds). A chunk
may carry several tokens (the server holds back a partial character or a possible stop string), so
ITL is per chunk, as in genai-perf's streaming mode.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time

from ..config import replaced_atomically

__all__ = ["percentile", "load", "summary", "QUANTILES"]

QUANTILES = (0.5, 0.9, 0.99)
"""The percentiles reported (``p50``, ``p90``, ``p99``)."""


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` with linear interpolation between closest ranks (NumPy's default).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def one_request(client, api: str, url: str, prompt: str | list[int], max_tokens: int, model: str) -> dict:
    """One streaming request (``prompt``: text, or token ids for ``api="openai"``);
    ``{"ttft_s", "itl_s": [...], "e2e_s", "tokens", "error"}``."""
    if api == "openai":
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
    else:
        body = {"text_input": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0, "end_id": -1}
    start = time.perf_counter()
    chunk_times, tokens, error = [], 0, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[len("data: "):])
                if "error" in payload:
                    error = str(payload["error"])[:200]
                    break
                if api == "openai":
                    text = payload["choices"][0]["text"] if payload.get("choices") else ""
                    tokens = payload["usage"]["completion_tokens"] if payload.get("usage") else tokens
                else:
                    text, tokens = payload.get("text_output", ""), payload.get("num_output_tokens", tokens)
                if text:
                    chunk_times.append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - a transport failure is this request's error, the load goes on
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    end = time.perf_counter()
    if error is None and not chunk_times:
        error = "no text in the response"
    return {"ttft_s": chunk_times[0] - start if chunk_times else None,
            "itl_s": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
            "tpot_s": (end - chunk_times[0]) / (tokens - 1) if chunk_times and tokens > 1 else None,
            "e2e_s": end - start, "tokens": tokens, "error": error}


def summary(records: list[dict], wall_s: float) -> dict:
    """Totals and percentiles (milliseconds) of ``records`` (from :func:`one_request`) over ``wall_s`` seconds."""
    good = [r for r in records if not r.get("error")]
    out = {"requests": len(records), "completed": len(good), "wall_s": wall_s,
           "requests_per_s": len(good) / wall_s if wall_s else None,
           "output_tokens": sum(r["tokens"] for r in good),
           "output_tokens_per_s": sum(r["tokens"] for r in good) / wall_s if wall_s else None,
           "errors": [r["error"] for r in records if r.get("error")][:5]}
    series = {"ttft": [r["ttft_s"] for r in good], "tpot": [r["tpot_s"] for r in good if r["tpot_s"] is not None],
              "itl": [gap for r in good for gap in r["itl_s"]], "e2e": [r["e2e_s"] for r in good]}
    for name, values in series.items():
        out[f"{name}_mean_ms"] = statistics.fmean(values) * 1e3 if values else None
        for q in QUANTILES:
            out[f"{name}_p{round(q * 100)}_ms"] = percentile(values, q) * 1e3 if values else None
    return out


async def load(url: str, *, api: str = "openai", model: str = "default", prompts: list, num_requests: int,
               concurrency: int, max_tokens: int | list[int]) -> tuple[dict, list[dict]]:
    """Send ``num_requests`` streaming requests (prompts in turn; each a text, or for ``api="openai"`` a list of
    token ids) from ``concurrency`` clients to the server at ``url`` (``http://host:port``); ``max_tokens``: one
    count for all, or one per prompt. Returns ``(summary, records)``.

    Raises:
        ValueError: an unknown ``api``, no prompts, a count below 1, a ``max_tokens`` list of another length than
            ``prompts``, or token ids for ``api="triton"``.
    """
    import httpx

    if api not in ("openai", "triton"):
        raise ValueError(f"api {api!r}: expected openai or triton")
    counts = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    if not prompts or num_requests < 1 or concurrency < 1 or min(counts, default=0) < 1:
        raise ValueError("prompts, num_requests, concurrency and max_tokens must be non-empty / >= 1")
    if len(counts) != len(prompts):
        raise ValueError(f"max_tokens has {len(counts)} counts for {len(prompts)} prompts")
    if api == "triton" and not all(isinstance(p, str) for p in prompts):
        raise ValueError("api 'triton' takes text prompts only (text_input)")
    endpoint = (f"{url.rstrip('/')}/v1/completions" if api == "openai"
                else f"{url.rstrip('/')}/v2/models/{model}/generate_stream")
    records, counter = [], iter(range(num_requests))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker():
            for index in counter:
                i = index % len(prompts)
                records.append(await one_request(client, api, endpoint, prompts[i], counts[i], model))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summary(records, wall), records


def plot(records: list[dict], path, title: str) -> None:
    """A PNG at ``path``: the TTFT, TPOT and ITL distributions (empirical CDFs, milliseconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in records if not r.get("error")]
    series = {"TTFT": [r["ttft_s"] * 1e3 for r in good],
              "TPOT": [r["tpot_s"] * 1e3 for r in good if r["tpot_s"] is not None],
              "ITL": [gap * 1e3 for r in good for gap in r["itl_s"]]}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (name, values) in zip(axes, series.items()):
        ordered = sorted(values)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))] if ordered else [])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of chunk gaps")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    with replaced_atomically(path) as tmp:  # a killed run leaves the old PNG, never half a new one
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
