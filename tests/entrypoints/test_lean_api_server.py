"""A lean API server (issue 41 item 2): its modules, its tokenizer and its start-up checks
import no torch; the tokenizer it loads without `AutoTokenizer` gives the same token ids, texts
and chat template output; the start-up checks' torch-free sizes are the worker's; served, its
idle RSS stays far below an API server with torch (~340 MiB), and it says so at start-up."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_helpers import RemoteServer
from treadle.config import resolve_model
from treadle.tokenizer import _cache_dir, load_tokenizer

API_SERVER_RSS_BOUND_MIB = 200
"""Generous for CI noise: measured ~116 MiB idle on the default model (torch: ~340)."""

NO_TORCH = """
import sys
import treadle.entrypoints.openai.api_server, treadle.cli.serve
from treadle.config import EngineConfig, resolve_model
from treadle.tokenizer import load_tokenizer
from treadle.worker.start_checks import check_config, check_parallel_layout, model_arch
tokenizer = load_tokenizer(resolve_model(None))
tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
check_config(EngineConfig())
check_parallel_layout(model_arch(resolve_model(None)), 1)
print(sorted(m for m in ("torch", "transformers.models.auto") if m in sys.modules))
"""


def test_api_server_modules_tokenizer_and_checks_import_no_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


CONTROL_PLANE = """
import sys
import treadle.core.scheduler, treadle.core.request, treadle.core.prompt_inputs
import treadle.core.grammar_matchers
import treadle.executor.base
from treadle.ipc.shm_message import PickleCodec
from treadle.wire.worker import NewRequestData, SchedulerOutput
from treadle.sampling_params import SamplingParams
step = SchedulerOutput(
    new_requests=[NewRequestData("r", [1, 2], 2, SamplingParams(max_tokens=4), [0], 0)],
    num_scheduled_tokens={"r": 2},
)
codec = PickleCodec()
assert codec.loads(codec.dumps(step)) == step
print(sorted(m for m in ("torch",) if m in sys.modules))
"""


def test_engine_core_control_plane_imports_no_torch() -> None:
    """The scheduler, its requests and checks, the executor's base and the step's wire format
    (pickled to the workers) need no torch: stage 3 of docs/design/torch-free-engine-core.md,
    toward an engine core without torch's ~211 MiB on the GGUF CPU path."""
    done = subprocess.run(
        [sys.executable, "-c", CONTROL_PLANE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


ENGINE_CORE = """
import sys
import numpy as np
import treadle.core.engine_core, treadle.core.engine_core_proc
import treadle.worker.cpu_share, treadle.worker.kv_file
import treadle.structured_outputs, treadle.core.grammar_matchers
from treadle.config import resolve_model
from treadle.core.grammar_matchers import GrammarMatchers
from treadle.model.arch_files import read_arch
from treadle.sampling_params import StructuredOutputsParams
modules = sorted(m for m in ("torch",) if m in sys.modules)
vocab = read_arch(resolve_model(None)).vocab_size
grammars = GrammarMatchers(None, vocab)
schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
matcher = grammars.submit(StructuredOutputsParams(json=schema)).result()
mask = grammars.bitmask([matcher])
grammars.shutdown()
assert mask.dtype == np.int32 and mask.shape == (1, (vocab + 31) // 32), (mask.dtype, mask.shape)
assert 0 < np.unpackbits(mask.view(np.uint8)).sum() < vocab  # some tokens allowed, not all
print(modules, sorted(m for m in ("torch",) if m in sys.modules))
"""


def test_engine_core_and_its_process_import_no_torch() -> None:
    """The engine core, its process module and what they import at module level (the thread
    governor, prompt-cache files, structured outputs) load no torch, and a constrained
    request's grammar bitmask (a JSON schema, the default model's tokenizer) is filled
    without it: stage 3 of docs/design/torch-free-engine-core.md. torch comes with the
    torch runner alone (`executor/uniproc.py` chooses it), a draft model, or several ranks."""
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_CORE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[] []", done.stdout


COORDINATOR = """
import sys
import treadle.cli.main, treadle.core.dp_coordinator
print(sorted(m for m in ("numpy", "torch", "transformers") if m in sys.modules))
"""


def test_dp_coordinator_imports_no_numpy() -> None:
    """Every spawned child of `treadle` imports the CLI (its `__main__`), the DP coordinator
    included: `treadle bench`'s numpy stays out of it (~15 MiB of RSS, issue 41 item 2)."""
    done = subprocess.run(
        [sys.executable, "-c", COORDINATOR], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


SUPERVISOR = """
import argparse, sys
from treadle.cli.serve import add_serve_parser, prepare
import treadle.cli.supervise
parser = argparse.ArgumentParser()
add_serve_parser(parser.add_subparsers())
prepare(parser.parse_args(["serve", "-dp", "2"]))
heavy = ("fastapi", "pydantic", "uvicorn", "starlette", "torch", "transformers")
print(sorted(m for m in heavy if m in sys.modules))
"""


def test_supervisor_imports_no_http_server() -> None:
    """`-dp 2`'s supervisor (and a headless CLI) checks the flags and starts processes: the
    HTTP server's modules load in its API servers only (~25 MiB less in the supervisor)."""
    done = subprocess.run(
        [sys.executable, "-c", SUPERVISOR], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "naïve café 東京 🚀 emoji",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "def f(x):\n\treturn x ** 2  # code\n",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <|im_end|> there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_dirs(tiny_model_factory) -> list[str]:  # type: ignore[no-untyped-def]
    load_tokenizer(resolve_model(None))  # (converts the GGUF vocabulary once, cached)
    return [_cache_dir(resolve_model(None)), str(tiny_model_factory("llama"))]


def test_lean_tokenizer_is_autotokenizers_and_gives_the_same_ids_and_texts(
    tokenizer_dirs: list[str],
) -> None:
    from transformers import AutoTokenizer

    for directory in tokenizer_dirs:
        lean = load_tokenizer(resolve_model(directory))
        auto = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        assert type(lean) is type(auto)
        assert len(lean) == len(auto)
        assert (lean.bos_token_id, lean.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
        assert lean.get_vocab() == auto.get_vocab()
        for text in TEXTS:
            for special in (True, False):
                ids = lean(text, add_special_tokens=special).input_ids
                assert ids == auto(text, add_special_tokens=special).input_ids
                assert lean.decode(ids) == auto.decode(ids)
                assert lean.decode(ids, skip_special_tokens=True) == auto.decode(
                    ids, skip_special_tokens=True
                )
            split = {"add_special_tokens": False, "split_special_tokens": True}
            assert lean(text, **split).input_ids == auto(text, **split).input_ids
        for chat in CHATS:
            for generation in (True, False):
                kwargs = {"tokenize": False, "add_generation_prompt": generation}
                assert lean.apply_chat_template(chat, **kwargs) == auto.apply_chat_template(
                    chat, **kwargs
                )


def test_start_checks_sizes_are_the_workers() -> None:
    import torch

    from treadle.model import attention
    from treadle.worker import start_checks, worker

    assert start_checks.DTYPE_NAMES == worker.DTYPE_NAMES
    assert start_checks.INT8_SCALE_BYTES == attention.INT8_SCALE_BYTES
    assert {k: v.itemsize for k, v in attention._KV_STORAGE.items()} == start_checks.KV_DTYPE_BYTES
    assert {k: v.itemsize for k, v in worker._DTYPES.items()} == start_checks.DTYPE_BYTES
    for model_dtype in (torch.float32, torch.bfloat16):
        name = str(model_dtype).removeprefix("torch.")
        for kv in (*start_checks.KV_DTYPE_BYTES, "auto"):
            resolved = start_checks.kv_cache_dtype_name(kv, name)
            assert resolved == attention.resolve_kv_cache_dtype(kv, model_dtype)
            for head_dim in (64, 128):
                assert start_checks.kv_row_bytes(resolved, head_dim) == attention.kv_row_bytes(
                    resolved, head_dim
                )
    start_checks.torch_has_cuda.cache_clear()
    assert start_checks.torch_has_cuda() == torch.backends.cuda.is_built()


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        ["--max-model-len", "512"],
        tmp_path_factory.mktemp("lean"),
        env={"TREADLE_LOGGING_LEVEL": "INFO"},  # (the memory line is INFO)
    )
    yield srv
    srv.stop()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_served_api_server_is_lean_and_says_its_idle_memory(default_server: RemoteServer) -> None:
    pattern = r"Idle memory: API server (\d+) MiB RSS \((\d+) PSS\); engine core 0 (\d+) MiB RSS"
    deadline = time.monotonic() + 30  # said just after it starts serving (its heap trimmed)
    while (line := re.search(pattern, default_server.output())) is None:
        assert time.monotonic() < deadline, default_server.output()
        time.sleep(0.2)
    assert 0 < int(line.group(1)) <= API_SERVER_RSS_BOUND_MIB
    assert int(line.group(3)) > int(line.group(1))  # the engine core holds the model
    pid = default_server.pid_of("treadle::APIServer_0")
    assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()  # torch never loaded
    rss = _rss_mib(pid)
    print(f"API server idle RSS: {rss:.1f} MiB (its own line: {line.group(1)} MiB)")
    assert rss <= API_SERVER_RSS_BOUND_MIB
