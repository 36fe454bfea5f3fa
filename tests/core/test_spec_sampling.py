"""Speculative decoding at temperature > 0 (issue 27): on a tiny random model, the first four
tokens of many sampled requests have the same distribution with n-gram speculation as without
(two-sample chi-square), and the same test finds the difference when a wrong acceptance rule
is put in (so it can fail). Seeded requests repeat run to run."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from tests.conftest import build_tiny_model

from treadle import LLM, SamplingParams
from treadle.core.spec_decode import StepTimes
from treadle.worker import sampler as sampler_module

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
N = 600  # requests per sample


class FlatTimes(StepTimes):
    def record(self, rows: int, seconds: float) -> None:
        pass

    def table(self, first: int, last: int) -> list[float]:
        return [1.0] * (last - first + 1)


def two_sample_p(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> float:
    """Chi-square test of homogeneity of two samples of categories (those expected under 5
    times in either sample pooled into one)."""
    na, nb = sum(a.values()), sum(b.values())
    cats = sorted(set(a) | set(b))
    small = [c for c in cats if (a[c] + b[c]) * min(na, nb) / (na + nb) < 5]
    table = [[a[c], b[c]] for c in cats if c not in small]
    if small:
        table.append([sum(a[c] for c in small), sum(b[c] for c in small)])
    t = torch.tensor(table, dtype=torch.float64)
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = ((t - expected) ** 2 / expected).sum()
    df = t.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """A tiny model (vocabulary 512, so that sampling's sort is cheap), plain and with n-gram
    speculation, and a prompt whose n-gram proposals the model often accepts: a start, its
    greedy continuation, the start again and the continuation's first tokens."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-spec"), "llama", vocab_size=512)
    os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"
    plain = spec = None
    try:
        plain = LLM(str(path), dtype="float32", max_model_len=256)
        spec = LLM(str(path), dtype="float32", max_model_len=256, speculative_config=NGRAM)
        # every step costs the same, whatever its rows: the plan verifies every proposal
        spec.engine_core.scheduler.step_times = FlatTimes()
        start = list(range(100, 110))
        greedy = SamplingParams(temperature=0.0, max_tokens=10)
        out = plain.generate([{"prompt_token_ids": start}], greedy, use_tqdm=False)
        cont = list(out[0].outputs[0].token_ids)
        yield {"plain": plain, "spec": spec, "prompt": start + cont + start + cont[:3]}
    finally:
        del os.environ["TREADLE_ENABLE_MULTIPROCESSING"]
        for llm in (plain, spec):
            if llm is not None:
                llm.shutdown()


def first_tokens(llm: LLM, prompt: list[int], seeds: range) -> Counter[tuple[int, ...]]:
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=4, seed=s) for s in seeds]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(seeds), params, use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


@pytest.fixture(scope="module")
def plain_sample(engines: dict[str, object]) -> Counter[tuple[int, ...]]:
    return first_tokens(engines["plain"], engines["prompt"], range(N))  # type: ignore[arg-type]


def test_sampling_with_speculation_has_plain_sampling_s_distribution(
    engines: dict[str, object], plain_sample: Counter[tuple[int, ...]]
) -> None:
    spec: LLM = engines["spec"]  # type: ignore[assignment]
    s = spec.engine_core.scheduler
    before = (s.spec_draft_tokens, s.spec_accepted_tokens)
    # other seeds than the plain sample's: the first token (from the prefill) would be equal
    sample = first_tokens(spec, engines["prompt"], range(N, 2 * N))  # type: ignore[arg-type]
    drafted, accepted = s.spec_draft_tokens - before[0], s.spec_accepted_tokens - before[1]
    assert drafted > N / 2 and accepted > drafted / 10, (drafted, accepted)  # it speculated
    assert two_sample_p(plain_sample, sample) > 1e-3, (plain_sample, sample)


def test_a_wrong_acceptance_rule_is_found(
    engines: dict[str, object],
    plain_sample: Counter[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Proposals accepted whenever the model could sample them (probability > 0, here: in
    the top 2): the test above sees the difference."""

    def in_support(probs: torch.Tensor, cdf: torch.Tensor, target: torch.Tensor, x: object) -> int:
        if isinstance(x, int) and float(probs[x]) > 0:
            return x
        return sampler_module._inverse_transform(probs, cdf, target)

    monkeypatch.setattr(sampler_module, "_draw", in_support)
    sample = first_tokens(engines["spec"], engines["prompt"], range(N, 2 * N))  # type: ignore[arg-type]
    assert two_sample_p(plain_sample, sample) < 1e-3


def test_a_seeded_sampled_request_repeats_with_speculation(engines: dict[str, object]) -> None:
    spec: LLM = engines["spec"]  # type: ignore[assignment]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=24, seed=11)
    prompt = {"prompt_token_ids": engines["prompt"]}
    runs = [spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for _ in "ab"]
    assert runs[0] == runs[1]


def test_penalties_min_tokens_logprobs_and_preemption_speculate_with_plain_outputs(
    engines: dict[str, object],
) -> None:
    """Requests with penalties, min_tokens, logprobs, seeded sampling, in a KV cache too small
    for them all (preemptions, recomputed with their generators replayed), give the tokens
    they give without speculation, with the same logprobs; they did speculate."""
    plain: LLM = engines["plain"]  # type: ignore[assignment]
    prompt = {"prompt_token_ids": engines["prompt"]}
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=0.5, min_tokens=30),
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=1.0, top_k=3, max_tokens=40, seed=4, frequency_penalty=0.3),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=5, logprobs=1),
    ] * 2
    expected = plain.generate([prompt] * len(params), params, use_tqdm=False)
    per_block = plain.engine_core.executor.worker.runner.kv_bytes_per_block()  # type: ignore[union-attr]
    small = LLM(
        plain.config.model.model,
        dtype="float32",
        kv_cache_memory=12 * per_block,
        max_model_len=128,
        speculative_config=NGRAM,
    )
    try:
        small.engine_core.scheduler.step_times = FlatTimes()
        outs = small.generate([prompt] * len(params), params, use_tqdm=False)
        s = small.engine_core.scheduler
        assert s.num_preemptions > 0 and s.spec_accepted_tokens > 0
    finally:
        small.shutdown()
    for want, got in zip(expected, outs, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        if want.outputs[0].logprobs is not None:
            for a, b in zip(want.outputs[0].logprobs, got.outputs[0].logprobs or [], strict=True):
                assert a.keys() == b.keys()
                for t in a:
                    assert abs(a[t].logprob - b[t].logprob) < 1e-4
