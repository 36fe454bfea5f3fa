"""llama.cpp's `/infill` and `/completion` (issue 26 item 1) against a tiny random Qwen2-style
model whose tokenizer has FIM tokens: the prompt is laid out as llama.cpp lays it out (token
ids compared through greedy decoding), streamed and not, with llama.vscode's and llama.vim's
request shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serve_helpers import RemoteServer

FIM_TOKENS = [
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
N_BATCH = 256  # --max-num-batched-tokens: llama.cpp's n_batch for the prefix/suffix split
N_CTX = 512


def build_fim_model(path: Path, build_tiny_model: Any) -> Path:
    """A tiny Qwen2-style model whose tokenizer has Qwen2.5-Coder's FIM tokens."""
    from transformers import AutoTokenizer

    build_tiny_model(path, "qwen2", vocab_size=49152 + len(FIM_TOKENS) + 2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(FIM_TOKENS, special_tokens=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, tiny_model_builder: Any) -> Path:
    return build_fim_model(tmp_path_factory.mktemp("tiny-fim"), tiny_model_builder)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    args = [str(model), "--max-model-len", str(N_CTX), "--max-num-batched-tokens", str(N_BATCH)]
    args += ["--kv-cache-save-path", str(tmp_path_factory.mktemp("saved"))]
    env = {"TREADLE_SERVER_DEV_MODE": "1"}
    srv = RemoteServer(args, tmp_path_factory.mktemp("fim-server"), env=env)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def llama_cpp_layout(
    tok: Any,
    prefix: str,
    suffix: str,
    extra: list[dict[str, str]],
    prompt: str,
    n_predict: int,
) -> list[int]:
    """llama.cpp's `format_prompt_infill`, written out again for this test."""

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False, split_special_tokens=True).input_ids)

    special = tok.convert_tokens_to_ids
    repo, sep = special("<|repo_name|>"), special("<|file_sep|>")
    ctx = [repo, *ids("myproject\n")]
    for chunk in extra:
        ctx += [sep, *ids(chunk["filename"] + "\n"), *ids(chunk["text"])]
    ctx += [sep, *ids("filename\n")]
    pre, suf, mid = ids(prefix), ids(suffix), ids(prompt)
    take_pre = min(len(pre), 3 * N_BATCH // 4)
    take_suf = min(len(suf), max(0, N_BATCH // 4 - 2 - len(mid)))
    take_ctx = min(max(0, N_CTX - N_BATCH - 2 * n_predict), len(ctx))
    return [
        *(ctx[-take_ctx:] if take_ctx else []),
        special("<|fim_prefix|>"),
        *pre[len(pre) - take_pre :],
        *mid,
        special("<|fim_suffix|>"),
        *suf[:take_suf],
        special("<|fim_middle|>"),
    ]


@pytest.fixture(scope="module")
def end_ids(tokenizer: Any) -> list[int]:
    """The tokens besides eos that end a llama.cpp generation (FIM pad/repo/separator...)."""
    from treadle.entrypoints.openai.fim import end_of_generation_ids

    return [t for t in end_of_generation_ids(tokenizer) if t != tokenizer.eos_token_id]


def greedy_completion(
    server: RemoteServer, prompt: list[int] | str, n: int, end_ids: list[int]
) -> dict[str, Any]:
    """The same prompt's greedy choice through /v1/completions (stopping where llama.cpp's
    endpoints stop)."""
    body = {
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "return_token_ids": True,
        "stop_token_ids": end_ids,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def vscode_request(**changes: Any) -> dict[str, Any]:
    """llama.vscode's request body (its FIM request), greedy through `samplers`."""
    body: dict[str, Any] = {
        "id_slot": 0,
        "input_prefix": "def add(a, b):\n    ",
        "input_suffix": "\n\nprint(add(1, 2))\n",
        "input_extra": [
            {"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"},
            {"filename": "main.py", "text": "import util\n"},
        ],
        "prompt": "return",
        "n_predict": 8,
        "top_k": 40,
        "top_p": 0.99,
        "stream": False,
        "n_indent": 0,
        "samplers": ["temperature"],
        "temperature": 0,
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000,
    }
    body.update(changes)
    return body


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(json.loads(line[len("data: ") :]))
    return events


def test_infill_lays_out_the_prompt_as_llama_cpp(
    server: RemoteServer, tokenizer: Any, end_ids: list[int]
) -> None:
    body = vscode_request()
    r = httpx.post(server.url + "/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    expected = llama_cpp_layout(
        tokenizer, body["input_prefix"], body["input_suffix"], body["input_extra"], "return", 8
    )
    assert out["tokens_evaluated"] == len(expected)
    assert out["tokens"] == greedy_completion(server, expected, 8, end_ids)["token_ids"]
    assert out["content"] == tokenizer.decode(out["tokens"], skip_special_tokens=True)
    assert out["stop"] is True and out["stop_type"] in ("limit", "eos")
    assert out["tokens_predicted"] == len(out["tokens"])
    assert out["id_slot"] == 0
    assert set(out["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms"}


@pytest.mark.parametrize("long", [False, True])
def test_the_endpoints_prompt_ids_are_llama_cpps_layout(tokenizer: Any, long: bool) -> None:
    """The ids `/infill` sends to the engine (its own code path, `_prompt_ids`, on this
    tokenizer and the server's n_batch and n_ctx) are exactly llama.cpp's layout, token by
    token; short inputs, and long ones that are cut."""
    from types import SimpleNamespace

    from treadle.entrypoints.openai.llamacpp_completion import (
        LlamaCompletionRequest,
        LlamaCompletionServing,
    )
    from treadle.frontend.input_processor import InputProcessor
    from treadle.validation import ModelLimits

    processor = InputProcessor(tokenizer, ModelLimits(len(tokenizer), N_CTX))
    scheduler = SimpleNamespace(max_num_batched_tokens=N_BATCH)
    engine = SimpleNamespace(input_processor=processor, config=SimpleNamespace(scheduler=scheduler))
    serving = object.__new__(LlamaCompletionServing)
    serving.base = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    body = vscode_request()
    if long:
        body["input_prefix"] = "".join(f"line_{i} = {i}\n" for i in range(200))
        body["input_suffix"] = "".join(f"after_{i}()\n" for i in range(100))
        body["input_extra"] = [
            {"filename": f"f{i}.py", "text": f"x{i} = {i}\n" * 20} for i in range(10)
        ]
    req = LlamaCompletionRequest(**body)
    got = serving._prompt_ids(req, True, body["n_predict"])
    expected = llama_cpp_layout(
        tokenizer,
        body["input_prefix"],
        body["input_suffix"],
        body["input_extra"],
        body["prompt"],
        body["n_predict"],
    )
    assert got == expected


def test_long_inputs_are_cut_as_llama_cpp_cuts_them(
    server: RemoteServer, tokenizer: Any, end_ids: list[int]
) -> None:
    """The prefix keeps its last 3/4 n_batch tokens, the suffix its first n_batch/4 - 2 -
    len(prompt), the extra context what n_ctx - n_batch - 2 n_predict leaves."""
    prefix = "".join(f"line_{i} = {i}\n" for i in range(200))
    suffix = "".join(f"after_{i}()\n" for i in range(100))
    extra = [{"filename": f"f{i}.py", "text": f"x{i} = {i}\n" * 20} for i in range(10)]
    body = vscode_request(input_prefix=prefix, input_suffix=suffix, input_extra=extra, prompt="")
    body["n_predict"] = 4
    r = httpx.post(server.url + "/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    expected = llama_cpp_layout(tokenizer, prefix, suffix, extra, "", 4)
    assert len(expected) < len(tokenizer(prefix + suffix).input_ids)  # it was cut
    assert r.json()["tokens_evaluated"] == len(expected)
    assert r.json()["tokens"] == greedy_completion(server, expected, 4, end_ids)["token_ids"]


def test_infill_streams_the_same_text(server: RemoteServer) -> None:
    body = vscode_request(stream=True)
    with httpx.stream("POST", server.url + "/infill", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r)
    whole = httpx.post(server.url + "/infill", json=vscode_request(), timeout=60).json()
    assert events[-1]["stop"] is True and "timings" in events[-1]
    assert all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == whole["content"]


def _chain(body: dict[str, Any]) -> Any:
    """The `SamplingParams` the endpoint makes of a request body."""
    from types import SimpleNamespace

    from treadle.entrypoints.openai.llamacpp_completion import (
        LlamaCompletionRequest,
        LlamaCompletionServing,
    )
    from treadle.validation import ModelLimits

    processor = SimpleNamespace(limits=ModelLimits(50000, N_CTX))
    serving = object.__new__(LlamaCompletionServing)
    serving.base = SimpleNamespace(  # type: ignore[assignment]
        engine=SimpleNamespace(input_processor=processor), sampling_defaults={}
    )
    serving.end_ids = []
    return serving._params(LlamaCompletionRequest(**body), body["n_predict"], 10)


def test_llama_vscode_sampler_chain_and_llama_vim_warm_up(server: RemoteServer) -> None:
    """llama.vscode's own sampling runs its chain: top_k 40, top_p 0.99 and the infill sampler,
    no temperature sampler (so 1.0), no penalties; a sampler left out of `samplers` is off
    (top_k 1 alone is greedy; top_k 1 left out is not); llama.vim's warm-up (n_predict 0) reads
    the prompt only; `response_fields` picks the fields."""
    body = vscode_request(samplers=["top_k", "top_p", "infill"], seed=7, repeat_penalty=1.3)
    del body["temperature"]
    params = _chain(body)
    assert (params.top_k, params.top_p, params.temperature) == (40, 0.99, 1.0)
    assert (params.min_p, params.repetition_penalty, params.infill) == (0.0, 1.0, True)
    r = httpx.post(server.url + "/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens_predicted"] <= 8
    assert httpx.post(server.url + "/infill", json=body, timeout=60).json() | {"timings": 0} == (
        r.json() | {"timings": 0}
    )  # the seed makes it repeat
    greedy = httpx.post(server.url + "/infill", json=vscode_request(), timeout=60).json()
    one = vscode_request(samplers=["top_k"], top_k=1, temperature=1.5, seed=7)
    assert (
        httpx.post(server.url + "/infill", json=one, timeout=60).json()["tokens"]
        == (greedy["tokens"])
    )
    hot = httpx.post(server.url + "/infill", json={**one, "samplers": ["temperature"]}, timeout=60)
    assert hot.json()["tokens"] != greedy["tokens"]
    warm = vscode_request(n_predict=0, samplers=[], response_fields=[""])
    r = httpx.post(server.url + "/infill", json=warm, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {}
    fields = ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"]
    r = httpx.post(server.url + "/infill", json=vscode_request(response_fields=fields), timeout=60)
    assert r.status_code == 200, r.text
    assert set(r.json()) == set(fields)
    assert r.json()["timings/predicted_n"] == 8 or r.json()["content"] is not None


def test_completion_endpoint_matches_v1_completions(
    server: RemoteServer, end_ids: list[int]
) -> None:
    body = {"prompt": "def f(x):", "n_predict": 6, "samplers": ["temperature"], "temperature": 0}
    r = httpx.post(server.url + "/completion", json=body, timeout=60)
    assert r.status_code == 200, r.text
    v1 = greedy_completion(server, "def f(x):", 6, end_ids)
    assert r.json()["tokens"] == v1["token_ids"]
    assert r.json()["content"] == v1["text"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"samplers": ["mirostat_v3"]}, "samplers"),
        ({"mirostat": 2}, "mirostat"),
        ({"n_probs": 5}, "n_probs"),
        ({"id_slot": 100000}, "id_slot"),
        ({"cache_prompt": False}, "cache_prompt"),
        ({"n_predict": -5}, "n_predict"),
        ({"n_predict": 100000}, "max_tokens"),
        ({"input_prefix": [1, 2, 10**9]}, "input_prefix"),
        ({"grammar": "root ::= ("}, "grammar"),
    ],
)
def test_bad_fields_are_400s(server: RemoteServer, change: dict[str, Any], param: str) -> None:
    r = httpx.post(server.url + "/infill", json=vscode_request(**change), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# -- prompt caches on disk (issue 26 item 2) ------------------------------------------------


def save_dir(server: RemoteServer) -> Path:
    args = server.proc.args
    return Path(args[args.index("--kv-cache-save-path") + 1])


def post(server: RemoteServer, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_a_saved_slot_restores_into_the_prefix_cache(server: RemoteServer) -> None:
    """llama.vim's flow: a FIM request in slot 1, the slot saved, the cache emptied, the file
    restored: the same request then reads the prompt from the cache, with the same answer."""
    prefix = "".join(f"value_{i} = compute({i})\n" for i in range(40))
    body = vscode_request(id_slot=1, input_prefix=prefix, n_predict=4)
    cold = post(server, "/infill", body).json()
    warm = post(server, "/infill", body).json()
    assert warm["timings"]["cache_n"] > 0 and warm["tokens"] == cold["tokens"]
    saved = post(server, "/slots/1?action=save", {"filename": "slot1.bin"})
    assert saved.status_code == 200, saved.text
    assert saved.json()["n_saved"] >= warm["timings"]["cache_n"]
    assert (save_dir(server) / "slot1.bin").stat().st_size == saved.json()["n_written"]
    assert post(server, "/reset_prefix_cache").status_code == 200
    assert post(server, "/infill", body).json()["timings"]["cache_n"] == 0
    post(server, "/reset_prefix_cache")
    restored = post(server, "/slots/1?action=restore", {"filename": "slot1.bin"})
    assert restored.status_code == 200, restored.text
    assert restored.json()["n_restored"] == saved.json()["n_saved"]
    again = post(server, "/infill", body).json()
    assert again["timings"]["cache_n"] == warm["timings"]["cache_n"]
    assert again["tokens"] == cold["tokens"]
    erased = post(server, "/slots/1?action=erase")
    assert erased.json() == {
        "id_slot": 1,
        "n_erased": len(warm["tokens"]) + warm["tokens_evaluated"],
    }
    nothing = post(server, "/slots/1?action=save", {"filename": "slot1.bin"})
    assert nothing.status_code == 400 and nothing.json()["error"]["param"] == "id_slot"


def test_the_prompt_form_saves_and_restores(server: RemoteServer) -> None:
    prompt = "Once upon a time " * 30
    post(server, "/completion", {"prompt": prompt, "n_predict": 2})
    saved = post(server, "/prompt_cache/save", {"prompt": prompt, "filename": "story.bin"})
    assert saved.status_code == 200, saved.text
    post(server, "/reset_prefix_cache")
    restored = post(server, "/prompt_cache/restore", {"filename": "story.bin"})
    assert restored.json()["n_restored"] == saved.json()["n_saved"] > 0
    hit = post(server, "/completion", {"prompt": prompt, "n_predict": 2}).json()
    assert hit["timings"]["cache_n"] == saved.json()["n_saved"]


def rewritten(data: bytes, **changes: Any) -> bytes:
    """A saved file with header fields changed (and its checksum made right again)."""
    import hashlib
    import struct

    size = struct.unpack("<I", data[8:12])[0]
    header = json.loads(data[12 : 12 + size])
    header.update(changes)
    raw = json.dumps(header).encode()
    payload = data[12 + size : -32]
    digest = hashlib.sha256(raw + payload).digest()
    return data[:8] + struct.pack("<I", len(raw)) + raw + payload + digest


def test_files_that_do_not_fit_and_bad_names_are_refused(server: RemoteServer) -> None:
    prompt = "A long story about files " * 20
    post(server, "/completion", {"prompt": prompt, "n_predict": 1})
    assert post(server, "/prompt_cache/save", {"prompt": prompt, "filename": "ok.bin"}).is_success
    good = (save_dir(server) / "ok.bin").read_bytes()
    cases = {
        "other-model.bin": rewritten(good, fingerprint="0" * 64, model="another/model"),
        "other-block.bin": rewritten(good, block_size=32),
        "truncated.bin": good[: len(good) // 2],
        "corrupt.bin": good[:-40] + bytes(8) + good[-32:],
        "garbage.bin": b"not a prompt cache",
    }
    for name, data in cases.items():
        (save_dir(server) / name).write_bytes(data)
    post(server, "/reset_prefix_cache")
    for name in cases:
        r = post(server, "/prompt_cache/restore", {"filename": name})
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == "filename"
    assert (
        "fingerprint" in post(server, "/prompt_cache/restore", {"filename": "other-model.bin"}).text
    )
    assert (
        "block_size" in post(server, "/prompt_cache/restore", {"filename": "other-block.bin"}).text
    )
    # nothing restored from them: the prompt is still cold
    assert (
        post(server, "/completion", {"prompt": prompt, "n_predict": 1}).json()["timings"]["cache_n"]
        == 0
    )
    for bad in ("../../x", "/etc/passwd", "a/b.bin", ".hidden", "", "x" * 300):
        for path in ("/prompt_cache/restore", "/slots/0?action=restore"):
            r = post(server, path, {"filename": bad})
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "filename"
    assert not (save_dir(server).parent / "x").exists()


def test_v1_completions_suffix_is_a_fim_prompt(server: RemoteServer, tokenizer: Any) -> None:
    """OpenAI's `suffix` (through the real client): the prompt and the suffix as a FIM prompt,
    `[FIM_PRE] prompt [FIM_SUF] suffix [FIM_MID]`, nothing cut, no extra context."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prefix,
        suffix=suffix,
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True},
    )

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)

    special = tokenizer.convert_tokens_to_ids
    expected = [
        special("<|fim_prefix|>"),
        *ids(prefix),
        special("<|fim_suffix|>"),
        *ids(suffix),
        special("<|fim_middle|>"),
    ]
    assert out.usage.prompt_tokens == len(expected)
    same = greedy_completion(server, expected, 6, [])
    assert out.choices[0].text == same["text"]
    refused = post(server, "/v1/completions", {"prompt": prefix, "suffix": "x", "echo": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"


def test_completion_grammar_constrains_sampled_output(server: RemoteServer) -> None:
    """llama.cpp's `grammar` (GBNF) on /completion, sampled with seeds at T = 0.8."""
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    for seed in range(5):
        body = {"prompt": "Answer:", "grammar": grammar, "temperature": 0.8, "seed": seed}
        r = post(server, "/completion", {**body, "n_predict": 8})
        assert r.status_code == 200, r.text
        content = r.json()["content"]
        assert content in ("yes", "no") or (
            content.startswith("maybe ") and content[-1].isdigit() and len(content) == 7
        ), content
