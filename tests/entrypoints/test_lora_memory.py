"""The engine core's memory comes back after its adapters are unloaded (issue 40): the
default model served with `--enable-lora`, 4 adapters of rank 16 on every projection (~20 MiB
each as read in float32, ~10 MiB as kept: bfloat16 over GGUF blocks) loaded while serving and each used by a request, then unloaded: the
engine core's resident memory (its whole process tree) ends near where it started."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psutil

from model.test_lora_fused import random_adapter
from serve_helpers import RemoteServer
from treadle.config import resolve_model
from treadle.model.loader import read_arch

MIB = 2**20


def engine_rss(server: RemoteServer) -> int:
    core = psutil.Process(server.pid_of("treadle::EngineCore_DP0"))
    return sum(p.memory_info().rss for p in [core, *core.children(recursive=True)])


def test_unloaded_adapters_give_their_memory_back(
    default_model_path: str, tmp_path: Path, server_factory
) -> None:  # type: ignore[no-untyped-def]
    arch = read_arch(resolve_model(default_model_path))
    folder = tmp_path / "adapters"
    folder.mkdir()
    paths = [random_adapter(folder / f"a{i}", arch, 16, i) for i in range(5)]
    server = server_factory(
        [
            *(default_model_path, "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "5"),
            *("--max-lora-rank", "16", "--lora-modules", f"a0={paths[0]}"),
        ],
        env={"TREADLE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )

    def ask(model: str) -> None:
        body = {"model": model, "prompt": "Hello", "max_tokens": 2}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

    def post(path: str, body: dict[str, str]) -> None:
        r = httpx.post(server.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text

    ask("a0")  # the slots, the first request's buffers and a0 itself, before
    before = engine_rss(server)
    names = [f"x{i}" for i in range(1, 5)]
    for name, path in zip(names, paths[1:], strict=True):
        post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        ask(name)  # in a slot, used
    loaded = engine_rss(server)
    for name in names:
        post("/v1/unload_lora_adapter", {"lora_name": name})
    ask("a0")  # (a step after the unloads)
    time.sleep(0.5)
    after = engine_rss(server)
    grew = loaded - before
    assert grew > 20 * MIB, f"4 adapters of ~10 MiB each added only {grew / MIB:.1f} MiB"
    # back within a quarter of what they took (measured: ~1%, the new requests' KV blocks)
    assert after - before < grew / 4, (
        f"before {before / MIB:.1f} MiB, loaded {loaded / MIB:.1f}, unloaded {after / MIB:.1f}"
    )
