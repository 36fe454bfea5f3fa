"""`treadle serve -pp 2`: per-stage workers in /topology and the start-up log, and kill -9 of a
stage worker restarts the engine while every stream finishes with its undisturbed text."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from serve_helpers import RemoteServer, stream_text

LAYERS = 5
STREAMS = 4
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def model5(tmp_path_factory: pytest.TempPathFactory, tiny_model_builder) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_builder(tmp_path_factory.mktemp("tiny5"), "llama", num_hidden_layers=LAYERS)


def test_a_killed_stage_worker_restarts_the_engine_and_streams_go_on(
    server_factory, model5: Path
) -> None:  # type: ignore[no-untyped-def]
    srv: RemoteServer = server_factory(
        [str(model5), "-pp", "2", "--max-engine-restarts", "3"],
        env={"TREADLE_LOGGING_LEVEL": "INFO"},
    )
    # Each stage says what it holds; /topology shows each worker's stage and TP rank.
    log = srv.output()
    assert "Pipeline stage 0/2, TP rank 0: layers 0-2 + embedding, weights" in log
    assert "Pipeline stage 1/2, TP rank 0: layers 3-4 + final norm, LM head, sampling" in log
    topo = httpx.get(srv.url + "/topology", timeout=30).json()
    workers = [p for p in topo["processes"] if p["role"] == "Worker"]
    assert sorted((p["title"], p["pp_rank"], p["tp_rank"]) for p in workers) == [
        ("Worker_PP0_TP0", 0, 0),
        ("Worker_PP1_TP0", 1, 0),
    ]
    prompts = [f"Tell me about the number {i}." for i in range(STREAMS)]
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        reference = list(pool.map(lambda p: stream_text(srv.url, p, MAX_TOKENS), prompts))
        chunks: list[list[float]] = [[] for _ in prompts]
        futures = [
            pool.submit(stream_text, srv.url, p, MAX_TOKENS, c)
            for p, c in zip(prompts, chunks, strict=True)
        ]
        while min(len(c) for c in chunks) < 20:
            assert not any(f.done() for f in futures), [f.result() for f in futures]
            time.sleep(0.01)
        victim = srv.pid_of("treadle::Worker_PP1_TP0")
        os.kill(victim, signal.SIGKILL)
        assert [f.result(180) for f in futures] == reference
    assert srv.pid_of("treadle::Worker_PP1_TP0") != victim
    said = f"Worker_PP1_TP0 (pid {victim}) died: killed by signal 9 (SIGKILL)"
    assert any(said in line and "Restarting it" in line for line in srv.output().splitlines())
