"""llama.cpp's early stops and response shaping in `/completion` and `/infill`, on outputs made
by hand: `n_indent`, `t_max_predict_ms`, `response_fields`, the stop types."""

from __future__ import annotations

import time

from treadle.entrypoints.openai.llamacpp_completion import LlamaCompletionRequest
from treadle.entrypoints.openai.llamacpp_progress import CompletionJob as _Job  # noqa: N814
from treadle.outputs import CompletionOutput, RequestOutput


def job(**fields: object) -> _Job:
    return _Job(LlamaCompletionRequest(**fields), [1, 2, 3], False, "m", time.monotonic())


def output(text: str, finish: str | None = None, stop: int | str | None = None) -> RequestOutput:
    comp = CompletionOutput(0, text, list(range(len(text))), None, None, finish, stop)
    return RequestOutput("r", None, [1, 2, 3], [comp], finished=finish is not None)


def feed(j: _Job, texts: list[str]) -> int:
    """Outputs with these texts (one token each) until the job says it is over; how many."""
    for n, text in enumerate(texts, 1):
        if j.take(output(text)):
            return n
    return len(texts)


def test_n_indent_cuts_the_first_line_indented_less_and_stops() -> None:
    j = job(n_indent=4)
    steps = [
        "    a = 1",
        "    a = 1\n",
        "    a = 1\n    b",
        "    a = 1\n    b\n",
        "    a = 1\n    b\nc",
    ]
    assert feed(j, steps) == 5
    assert j.text == "    a = 1\n    b\n" and j.stop_type == "limit"
    assert j.final(streamed=False)["content"] == "    a = 1\n    b\n"


def test_n_indent_keeps_lines_indented_enough() -> None:
    j = job(n_indent=2)
    steps = ["  x", "  x\n", "  x\n   y", "  x\n   y\n", "  x\n   y\n  z"]
    assert feed(j, steps) == 5 and j.finished is None


def test_a_stream_holds_back_an_indentation_until_its_line_shows_itself() -> None:
    j = job(n_indent=4)
    j.take(output("    a\n  "))
    assert j.partial()["content"] == "    a\n"  # "  " may be cut
    j.take(output("    a\n      b"))
    assert j.partial()["content"] == "      b"


def test_t_max_predict_ms_stops_only_after_a_new_line() -> None:
    j = job(t_max_predict_ms=1)
    assert not j.take(output("a"))
    time.sleep(0.01)
    assert not j.take(output("ab"))  # past the time, but no new line yet
    assert not j.take(output("ab\n"))  # the new line: the next token stops it
    assert j.take(output("ab\nc"))
    assert j.stop_type == "limit"


def test_stop_types_and_response_fields() -> None:
    j = job()
    j.take(output("hi", finish="stop", stop="END"))
    assert (j.stop_type, j.stopping_word) == ("word", "END")
    j = job()
    j.take(output("hi", finish="stop", stop=None))
    assert j.stop_type == "eos"
    j = job(response_fields=["content", "timings/predicted_n", "nope/x"])
    j.take(output("hi", finish="length"))
    assert j.final(streamed=False) == {"content": "hi", "timings/predicted_n": 2}
    assert j.stop_type == "limit"


def test_fim_extra_context_gives_way_so_the_prompt_fits() -> None:
    """llama.vim's warm-up (n_predict 0) with every part at its largest: llama.cpp's cuts add
    up to a little past the context; the extra context gives up its first tokens instead."""
    from treadle.entrypoints.openai.fim import FimBudget, FimTokens, fim_prompt

    class Tokenizer:
        bos_token_id = None

        def __call__(self, text: str, **_: object) -> object:
            class Encoded:
                input_ids = [7] * len(text)

            return Encoded()

    fim = FimTokens(1, 2, 3, 4, 5)
    budget = FimBudget(n_batch=64, n_ctx=128, n_predict=0)
    ids = fim_prompt(Tokenizer(), fim, [9] * 500, [8] * 500, [("f", "x" * 500)], [], budget)
    assert len(ids) == 128 - 1  # room for the one token a prompt alone runs
    assert ids[-1] == 3 and ids.count(1) == 1 and ids.count(2) == 1
