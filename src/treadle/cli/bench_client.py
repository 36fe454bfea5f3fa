"""`treadle bench serve`'s HTTP side: one streamed completion (or chat completion) per prompt
with aiohttp, timed as vLLM's benchmark client times it, plus the few server calls it needs
first (/v1/models, /tokenize, /detokenize)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from treadle.cli.bench_metrics import RequestResult


def arrival_gaps(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before sending each request: all 0 for an infinite rate, else Poisson
    arrivals (exponential gaps) with mean rate `request_rate` per second."""
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num)]


async def _send(
    session: Any, url: str, body: dict[str, Any], headers: dict[str, str], prompt_len: int
) -> RequestResult:
    """Send one streamed completion request; never raises (a failure is recorded instead)."""
    result = RequestResult(prompt_len=prompt_len)
    chunks, usage_tokens = 0, None
    start = last = result.start_time = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    err = data["error"]
                    result.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return result
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                choices = data.get("choices") or []
                text = (
                    choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
                    if choices
                    else None
                )
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
        result.latency = time.perf_counter() - start
        if chunks == 0:
            result.ttft = result.latency
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.success = True
    except Exception as e:  # whatever goes wrong is this request's failure, not the run's
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(
    base_url: str,
    model: str,
    prompts: Sequence[list[int] | str],
    output_len: int | list[int],
    *,
    endpoint: str = "/v1/completions",
    chat: bool = False,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    ignore_eos: bool = False,
    seed: int = 0,
    disable_tqdm: bool = False,
    api_key: str | None = None,
    fresh_connections: bool = False,
    prompt_lens: list[int] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every prompt as a streamed completion; returns the records (in prompt order) and the
    wall time in seconds from the first send to the last finish. `output_len`: max_tokens
    of every request, or of each; `chat`: prompts are texts sent as one user message to a chat
    completions endpoint (vLLM's openai-chat backend). `fresh_connections`: one
    connection per request, for servers that close kept-alive ones after a few requests
    (llama.cpp's llama-server). `prompt_lens`: the prompts' token counts when they are texts."""
    import aiohttp
    from tqdm import tqdm

    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=fresh_connections)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    bar = tqdm(total=len(prompts), disable=disable_tqdm, desc="Requests")

    lens = output_len if isinstance(output_len, list) else [output_len] * len(prompts)

    async def one(
        session: aiohttp.ClientSession, prompt: list[int] | str, max_tokens: int, prompt_len: int
    ) -> RequestResult:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if ignore_eos:
            body["ignore_eos"] = True
        async with semaphore or contextlib.nullcontext():
            result = await _send(session, url, body, headers, prompt_len)
        bar.update(1)
        return result

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens, prompt_len, gap in zip(
            list[Any](prompts),
            lens,
            prompt_lens or [len(p) for p in prompts],
            arrival_gaps(len(prompts), request_rate, seed),
            strict=True,
        ):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(session, prompt, max_tokens, prompt_len)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def _call(base_url: str, path: str, api_key: str | None, body: Any = None) -> Any:
    """GET (or POST `body` as JSON to) the server; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url.rstrip("/") + path, data=data)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def first_model_id(base_url: str, api_key: str | None = None) -> str:
    """The first model id the server lists at /v1/models."""
    return str(_call(base_url, "/v1/models", api_key)["data"][0]["id"])


def detokenize(base_url: str, prompts: list[list[int]], api_key: str | None) -> list[str]:
    """The text of token-id prompts, from the server's /detokenize (vLLM's and treadle's)."""
    with ThreadPoolExecutor(8) as pool:
        answers = pool.map(
            lambda ids: _call(base_url, "/detokenize", api_key, {"tokens": ids}), prompts
        )
        return [str(a["prompt"]) for a in answers]


def count_tokens(base_url: str, texts: list[str], api_key: str | None) -> list[int]:
    """Token counts of texts by the server's tokenizer (/tokenize; special tokens included, as
    vLLM's benchmark counts them with the model's tokenizer)."""
    with ThreadPoolExecutor(8) as pool:
        answers = pool.map(
            lambda text: _call(base_url, "/tokenize", api_key, {"prompt": text}), texts
        )
        return [int(a["count"]) for a in answers]
