"""Images through `treadle serve` on a tiny random LLaVA (issue 39): the TTFT of a one-image
chat request and images/s at concurrency 8, the share of the API server's image work in it
(decode + resize/crop/normalize of a 640 x 480 PNG), and the transfer of the seed's
[3, 336, 336] float16 tensor from the API server to the engine core (`ipc.py`'s tensor
bench: --tensor-ipc direct and shm).

Run: `python benchmarks/image_bench.py` (part of `make bench`). A tiny model: the figures say
what the serving path costs around the model, not a real LLaVA's speed.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import functools
import io
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ipc import bench_tensors  # noqa: E402
from llava_helpers import build_tiny_llava, random_image  # noqa: E402
from serve_helpers import RemoteServer  # noqa: E402
from treadle.frontend.images import ImageProcessor  # noqa: E402
from treadle.frontend.media import MediaPolicy, load_image  # noqa: E402
from treadle.model.arch import ModelArch  # noqa: E402


def data_uri(seed: int) -> str:
    buf = io.BytesIO()
    random_image(seed, 640, 480).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def preprocessing_ms(model: Path, rounds: int) -> float:
    """Median ms of what the API server does to one image before it is sent."""
    arch = ModelArch.from_hf_dir(str(model))
    assert arch.vision is not None
    import torch

    processor = ImageProcessor.from_model_dir(str(model), arch.vision, torch.float32)
    url = data_uri(0)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        processor(load_image(url, MediaPolicy(), "bench"))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def one_request(client: openai.OpenAI, model: str, url: str, max_tokens: int = 1) -> float:
    """Seconds to the first streamed token of a one-image chat request."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ],  # type: ignore[list-item]
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    assert first is not None
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64, help="requests at concurrency 8")
    parser.add_argument("--rounds", type=int, default=20, help="single requests for the TTFT")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llava(Path(tmp) / "tiny-llava")
        prep = preprocessing_ms(model, args.rounds)
        urls = [data_uri(1 + i) for i in range(args.rounds + args.requests)]
        for ipc in ("direct", "shm"):
            server = RemoteServer(
                [str(model), "--dtype", "float32", "--tensor-ipc", ipc], Path(tmp)
            )
            try:
                client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
                name = client.models.list().data[0].id
                one_request(client, name, data_uri(10_000), 1)  # warm up
                ttft = [one_request(client, name, u, 1) for u in urls[: args.rounds]]
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    list(
                        pool.map(
                            functools.partial(one_request, client, name, max_tokens=8),
                            urls[args.rounds :],
                        )
                    )
                wall = time.perf_counter() - start
            finally:
                server.stop()
            p50 = 1000 * statistics.median(ttft)
            print(
                f"--tensor-ipc {ipc}: one-image TTFT p50 {p50:.1f} ms (API server's image "
                f"work {prep:.1f} ms, {100 * prep / p50:.0f}%); {args.requests} requests at "
                f"concurrency 8: {args.requests / wall:.1f} images/s",
                flush=True,
            )
    bench_tensors(multiprocessing.get_context("spawn"), 200)


if __name__ == "__main__":
    main()
