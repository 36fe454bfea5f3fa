"""The offline `LLM` as a user meets it: prompt forms, chat, n, bad input, the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from treadle import LLM, SamplingParams
from treadle.model.arch import UnsupportedModelError
from treadle.model.loader import ModelLoadError
from treadle.sampling_params import StructuredOutputsParams
from treadle.validation import InvalidRequest
from treadle.wire.engine import EngineCoreRequest, FinishReason

TREADLE = str(Path(sys.executable).parent / "treadle")  # the console script a user runs


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> Iterator[LLM]:  # type: ignore[no-untyped-def]
    engine = LLM(str(tiny_model_factory("llama")), dtype="float32", max_model_len=64)
    yield engine
    engine.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_llm_runs_its_engine_core_in_one_child_process(llm: LLM) -> None:
    import psutil

    children = psutil.Process().children(recursive=True)
    engines = [p for p in children if p.cmdline() and p.cmdline()[0] == "treadle::EngineCore_DP0"]
    assert len(engines) == 1


def test_prompt_forms_give_the_same_tokens(llm: LLM) -> None:
    ids = llm.get_tokenizer()("Hello world").input_ids
    by_text = llm.generate("Hello world", GREEDY, use_tqdm=False)[0]
    by_ids = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert by_text.prompt_token_ids == ids
    assert by_text.prompt == "Hello world"
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert len(by_text.outputs[0].token_ids) == 8
    assert by_text.outputs[0].finish_reason == "length"


def test_outputs_keep_prompt_order_and_n_samples(llm: LLM) -> None:
    prompts = ["a", "b c d e f g", "h i"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate("x", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per sample
    again = llm.generate("x", params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_logprobs_and_stop_strings(llm: LLM) -> None:
    out = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False
    )[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    for token, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert token in entry and len(entry) <= 3
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert max(lp.logprob for lp in entry.values()) == entry[token].logprob
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
    assert comp.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs, strict=True))
    )

    full = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    text = full.outputs[0].text
    stop = text[3:5]
    assert stop.strip()
    cut = llm.generate(
        "Hello",
        SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop


def test_chat_applies_the_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)[0]
    assert "<|im_start|>user\nHi<|im_end|>" in (out.prompt or "")
    assert len(out.outputs[0].token_ids) == 8


def test_chat_takes_text_parts_and_refuses_other_content(llm: LLM) -> None:
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    by_parts = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    by_text = llm.chat([{"role": "user", "content": "Hi\nthere"}], GREEDY, use_tqdm=False)[0]
    assert by_parts.prompt_token_ids == by_text.prompt_token_ids
    image = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
    with pytest.raises(InvalidRequest, match="text only") as info:
        llm.chat([{"role": "user", "content": [image]}], GREEDY, use_tqdm=False)
    assert info.value.param == "messages"


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    params = GREEDY.clone(truncate_prompt_tokens=3)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == [7, 8, 9]
    plain = llm.generate({"prompt_token_ids": [7, 8, 9]}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    # a prompt longer than the context (64) runs once cut to fit
    long = GREEDY.clone(truncate_prompt_tokens=10)
    out = llm.generate({"prompt_token_ids": list(range(5, 105))}, long, use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(95, 105)) and len(out.outputs[0].token_ids) == 8


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("constraint", "holds"),
    [
        (StructuredOutputsParams(choice=["red", "blue"]), lambda t: t in ("red", "blue")),
        (StructuredOutputsParams(regex="[0-9]{3}"), lambda t: re.fullmatch("[0-9]{3}", t)),
        (
            StructuredOutputsParams(json=SCHEMA),
            lambda t: (
                json.loads(t)["answer"] in ("yes", "no")
                and isinstance(json.loads(t)["sure"], bool)
                and len(json.loads(t)) == 2
            ),
        ),
    ],
    ids=["choice", "regex", "json"],
)
def test_structured_outputs_hold_offline_on_a_random_model(
    llm: LLM, constraint: StructuredOutputsParams, holds: Callable[[str], bool]
) -> None:
    """A random model left alone writes noise; the constraint alone makes its output valid."""
    params = SamplingParams(
        temperature=0.8, max_tokens=40, n=3, seed=1, structured_outputs=constraint
    )
    out = llm.generate(["Answer:", "x"], params, use_tqdm=False)
    for completion in [c for o in out for c in o.outputs]:
        assert completion.finish_reason == "stop", completion.text
        assert holds(completion.text), completion.text


def test_a_grammar_that_does_not_compile_is_refused_before_anything_runs(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(a"))
    with pytest.raises(InvalidRequest, match="cannot be compiled") as info:
        llm.generate("x", bad, use_tqdm=False)
    assert info.value.param == "structured_outputs.regex"
    assert llm.generate("x", GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_prompt_logprobs_equal_the_logprobs_of_generating_that_token(llm: LLM) -> None:
    """Scored in a prefill, a prompt token's logprob is the one a decode step gave it."""
    first = llm.generate(
        {"prompt_token_ids": [5, 6, 7]},
        SamplingParams(temperature=0, max_tokens=1, logprobs=0),
        use_tqdm=False,
    )[0].outputs[0]
    token = first.token_ids[0]
    assert first.logprobs is not None
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7, token, 9]},
        SamplingParams(max_tokens=1, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    rows = out.prompt_logprobs
    assert rows is not None and len(rows) == 5 and rows[0] is None
    for t, row in zip([6, 7, token, 9], rows[1:], strict=True):
        assert row is not None and t in row and len(row) <= 3
        assert {1, 2} <= {lp.rank for lp in row.values()}  # the top 2 beside the prompt token
    assert rows[3] is not None
    assert rows[3][token].logprob == pytest.approx(first.logprobs[0][token].logprob, abs=1e-4)
    assert rows[3][token].rank == 1  # greedy chose it


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", GREEDY, "empty"),
        ({"prompt_token_ids": [5] * 64}, GREEDY, "maximum context length is 64"),
    ],
)
def test_bad_prompts_raise_and_the_engine_keeps_serving(
    llm: LLM, prompt: object, params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)  # type: ignore[list-item]
    stats = llm.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
    assert len(llm.generate("still fine", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_params_the_model_cannot_take_raise_before_anything_runs(llm: LLM) -> None:
    cases = [
        (SamplingParams(logprobs=21), "logprobs", "see --max-logprobs"),
        (SamplingParams(stop_token_ids=[10**6], min_tokens=2), "stop_token_ids", "49152"),
    ]
    for params, field, message in cases:
        with pytest.raises(InvalidRequest, match=message) as info:
            llm.generate(["fine", "prompt"], params, use_tqdm=False)
        assert info.value.param == field
    stats = llm.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)


def test_each_prompt_is_checked_once_in_this_process(
    llm: LLM, check_request_calls: list[Sequence[int]]
) -> None:
    """`InputProcessor.prepare` checks a prompt once for all its samples; the engine core's own
    check runs in its process."""
    params = SamplingParams(n=3, seed=1, max_tokens=2, truncate_prompt_tokens=2)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, "b"], params, use_tqdm=False)
    assert [len(out.outputs) for out in outs] == [3, 3]
    assert len(check_request_calls) == 2 and check_request_calls[0] == [6, 7]
    list(llm.stream("c", GREEDY))
    assert len(check_request_calls) == 3


def test_a_bad_request_sent_straight_to_the_engine_process_is_refused_alone(llm: LLM) -> None:
    """Over the real sockets, past every front-end check: the engine core answers that
    request with an error and keeps serving (these used to kill it)."""
    expected = llm.generate("still fine", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for i, (field, value) in enumerate(
        [("logprobs", 100_000), ("stop_token_ids", [10**6]), ("top_k", 10**18)]
    ):
        params = SamplingParams(max_tokens=4, min_tokens=2, temperature=1.0)
        setattr(params, field, value)  # as a client that skips SamplingParams' checks
        llm.engine.add_request(EngineCoreRequest(f"bad{i}", [1, 2, 3], params, eos_token_id=2))
        out = llm.engine.get_output().outputs[0]
        if field == "top_k":  # a valid top_k (only larger than the vocabulary) runs
            while not out.finished:
                out = llm.engine.get_output().outputs[0]
            assert out.finish_reason is FinishReason.LENGTH
            continue
        assert (out.request_id, out.finish_reason) == (f"bad{i}", FinishReason.ERROR)
        assert field in str(out.stop_reason)
    assert llm.generate("still fine", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_unknown_model_path() -> None:
    with pytest.raises(FileNotFoundError, match="never downloads"):
        LLM("/no/such/model")


def test_truncated_and_corrupt_gguf(tmp_path: Path, default_model_path: str) -> None:
    data = Path(default_model_path).read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="truncated"):
        LLM(str(truncated))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match="corrupt"):
        LLM(str(corrupt))


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_cli_generate_streams_the_default_model() -> None:
    env = dict(os.environ, TREADLE_LOGGING_LEVEL="INFO")  # (the log goes to stderr)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "treadle.cli.main",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    # A normal exit says so (issue 42 item 5): its engine core is asked to stop, not signalled.
    assert "Received SIG" not in result.stderr, result.stderr
    assert "Engine core stopped" in result.stderr, result.stderr


def test_cli_reports_a_bad_model_path() -> None:
    result = subprocess.run(
        [TREADLE, "generate", "hi", "--model", "/no/such/model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "not found" in result.stderr


def test_engine_ready_timeout_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, tiny_model_factory
) -> None:  # type: ignore[no-untyped-def]
    import psutil

    monkeypatch.setenv("TREADLE_ENGINE_READY_TIMEOUT_S", "0")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(TimeoutError, match="TREADLE_ENGINE_READY_TIMEOUT_S"):
        LLM(str(tiny_model_factory("llama")))
    left = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.cmdline() and p.cmdline()[0].startswith("treadle::")
    ]
    assert left == []


def test_a_failing_utility_call_is_an_error_reply_not_a_crash(llm: LLM) -> None:
    with pytest.raises(RuntimeError, match="no utility method"):
        llm.engine.call_utility("no_such_method")
    with pytest.raises(RuntimeError, match="no utility method"):
        llm.engine.call_utility("_private")
    assert len(llm.generate("still fine", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_a_script_that_never_shuts_down_still_exits(tmp_path: Path, tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    """multiprocessing joins its children at exit while the engine waits for its parent to go:
    an `LLM` held in a global must not hang the interpreter's exit."""
    script = tmp_path / "script.py"
    script.write_text(
        "from treadle import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model_factory('llama'))!r})\n"
        "print(len(llm.generate('hi', SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids))\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3"
