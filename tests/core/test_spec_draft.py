"""Draft-model speculative decoding (issue 27): on tiny random models (vocabulary 512), greedy
outputs are identical with and without a draft (single, batched, a max_tokens cut inside the
accepted tokens, preemptions in a tiny KV cache), the target as its own draft has every greedy
proposal accepted, a seeded sampled request repeats, and bad drafts are refused at start-up."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tests.conftest import build_tiny_model
from tests.core.test_spec_sampling import two_sample_p

from treadle import LLM, SamplingParams
from treadle.config import SpeculativeConfig
from treadle.core.request import Request
from treadle.core.spec_decode import StepTimes, plan
from treadle.core.spec_draft import GREEDY
from treadle.worker import sampler as sampler_module

K = 3


class FlatTimes(StepTimes):
    """Every step costs the same, whatever its rows: the plan verifies every proposal."""

    def record(self, rows: int, seconds: float) -> None:
        pass

    def table(self, first: int, last: int) -> list[float]:
        return [1.0] * (last - first + 1)


class FreeDraft(FlatTimes):
    def table(self, first: int, last: int) -> list[float]:
        return [0.0] * (last - first + 1)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    make = tmp_path_factory.mktemp
    return {
        "target": build_tiny_model(make("draft-target"), "llama", vocab_size=512),
        "draft": build_tiny_model(
            make("draft-small"), "llama", seed=1, vocab_size=512, num_hidden_layers=1
        ),
    }


def make_llm(target: Path, draft: Path | None, **kwargs: object) -> LLM:
    spec = (
        None
        if draft is None
        else {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    )
    kwargs.setdefault("max_model_len", 256)
    llm = LLM(str(target), dtype="float32", speculative_config=spec, **kwargs)
    if draft is not None:
        scheduler = llm.engine_core.scheduler
        scheduler.step_times = FlatTimes()
        assert scheduler.draft is not None
        scheduler.draft.times = FreeDraft()
    return llm


@pytest.fixture(scope="module")
def engines(models: dict[str, Path]) -> Iterator[dict[str, LLM]]:
    os.environ["TREADLE_ENABLE_MULTIPROCESSING"] = "0"
    built: dict[str, LLM] = {}
    try:
        built["plain"] = make_llm(models["target"], None)
        built["draft"] = make_llm(models["target"], models["draft"])
        built["self"] = make_llm(models["target"], models["target"])
        yield built
    finally:
        del os.environ["TREADLE_ENABLE_MULTIPROCESSING"]
        for llm in built.values():
            llm.shutdown()


PROMPTS = [list(range(100, 110)), [7, 8, 9] * 5, list(range(300, 340))]


def greedy_ids(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_outputs_are_identical_with_a_draft(engines: dict[str, LLM]) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    cut = SamplingParams(temperature=0.0, max_tokens=7)  # inside a step's accepted tokens
    batch = [*PROMPTS, PROMPTS[0]]
    params = [greedy] * 3 + [cut]
    want = greedy_ids(engines["plain"], batch, params)
    alone = [greedy_ids(engines["plain"], [p], [greedy])[0] for p in PROMPTS]
    for name in ("draft", "self"):
        llm = engines[name]
        assert greedy_ids(llm, batch, params) == want, name
        assert [greedy_ids(llm, [p], [greedy])[0] for p in PROMPTS] == alone, name
    s = engines["draft"].engine_core.scheduler
    assert s.spec_drafts > 0 and s.spec_draft_tokens > 0
    # every request gave its draft blocks back
    draft = s.draft
    assert draft is not None and not draft._drafts
    assert draft.num_free_blocks == draft.runner.kv_caches[0][0].shape[1]


def test_the_target_as_its_own_draft_has_every_greedy_proposal_accepted(
    engines: dict[str, LLM],
) -> None:
    s = engines["self"].engine_core.scheduler
    before = (s.spec_draft_tokens, s.spec_accepted_tokens, list(s.spec_accepted_per_pos))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    greedy_ids(engines["self"], PROMPTS, [greedy] * 3)
    drafted, accepted = s.spec_draft_tokens - before[0], s.spec_accepted_tokens - before[1]
    assert drafted >= 3 * 25 and accepted == drafted, (drafted, accepted)
    per_pos = [a - b for a, b in zip(s.spec_accepted_per_pos, before[2], strict=True)]
    assert len(per_pos) == K and sum(per_pos) == accepted


def test_a_seeded_sampled_request_repeats_with_a_draft(engines: dict[str, LLM]) -> None:
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=24, seed=11)
    for name in ("draft", "self"):
        runs = [greedy_ids(engines[name], [PROMPTS[1]], [params])[0] for _ in "ab"]
        assert runs[0] == runs[1], name


N = 400  # sampled requests per sample


def first_tokens(llm: LLM, seeds: range) -> Counter[tuple[int, ...]]:
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=4, seed=s) for s in seeds]
    prompt = {"prompt_token_ids": PROMPTS[0]}
    outs = llm.generate([prompt] * len(seeds), params, use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


def test_sampling_with_a_draft_has_plain_sampling_s_distribution(engines: dict[str, LLM]) -> None:
    """The first four tokens of many sampled requests (top 2 at temperature 1): the same
    distribution with the draft's proposals (the target as its own draft: proposals often
    accepted, often not) as without (two-sample chi-square, as `test_spec_sampling.py`)."""
    s = engines["self"].engine_core.scheduler
    before = (s.spec_draft_tokens, s.spec_accepted_tokens)
    plain = first_tokens(engines["plain"], range(N))
    spec = first_tokens(engines["self"], range(N, 2 * N))
    drafted, accepted = s.spec_draft_tokens - before[0], s.spec_accepted_tokens - before[1]
    assert drafted > N and drafted / 10 < accepted < drafted, (drafted, accepted)
    assert two_sample_p(plain, spec) > 1e-3, (plain, spec)


def test_the_sampling_test_finds_a_wrong_acceptance_rule(
    engines: dict[str, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proposals accepted whenever the model could sample them: the test above fails."""

    def in_support(probs: torch.Tensor, cdf: torch.Tensor, target: torch.Tensor, x: object) -> int:
        if isinstance(x, int) and float(probs[x]) > 0:
            return x
        return sampler_module._inverse_transform(probs, cdf, target)

    plain = first_tokens(engines["plain"], range(N))
    monkeypatch.setattr(sampler_module, "_draw", in_support)
    assert two_sample_p(plain, first_tokens(engines["self"], range(N, 2 * N))) < 1e-3


def test_preemptions_with_a_draft_give_plain_outputs(
    engines: dict[str, LLM], models: dict[str, Path]
) -> None:
    """A KV cache too small for all requests at once: preempted requests give their draft
    blocks back and are recomputed; the outputs are plain greedy decoding's."""
    plain = engines["plain"]
    prompts = [PROMPTS[0], PROMPTS[2]] * 3
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(prompts)
    want = greedy_ids(plain, prompts, params)
    per_block = plain.engine_core.executor.worker.runner.kv_bytes_per_block()  # type: ignore[union-attr]
    small = make_llm(
        models["target"], models["draft"], kv_cache_memory=16 * per_block, max_model_len=128
    )
    try:
        assert greedy_ids(small, prompts, params) == want
        s = small.engine_core.scheduler
        assert s.num_preemptions > 0 and s.spec_draft_tokens > 0
        assert s.draft is not None and not s.draft._drafts
    finally:
        small.shutdown()


def test_a_draft_beside_a_tp2_model_gives_plain_outputs(
    engines: dict[str, LLM], models: dict[str, Path]
) -> None:
    """-tp 2: the model in two worker processes, the draft (world size 1) in the engine
    core."""
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 3
    want = greedy_ids(engines["plain"], PROMPTS, params)
    tp2 = make_llm(models["target"], models["draft"], tensor_parallel_size=2)
    try:
        assert greedy_ids(tp2, PROMPTS, params) == want
        assert tp2.engine_core.scheduler.spec_draft_tokens > 0
    finally:
        tp2.shutdown()


def test_the_draft_s_cache_follows_the_accepted_tokens(engines: dict[str, LLM]) -> None:
    """After proposals that were partly rejected (and a bonus token that differs), the
    draft's next proposals are those of a draft that computes the whole context afresh; a
    dropped request gives its blocks back."""
    draft = engines["draft"].engine_core.scheduler.draft
    assert draft is not None
    free = draft.num_free_blocks

    def request(rid: str, tokens: list[int]) -> Request:
        req = Request(rid, tokens[:12], GREEDY, None, 0.0)
        req.all_token_ids = list(tokens)
        return req

    kept = request("kept", PROMPTS[2][:20])
    proposal = draft.propose([(kept, K)])["kept"]
    for accepted, plain_steps in ((1, 0), (0, 2), (3, 0), (1, 1), (2, 0)):
        assert len(proposal) == K
        tokens = kept.all_token_ids
        tokens += proposal[:accepted]
        if accepted < K:
            tokens.append((proposal[accepted] + 1) % 512)  # the model chose otherwise
        else:
            tokens.append(5)  # the bonus token
        tokens += [7] * plain_steps  # steps without speculation (the plan proposed nothing)
        fresh = request("fresh", tokens)
        want = draft.propose([(fresh, K)])["fresh"]
        draft.drop("fresh")
        proposal = draft.propose([(kept, K)])["kept"]
        assert proposal == want, accepted
    # the same tokens again (proposals that were not verified): the same proposals
    assert draft.propose([(kept, K)])["kept"] == proposal
    draft.drop("kept")
    assert draft.num_free_blocks == free


def test_the_plan_counts_the_draft_s_forwards() -> None:
    """A verify row costs 1% of a step; a draft forward as much as a whole step (the target
    as its own draft) makes no proposal pay, not even a sure one; a draft at 5% of a step
    pays at a high acceptance rate."""
    steps = StepTimes()
    for rows, seconds in ((1, 1.0), (2, 1.01), (3, 1.02), (4, 1.03)):
        steps.record(rows, seconds)
    heavy, light = StepTimes(), StepTimes()
    heavy.record(1, 1.0)
    light.record(1, 0.05)
    assert plan({"a": (3, 0.9)}, 1, steps) == ({"a": 3}, True)
    assert plan({"a": (3, 0.9)}, 1, steps, heavy) == ({}, False)
    assert plan({"a": (3, 0.9)}, 1, steps, light)[0] == {"a": 3}
    assert plan({"a": (3, 0.02)}, 1, steps, light) == ({}, True)


def test_bad_draft_configs_are_refused(models: dict[str, Path], tmp_path: Path) -> None:
    for value, words in (
        ({"method": "draft_model"}, 'needs "model"'),
        ({"method": "draft_model", "model": str(tmp_path / "none")}, "not there"),
        ({"method": "ngram", "model": str(models["draft"])}, 'not "ngram"'),
        (
            {"method": "draft_model", "model": str(models["draft"]), "num_speculative_tokens": 0},
            "num_speculative_tokens",
        ),
        ({"method": "draft_model", "model": str(models["draft"]), "draft_tp": 1}, "unknown key"),
    ):
        with pytest.raises((ValueError, FileNotFoundError), match=words):
            SpeculativeConfig.parse(json.dumps(value))
    parsed = SpeculativeConfig.parse({"method": "draft_model", "model": str(models["draft"])})
    assert parsed.model == str(models["draft"])


def test_a_draft_of_another_vocabulary_or_a_shorter_context_is_refused_at_start(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = build_tiny_model(tmp_path / "vocab", "llama", vocab_size=640, num_hidden_layers=1)
    short = build_tiny_model(
        tmp_path / "short", "llama", vocab_size=512, num_hidden_layers=1, max_position_embeddings=64
    )
    monkeypatch.setenv("TREADLE_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="vocabulary of 640 tokens"):
        make_llm(models["target"], other)
    with pytest.raises(ValueError, match="takes at most 64 tokens"):
        make_llm(models["target"], short)
