"""`treadle bench serve`'s datasets: random token ids and a local ShareGPT file, sampled and
filtered as vLLM's benchmark does (token counts here: one per word)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.cli.bench_datasets import (
    DatasetError,
    SampleRequest,
    load_sharegpt,
    random_lengths,
    random_prompts,
    sample_random,
    sample_sharegpt,
)


def _words(texts: list[str]) -> list[int]:
    return [len(t.split()) for t in texts]


def _turn(role: str, words: int) -> dict[str, str]:
    return {"from": role, "value": " ".join([role] * words)}


def _write(tmp_path: Path, data: object, name: str = "sharegpt.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_random_prompts_and_lengths_are_seeded() -> None:
    prompts = random_prompts(3, 7, seed=1)
    assert prompts == random_prompts(3, 7, seed=1) != random_prompts(3, 7, seed=2)
    assert all(len(p) == 7 and all(1000 <= t < 20000 for t in p) for p in prompts)
    assert random_lengths(5, 64, 0.0, seed=0) == [64] * 5
    lens = random_lengths(500, 64, 0.5, seed=0)
    assert min(lens) >= 32 and max(lens) <= 96 and len(set(lens)) > 10
    with pytest.raises(ValueError, match="range-ratio"):
        random_lengths(1, 64, 1.5, seed=0)
    samples = sample_random(4, 16, 8, 0.25, seed=3)
    assert [len(s.prompt) for s in samples] == [s.prompt_len for s in samples]
    assert all(12 <= s.prompt_len <= 20 and 6 <= s.expected_output_len <= 10 for s in samples)


def test_sharegpt_takes_the_first_human_turn_and_its_answer(tmp_path: Path) -> None:
    data = [
        {"id": "a", "conversations": [_turn("human", 5), _turn("gpt", 6), _turn("human", 9)]},
        {"conversations": [{"from": "system", "value": "be brief"}, _turn("human", 7)]},
        {"conversations": [_turn("gpt", 3), _turn("human", 8), _turn("gpt", 4)]},
        {"conversations": [_turn("human", 4)]},  # no answer: skipped
        {"no": "conversations"},
        "not even an object",
    ]
    pairs = load_sharegpt(_write(tmp_path, data))
    assert [(len(p.split()), len(a.split())) for p, a in pairs] == [(5, 6), (8, 4)]


def test_sharegpt_sampling_filters_like_vllm_and_repeats_to_fill() -> None:
    # (prompt words, answer words): vLLM keeps 4 <= prompt <= 1024, answer >= 4, sum <= 2048.
    sizes = [(10, 20), (3, 20), (10, 3), (1025, 5), (1000, 1049), (1000, 1048), (4, 4)]
    pairs = [(" ".join(["p"] * n), " ".join(["a"] * m)) for n, m in sizes]
    samples = sample_sharegpt(pairs, 3, seed=0, count_tokens=_words)
    kept = {(10, 20), (1000, 1048), (4, 4)}
    assert {(s.prompt_len, s.expected_output_len) for s in samples} == kept
    assert sample_sharegpt(pairs, 3, seed=0, count_tokens=_words) == samples  # seeded
    assert all(isinstance(s.prompt, str) for s in samples)

    # More requests than valid pairs: the valid ones again, drawn with the seed.
    many = sample_sharegpt(pairs, 8, seed=0, count_tokens=_words)
    assert len(many) == 8 and many[:3] == samples
    assert {(s.prompt_len, s.expected_output_len) for s in many} == kept

    # --sharegpt-output-len: every max_tokens, and a short answer is no reason to skip.
    fixed = sample_sharegpt(pairs, 5, seed=0, count_tokens=_words, output_len=2)
    assert {s.expected_output_len for s in fixed} == {2}
    assert {s.prompt_len for s in fixed} == {10, 1000, 4}


def test_sharegpt_counts_tokens_in_batches_only_as_needed() -> None:
    calls: list[int] = []

    def counting(texts: list[str]) -> list[int]:
        calls.append(len(texts))
        return _words(texts)

    pairs = [("p " * 8, "a " * 8)] * 1000
    assert len(sample_sharegpt(pairs, 5, seed=0, count_tokens=counting)) == 5
    assert calls == [32, 32]  # one batch of prompts and one of answers, not 1000 of each
    calls.clear()
    sample_sharegpt(pairs, 5, seed=0, count_tokens=counting, output_len=16)
    assert calls == [32]  # answers need no counting


def test_sharegpt_file_errors_are_one_clear_line(tmp_path: Path) -> None:
    cases = [
        (str(tmp_path / "missing.json"), "no such file"),
        (str(tmp_path), "cannot read it"),
        (_write(tmp_path, {"conversations": []}, "object.json"), "expected a JSON list"),
        (_write(tmp_path, [{"conversations": [_turn("gpt", 4)]}]), 'no entry of 1 has a "human"'),
    ]
    bad = tmp_path / "bad.json"
    bad.write_text('[{"conversations": [}]')
    cases.append((str(bad), "not valid JSON"))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe[]")
    cases.append((str(binary), "not UTF-8"))
    for path, message in cases:
        with pytest.raises(DatasetError, match=message) as info:
            load_sharegpt(path)
        assert str(info.value).startswith(f"--dataset-path {path}: ")
        assert "\n" not in str(info.value)
    with pytest.raises(DatasetError, match="none of 1 conversations"):
        sample_sharegpt([("hi", "hello there you")], 2, seed=0, count_tokens=_words)


def test_sample_request_is_plain_data() -> None:
    assert SampleRequest("hi", 1, 2) == SampleRequest("hi", 1, 2)
