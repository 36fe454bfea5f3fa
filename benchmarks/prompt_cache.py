"""Prompt caches on disk (issue 26 item 2): TTFT of a long prompt read cold, and after its KV
was saved, the prefix cache emptied and the file restored; and the save and restore times.
`treadle serve` (default model) with --kv-cache-save-path and TREADLE_SERVER_DEV_MODE=1 (for
`/reset_prefix_cache`); TTFT is the time to the first streamed token of a 1-token request.
Target: TTFT after restore <= 10% of the cold one for a 4k-token prompt.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TREADLE_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))

import httpx  # noqa: E402

from serve_bench import Server  # noqa: E402


def ttft(url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token came back")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="treadle-prompt-cache-"))
    os.environ["TREADLE_SERVER_DEV_MODE"] = "1"
    server = Server(
        work / "server.log",
        ["--max-model-len", str(args.tokens + 64), "--kv-cache-save-path", str(work)],
    )
    try:
        server.wait_healthy()
        url = server.url
        cold, restored, saves, restores = [], [], [], []
        for r in range(args.rounds):
            # a different prompt each round: token ids of ordinary words, no cache shared
            prompt = [(1000 + 7 * i + 131 * r) % 40000 + 100 for i in range(args.tokens)]
            httpx.post(url + "/reset_prefix_cache", timeout=60)
            cold.append(ttft(url, prompt))
            name = f"round{r}.bin"
            body = {"prompt": prompt, "filename": name}
            saved = httpx.post(url + "/prompt_cache/save", json=body, timeout=600).json()
            saves.append(saved["save_ms"])
            httpx.post(url + "/reset_prefix_cache", timeout=60)
            done = httpx.post(url + "/prompt_cache/restore", json={"filename": name}, timeout=600)
            restores.append(done.json()["restore_ms"])
            restored.append(ttft(url, prompt))
            size = (work / name).stat().st_size
            print(
                f"round {r}: {args.tokens} tokens, cold TTFT {cold[-1] * 1e3:.0f} ms, after "
                f"restore {restored[-1] * 1e3:.0f} ms ({restored[-1] / cold[-1]:.1%}); save "
                f"{saves[-1]:.0f} ms, restore {restores[-1]:.0f} ms, file {size / 2**20:.1f} MiB",
                flush=True,
            )
        ratio = sorted(b / a for a, b in zip(cold, restored, strict=True))[len(cold) // 2]
        print(f"median TTFT after restore / cold: {ratio:.1%} (issue 26 target: <= 10%)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
