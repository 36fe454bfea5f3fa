"""Beam search as vLLM offers it (`LLM.beam_search`, `use_beam_search` on /v1/completions),
exact against transformers' `generate(num_beams=W, do_sample=False, length_penalty=...,
early_stopping=...)` on the same tiny random Llama. Its tokenizer's EOS is a token the beams
often reach, so hypotheses finish at many steps (the paths where the two could differ)."""

from __future__ import annotations

import collections
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from serve_helpers import RemoteServer
from treadle import LLM
from treadle.sampling_params import BeamSearchParams

PROMPTS = ["The quick brown fox", "Hello, my name is", "1 2 3 4 5", "once upon a time"]
CASES = [  # beam width, max_tokens, length_penalty, early_stopping
    (2, 8, 1.0, False),
    (4, 10, 0.5, True),
    (3, 10, 2.0, "never"),
    (2, 9, -1.0, False),
    (3, 10, 0.0, True),
    (4, 10, -2.0, True),  # short hypotheses win: EOS endings come back
]


@pytest.fixture(scope="module")
def model(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:  # type: ignore[no-untyped-def]
    """A copy of the tiny Llama whose tokenizer's EOS is the token most often second or third
    (not first) where its beams run: a likely end, but not at once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("beam") / "m"
    shutil.copytree(tiny_model_factory("llama"), path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    counts: collections.Counter[int] = collections.Counter()
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt).input_ids
            out = hf.generate(
                torch.tensor([ids]), num_beams=4, num_return_sequences=4, do_sample=False,
                max_new_tokens=8, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            top = hf(out).logits[:, len(ids) - 1 :].topk(3, dim=-1).indices
            counts.update(t for row in top.reshape(-1, 3).tolist() for t in row[1:])
    eos = counts.most_common(1)[0][0]
    tok.eos_token = tok.convert_ids_to_tokens(eos)
    tok.save_pretrained(path)
    return path, eos


@pytest.fixture(scope="module")
def hf(model: tuple[Path, int]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model[0], dtype=torch.float32)


def reference(hf: Any, ids: list[int], eos: int, case: tuple[Any, ...]) -> list[Any]:
    """transformers' beams: (generated ids with the EOS, score), best first."""
    width, max_tokens, length_penalty, early_stopping = case
    out = hf.generate(
        torch.tensor([ids]), num_beams=width, num_return_sequences=width, do_sample=False,
        max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
        eos_token_id=eos, pad_token_id=eos, output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        gen = seq[len(ids) :]
        beams.append((gen[: gen.index(eos) + 1] if eos in gen else gen, score))
    return beams


@pytest.fixture(scope="module")
def llm(model: tuple[Path, int]) -> Iterator[LLM]:
    engine = LLM(str(model[0]), dtype="float32")
    yield engine
    engine.shutdown()


def test_offline_beam_search_is_transformers_beam_search(
    llm: LLM, model: tuple[Path, int], hf: Any
) -> None:
    reasons: collections.Counter[str | None] = collections.Counter()
    for case in CASES:
        _check_case(llm, hf, model[1], case, reasons)
    # Both ways of ending were taken, the EOS in many searches.
    assert reasons["stop"] >= 4 and reasons["length"] >= 4, reasons


def _check_case(
    llm: LLM, hf: Any, eos: int, case: tuple[Any, ...], reasons: collections.Counter[Any]
) -> None:
    width, max_tokens, length_penalty, early_stopping = case
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    outputs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = llm.tokenizer(prompt).input_ids
        want = reference(hf, ids, eos, case)
        got = [(seq.tokens[len(ids) :], seq.score) for seq in out.sequences]
        assert [g for g, _ in got] == [w for w, _ in want], (prompt, got, want)
        assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-5, abs=1e-4)
        for seq in out.sequences:
            assert seq.tokens[: len(ids)] == ids and seq.text == llm.tokenizer.decode(seq.tokens)
            assert (seq.finish_reason == "stop") == (seq.tokens[-1] == eos)
            reasons[seq.finish_reason] += 1


def test_offline_beam_search_refuses_what_it_cannot_honour(llm: LLM) -> None:
    with pytest.raises(ValueError, match="temperature=0.7 cannot be honoured"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="early_stopping must be true, false or"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="asks 22 logprobs a step; max_logprobs is 20"):
        llm.beam_search("Hi", BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="exceed max_model_len 512"):
        llm.beam_search("Hi", BeamSearchParams(beam_width=2, max_tokens=600))


@pytest.fixture(scope="module")
def server(
    model: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    srv = RemoteServer(
        [str(model[0]), "--dtype", "float32", "--served-model-name", "m"],
        tmp_path_factory.mktemp("beam-server"),
    )
    yield srv
    srv.stop()


def _complete(server: RemoteServer, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": "m", **body}, timeout=120)


def test_served_beam_search_is_transformers_beam_search(
    server: RemoteServer, model: tuple[Path, int], hf: Any
) -> None:
    eos = model[1]
    case = (3, 10, 0.5, True)
    resp = _complete(
        server,
        prompt=PROMPTS[:2],
        n=3,
        max_tokens=10,
        temperature=0,
        use_beam_search=True,
        length_penalty=0.5,
        early_stopping=True,
        return_token_ids=True,
        skip_special_tokens=False,
    )
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for i in range(2):
        ids = choices[3 * i]["prompt_token_ids"]
        want = reference(hf, ids, eos, case)
        mine = choices[3 * i : 3 * i + 3]
        assert [c["token_ids"] for c in mine] == [w for w, _ in want]
        for c in mine:
            assert c["finish_reason"] == ("stop" if c["token_ids"][-1] == eos else "length")
    usage = resp.json()["usage"]
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)


def test_vllms_own_beam_search_completion_test(server: RemoteServer) -> None:
    """vLLM's tests/entrypoints/openai/test_completion.py (beam search, n=2, two prompts)."""
    resp = _complete(
        server,
        prompt=["Hello, my name is", "Hello, my name is"],
        n=2,
        max_tokens=5,
        temperature=0.0,
        use_beam_search=True,
    )
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 4
    assert choices[0]["text"] != choices[1]["text"], "beam search should be different"
    assert choices[0]["text"] == choices[2]["text"]
    assert choices[1]["text"] == choices[3]["text"]


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"logprobs": 2}, "logprobs", "cannot be honoured with use_beam_search"),
        ({"stream": True}, "stream", "cannot be honoured with use_beam_search"),
        ({"top_p": 0.5}, "top_p", "cannot be honoured with use_beam_search"),
        ({"stop": ["x"]}, "stop", "cannot be honoured with use_beam_search"),
        ({"echo": True}, "echo", "cannot be honoured with use_beam_search"),
        ({"best_of": 3}, "best_of", "cannot be honoured with use_beam_search"),
        ({"temperature": 0.8}, "temperature", "beam search ranks beams by the model's"),
        ({"early_stopping": "sometimes"}, "early_stopping", 'must be true, false or "never"'),
        ({"length_penalty": "long"}, "length_penalty", "must be a number"),
        ({"n": 11}, "n", "asks 22 logprobs a step; this server allows 20"),
        ({"max_tokens": 0}, "max_tokens", "must be at least 1 with use_beam_search"),
    ],
)
def test_fields_beam_search_cannot_honour_are_a_400(
    server: RemoteServer, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {"prompt": "Hi", "max_tokens": 4, "use_beam_search": True, **extra}
    resp = _complete(server, **body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_chat_says_where_beam_search_is(server: RemoteServer) -> None:
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "Hi"}],
            "use_beam_search": True,
        },
        timeout=60,
    )
    assert resp.status_code == 400 and "served on /v1/completions" in resp.text, resp.text
