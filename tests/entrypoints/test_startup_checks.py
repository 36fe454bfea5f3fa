"""Start-up mistakes are refused before any process starts: one line `treadle serve: error:
...` that says what to change, exit code 2, no traceback; the offline `LLM` raises
`ValueError` with the same words."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from serve_helpers import TREADLE
from treadle.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from treadle.worker.start_checks import check_config
from treadle.worker.worker import resolve_dtype


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> str:  # type: ignore[no-untyped-def]
    return str(tiny_model_factory("llama"))  # max_position_embeddings 512


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


MISTAKES = {
    # flags after the model -> words the one line must contain
    "dtype": (["--dtype", "fp8"], "unknown dtype 'fp8': choose one of auto, float32, float,"),
    "max-model-len": (
        ["--max-model-len", "100000"],
        "this model takes at most 512 tokens (max_position_embeddings); pass --max-model-len 512",
    ),
    "kv-cache-memory": (
        ["--kv-cache-memory", "64KiB"],
        # tiny llama: 2 x 2 kv heads x 16 x 4 bytes x 16 tokens x 2 layers = 8 KiB a block
        "the KV cache is too small for max_model_len 512: one request of that length needs "
        "256.00 KiB of KV cache, but 64.00 KiB (--kv-cache-memory) holds only 128 tokens; raise "
        "--kv-cache-memory to 1MiB or more, or pass --max-model-len 128 or less",
    ),
    "block-size": (["--block-size", "0"], "--block-size must be at least 1, not 0"),
    "cpu-threads": (["--cpu-threads", "0"], "--cpu-threads must be at least 1, not 0"),
    "enable-auto-tool-choice": (
        ["--enable-auto-tool-choice"],
        "--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)",
    ),
    "tool-call-parser": (
        ["--enable-auto-tool-choice", "--tool-call-parser", "mistral"],
        "unknown tool call parser 'mistral'; choose one of: hermes",
    ),
}


def test_each_mistake_is_one_line_before_any_process_starts(tiny: str, busy_port: int) -> None:
    cases = {name: (flags, words) for name, (flags, words) in MISTAKES.items()}
    cases["port"] = (
        ["--port", str(busy_port)],
        f"cannot listen on 127.0.0.1:{busy_port}: Address already in use; choose another --port",
    )
    start = time.monotonic()
    procs = {}
    for name, (flags, _) in cases.items():  # all at once: each takes seconds of imports
        port = [] if name == "port" else ["--port", "0"]
        procs[name] = subprocess.Popen(
            [TREADLE, "serve", tiny, *flags, *port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, proc in procs.items():
        children: set[int] = set()
        while proc.poll() is None and time.monotonic() - start < 120:
            with contextlib.suppress(psutil.NoSuchProcess):
                children |= {c.pid for c in psutil.Process(proc.pid).children()}
            time.sleep(0.05)
        out, err = proc.communicate(timeout=5)
        words = cases[name][1]
        assert proc.returncode == 2, (name, out, err)
        assert err.splitlines() == [err.strip()], (name, err)  # exactly one line
        assert err.startswith("treadle serve: error: ") and words in err, (name, err)
        assert "Traceback" not in out + err and "Loading" not in out + err, name
        assert not children, f"{name}: a child process was started: {children}"


@pytest.mark.parametrize("name", ["half", "float", "float16", "bfloat16", "float32", "auto"])
def test_vllm_dtype_names_are_accepted(name: str, tiny: str) -> None:
    check_config(EngineConfig(ModelConfig(tiny, dtype=name)))
    expected = {"half": torch.float16, "float": torch.float32, "auto": torch.float32}.get(name)
    assert resolve_dtype(name, torch.device("cpu")) == (expected or getattr(torch, name))


def test_offline_llm_raises_the_same_words_before_starting_anything(tiny: str) -> None:
    from treadle import LLM

    before = set(psutil.Process().children(recursive=True))
    for kwargs, (_, words) in (
        ({"dtype": "fp8"}, MISTAKES["dtype"]),
        ({"max_model_len": 100000}, MISTAKES["max-model-len"]),
        ({"kv_cache_memory": 64 << 10}, MISTAKES["kv-cache-memory"]),
    ):
        with pytest.raises(ValueError) as info:
            LLM(tiny, **kwargs)  # type: ignore[arg-type]
        assert words in str(info.value)
    assert set(psutil.Process().children(recursive=True)) <= before


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("TREADLE_CPU_THREADS", "abc", "TREADLE_CPU_THREADS='abc': give a number of threads"),
        ("TREADLE_CPU_THREADS", "0", "TREADLE_CPU_THREADS='0': give a number of threads"),
        (
            "TREADLE_CPU_ISA",
            "avx9",
            "TREADLE_CPU_ISA='avx9': choose one of avx512vnni, avx512, avx2vnni, avx2, portable",
        ),
    ],
)
def test_bad_cpu_environment_is_refused_before_starting(
    tiny: str, variable: str, value: str, words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        check_config(EngineConfig(ModelConfig(tiny)))
    monkeypatch.setenv("TREADLE_CPU_THREADS", "3")
    monkeypatch.delenv("TREADLE_CPU_ISA", raising=False)
    config = EngineConfig(ModelConfig(tiny))
    check_config(config)
    assert config.parallel.model_threads() == 3


def test_kv_cache_that_fits_max_model_len_exactly_is_accepted(tiny: str) -> None:
    config = EngineConfig(
        ModelConfig(tiny, max_model_len=128),
        CacheConfig(kv_cache_memory=64 << 10),
        SchedulerConfig(),
    )
    check_config(config)  # 8 blocks of 16 tokens: exactly 128


def test_an_engine_that_fails_after_the_checks_reports_its_own_error(
    tiny: str, tmp_path: Path
) -> None:
    """The checks pass (config.json is fine) but the weights are truncated: the last line is
    the engine's error (it once was `'AsyncMPClient' object has no attribute '_tasks'`)."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = subprocess.run(
        [TREADLE, "serve", str(broken), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("treadle serve: error: the EngineCore_DP0 process failed to start")
    assert "_tasks" not in result.stderr
