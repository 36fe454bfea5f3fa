"""IncrementalDetokenizer on the default model's byte-level BPE tokenizer: UTF-8 safety, stop
strings, streaming hold-back, and deltas that add up to the final text."""

from typing import Any

import pytest

from treadle.config import resolve_model
from treadle.frontend.detokenizer import IncrementalDetokenizer
from treadle.tokenizer import load_tokenizer

MULTIBYTE = "naïve café — 世界你好 🎉👍🏽 👨\u200d👩\u200d👧 end"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(resolve_model(None))


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


class Reader:
    """What a streaming client receives: the new part of `visible_text` after each update."""

    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok, self.sent = detok, 0

    def delta(self, finished: bool) -> str:
        text = self.detok.visible_text(finished)
        out = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return out


def stream(
    tok: Any, text: str, stop: list[str] | None = None, include_stop: bool = False
) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    """Feed `text` one token at a time, as the engine would, until a stop string; returns the
    deltas (the last one given with finished=True), the detokenizer and the stop string."""
    detok = IncrementalDetokenizer(tok, encode(tok, "Prompt:"), True, stop, include_stop)
    reader = Reader(detok)
    deltas, found = [], None
    for token in encode(tok, text):
        found = detok.update([token])
        if found is not None:
            break
        deltas.append(reader.delta(finished=False))
    deltas.append(reader.delta(finished=True))
    return deltas, detok, found


def test_multibyte_characters_split_over_tokens_are_never_half_emitted(tok):
    ids = encode(tok, MULTIBYTE)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the test needs split characters
    deltas, detok, _ = stream(tok, MULTIBYTE)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == MULTIBYTE


def test_a_partial_character_waits_for_its_last_byte(tok):
    ids = encode(tok, " 🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, encode(tok, "hi"))
    reader = Reader(detok)
    for token in ids[:-1]:
        detok.update([token])
        assert reader.delta(finished=False) == "" and detok.output_text == ""
    detok.update(ids[-1:])
    assert reader.delta(finished=False) == " 🎉"


def test_prompt_context_keeps_the_leading_space(tok):
    detok = IncrementalDetokenizer(tok, encode(tok, "Say hello"))
    detok.update(encode(tok, " world"))
    assert detok.output_text == " world"


def test_many_tokens_at_once_equal_one_at_a_time(tok):
    detok = IncrementalDetokenizer(tok, encode(tok, "Prompt:"))
    detok.update(encode(tok, MULTIBYTE))
    assert detok.output_text == MULTIBYTE == "".join(stream(tok, MULTIBYTE)[0])


def test_special_tokens_are_skipped_unless_asked(tok):
    eos = tok.eos_token_id
    ids = [*encode(tok, "done"), eos]
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    skipped.update(ids)
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    kept.update(ids)
    assert skipped.output_text == "done"
    assert kept.output_text == "done" + tok.decode([eos])


@pytest.mark.parametrize(
    ("include", "expected"), [(False, "Hello"), (True, "Hello\n\n")], ids=["excluded", "included"]
)
def test_stop_string_ends_the_text(tok, include, expected):
    deltas, detok, found = stream(tok, "Hello\n\nfoo bar", ["\n\n"], include)
    assert found == "\n\n"
    assert detok.output_text == expected == "".join(deltas)


def test_stop_string_spanning_tokens_is_held_back_while_streaming(tok):
    text = "The answer is 42. THE END and more"
    stop = ["THE END"]
    assert not any(stop[0] in tok.decode([i]) for i in encode(tok, text))
    deltas, detok, found = stream(tok, text, stop)
    assert found == "THE END" and detok.output_text == "The answer is 42. "
    emitted = ""
    for d in deltas:
        emitted += d
        assert "THE" not in emitted  # no partial stop string ever reaches the client
    assert emitted == detok.output_text


def test_without_stop_strings_nothing_is_held_back(tok):
    detok = IncrementalDetokenizer(tok, [])
    reader = Reader(detok)
    detok.update(encode(tok, "abc def"))
    assert reader.delta(finished=False) == "abc def"
    assert reader.delta(finished=False) == "" and reader.delta(finished=True) == ""


def test_hold_back_is_released_when_finished(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    reader = Reader(detok)
    detok.update(encode(tok, "all fine ST"))
    assert reader.delta(finished=False) == "all fine"
    assert reader.delta(finished=True) == " ST"


def test_earliest_stop_string_wins_over_list_order(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["world", "hello"])
    assert detok.update(encode(tok, "say hello world")) == "hello"
    assert detok.output_text == "say "


def test_stop_string_at_a_multibyte_character(tok):
    deltas, detok, found = stream(tok, "答案是世界和平", ["世界"])
    assert found == "世界" and detok.output_text == "答案是" == "".join(deltas)


@pytest.mark.parametrize(
    "stop",
    [["o w"], ["\n"], ["🎉"], ["zzz"], ["ab", "abc"], ["é", "—"], ["end"]],
)
@pytest.mark.parametrize("include", [False, True])
def test_deltas_add_up_to_the_text_cut_at_the_first_stop(tok, stop, include):
    text = "hello world\n" + MULTIBYTE + " abc"
    deltas, detok, found = stream(tok, text, stop, include)
    hits = [(text.find(s), s) for s in stop if s in text]
    expected, first = text, None
    if hits:
        at, first = min(hits, key=lambda h: h[0])
        expected = text[: at + len(first) if include else at]
    assert found == first
    assert detok.output_text == expected == "".join(deltas)
    assert all("\ufffd" not in d for d in deltas)
