"""Embeddings/s (issue 23 item 4): 256 inputs of 128 tokens through `/v1/embeddings`, treadle
(default model, last-token pooling) beside llama.cpp's `llama-server --embeddings --pooling
last` on the same GGUF and the same token ids, one after the other in one run; 16 inputs per
request, 4 requests in flight. Also the cosine between the two servers' vectors (same
weights, same pooling: close to 1). llama.cpp needs `make bench-peers` (.peers/).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))

import httpx  # noqa: E402
import torch  # noqa: E402

from peer_bench import LlamaServer, free_port  # noqa: E402
from serve_bench import Server  # noqa: E402
from treadle.config import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INPUTS, TOKENS, PER_REQUEST, IN_FLIGHT = 256, 128, 16, 4


def inputs() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, 40000, (INPUTS, TOKENS), generator=g).tolist()


def run(url: str, model: str, items: list[list[int]]) -> tuple[float, list[list[float]]]:
    """Seconds for all inputs, and their vectors in order."""
    batches = [items[i : i + PER_REQUEST] for i in range(0, len(items), PER_REQUEST)]

    def one(batch: list[list[int]]) -> list[list[float]]:
        body = {"model": model, "input": batch, "encoding_format": "float"}
        r = httpx.post(url + "/v1/embeddings", json=body, timeout=600)
        r.raise_for_status()
        return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]

    one(batches[0])  # warm up
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        results = list(pool.map(one, batches))
    return time.perf_counter() - start, [v for batch in results for v in batch]


class LlamaEmbedServer(LlamaServer):
    def __init__(self, binary: Path, gguf: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        ctx = IN_FLIGHT * PER_REQUEST * (TOKENS + 8)
        cmd = [str(binary), "-m", gguf, "-t", "2", "-np", str(IN_FLIGHT * PER_REQUEST)]
        cmd += ["-c", str(ctx), "-b", "2048", "-ub", "2048", "--embeddings", "--pooling", "last"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--peers", default=str(ROOT / ".peers"))
    args = ap.parse_args()
    items = inputs()
    gguf = resolve_model(None).path
    work = Path(tempfile.mkdtemp(prefix="treadle-embed-"))
    server = Server(work / "treadle.log", ["--max-model-len", "512"])
    try:
        server.wait_healthy()
        name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        ours_s, ours = run(server.url, name, items)
    finally:
        server.stop()
    print(f"treadle: {INPUTS / ours_s:.1f} embeddings/s ({INPUTS} x {TOKENS} tokens)", flush=True)
    binary = Path(args.peers) / "llama-server-native"
    if not binary.exists():
        print(f"llama.cpp: not measured ({binary} missing: make bench-peers)")
        return
    peer = LlamaEmbedServer(binary, gguf, work / "llama.log")
    try:
        peer.wait_healthy()
        theirs_s, theirs = run(peer.url, "default", items)
    finally:
        peer.stop()
    cos = [
        float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))
        for a, b in zip(ours, theirs, strict=True)
    ]
    print(
        f"llama.cpp: {INPUTS / theirs_s:.1f} embeddings/s; treadle / llama.cpp: {theirs_s / ours_s:.2f}x"
    )
    print(
        f"cosine treadle vs llama.cpp: min {min(cos):.4f}, median {sorted(cos)[len(cos) // 2]:.4f}"
    )


if __name__ == "__main__":
    main()
