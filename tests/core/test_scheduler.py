"""Scheduler: continuous batching, chunked prefill, preemption, priority, abort, stopping.

Driven with real `Request`s and hand-made `ModelRunnerOutput`s: every request whose scheduled
tokens reach the end of its tokens gets a sampled token, as the model runner would give it.
"""

import random
from collections.abc import Callable

import pytest

from treadle.config import CacheConfig, SchedulerConfig
from treadle.core.request import Request, RequestStatus
from treadle.core.scheduler import Scheduler
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import EngineCoreOutput, FinishReason
from treadle.wire.worker import ModelRunnerOutput, SchedulerOutput

BS = 4
EOS = 2
TOKEN = 7  # the default sampled token: not eos, not a stop token


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching),
        num_blocks,
        max_model_len,
    )


def make_request(
    rid: str,
    prompt: int | list[int],
    arrival: float = 0.0,
    priority: int = 0,
    **params: object,
) -> Request:
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    params.setdefault("max_tokens", 100)
    return Request(rid, tokens, SamplingParams(**params), EOS, arrival, priority=priority)


def step(
    sched: Scheduler, sample: Callable[[str], int] = lambda rid: TOKEN
) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    """One engine step; checks the schedule's invariants and returns outputs by request id."""
    out = sched.schedule()
    assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert all(n >= 1 for n in out.num_scheduled_tokens.values())
    assert len(out.num_scheduled_tokens) <= sched.max_num_seqs
    assert set(out.num_scheduled_tokens) == {r.request_id for r in sched.running}
    listed = [r.request_id for r in out.new_requests] + [c.request_id for c in out.cached_requests]
    assert sorted(listed) == sorted(out.num_scheduled_tokens)
    for req in sched.running:
        assert req.num_computed_tokens <= req.num_tokens
        assert len(sched.kv.block_ids(req.request_id)) * BS >= req.num_computed_tokens
    sampled = {
        rid: sample(rid)
        for rid in out.num_scheduled_tokens
        if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens
    }
    results = sched.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    by_id = {o.request_id: o for outs in results.values() for o in outs}
    assert set(by_id) == set(sampled)
    return out, by_id


def test_prefill_then_decode_until_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, max_tokens=3))
    out, res = step(sched)
    [new] = out.new_requests
    assert (new.request_id, new.num_computed_tokens, new.num_prompt_tokens) == ("a", 0, 10)
    assert new.token_ids == list(range(100, 110)) and len(new.block_ids) == 3
    assert out.num_scheduled_tokens == {"a": 10}
    assert res["a"].new_token_ids == [TOKEN] and res["a"].finish_reason is None
    out, res = step(sched)
    assert out.num_scheduled_tokens == {"a": 1} and out.new_requests == []
    assert out.cached_requests[0].num_computed_tokens == 10
    out, res = step(sched)
    assert res["a"].finish_reason is FinishReason.LENGTH
    assert not sched.has_unfinished_requests() and sched.kv.usage == 0.0
    assert sched.schedule().finished_request_ids == {"a"}  # the workers learn next step
    assert sched.schedule().finished_request_ids == set()


def test_chunked_prefill_samples_only_at_the_end_of_the_prompt():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", 10))
    chunks = []
    for _ in range(3):
        out, res = step(sched)
        chunks.append((out.num_scheduled_tokens["a"], "a" in res))
    assert chunks == [(4, False), (4, False), (2, True)]
    assert [c.num_computed_tokens for c in out.cached_requests] == [8]
    assert sched.requests["a"].output_token_ids == [TOKEN]


def test_decodes_first_then_new_prefills_in_the_leftover_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 3, arrival=0.0))
    step(sched)
    sched.add_request(make_request("b", 20, arrival=1.0))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [c.request_id for c in out.cached_requests] == ["a"]


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, arrival=float(i), max_tokens=2))
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"} and sched.num_waiting == 1
    step(sched)  # r0 and r1 finish
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"r2"}
    assert out.finished_request_ids == {"r0", "r1"}


def test_priority_orders_admission_then_arrival():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("late_low", 4, arrival=0.0, priority=1))
    sched.add_request(make_request("b", 4, arrival=2.0, priority=0))
    sched.add_request(make_request("a", 4, arrival=1.0, priority=0))
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        order += [r.request_id for r in out.new_requests]
    assert order == ["a", "b", "late_low"]


def test_preemption_when_blocks_run_out_and_recompute():
    sched = make_scheduler(num_blocks=4)
    sched.add_request(make_request("a", 4, arrival=0.0))
    sched.add_request(make_request("b", 4, arrival=1.0))
    out, _ = step(sched)  # one block each, both full
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    step(sched)  # second block each: the cache is now full
    assert sched.kv.usage == 1.0
    for _ in range(3):
        step(sched)  # decodes within the second blocks
    out, _ = step(sched)  # a needs a third block: b (later arrival) is preempted
    assert out.finished_request_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    assert sched.num_preemptions == 1 and sched.num_waiting == 1
    b = sched.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    b_tokens = list(b.all_token_ids)
    assert len(b_tokens) == 4 + 5  # prompt and the 5 tokens sampled before
    sched.abort_requests(["a"])
    out, _ = step(sched)
    [new] = out.new_requests
    assert new.request_id == "b" and new.token_ids == b_tokens and new.num_prompt_tokens == 4
    # the blocks b filled were cached before the preemption: only the rest is recomputed
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens == {"b": 1}
    assert out.finished_request_ids == {"a"}


def test_preemption_without_prefix_caching_recomputes_everything():
    sched = make_scheduler(num_blocks=3, prefix_caching=False)
    sched.add_request(make_request("a", 4, arrival=0.0))
    sched.add_request(make_request("b", 4, arrival=1.0))
    step(sched)
    out, _ = step(sched)  # a takes the last block; b, needing one too, preempts itself
    assert out.finished_request_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    sched.abort_requests(["a"])
    out, _ = step(sched)
    [new] = out.new_requests
    assert new.request_id == "b" and new.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"b": 5}
    assert out.finished_request_ids == {"a"}


def test_preemption_picks_the_lowest_priority_victim():
    sched = make_scheduler(num_blocks=3)
    sched.add_request(make_request("important", 4, arrival=1.0, priority=0))
    sched.add_request(make_request("background", 4, arrival=0.0, priority=5))
    step(sched)
    step(sched)  # important takes the third block, background needs one too
    assert sched.num_preemptions == 1
    assert sched.requests["background"].status is RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.running] == ["important"]


def test_preempting_an_already_scheduled_victim_gives_back_its_tokens():
    sched = make_scheduler(num_blocks=3)
    sched.add_request(make_request("background", 4, arrival=0.0, priority=5))
    step(sched)
    sched.add_request(make_request("important", 4, arrival=1.0, priority=0))
    step(sched)  # background takes its second block, important its first: the cache is full
    out, res = step(sched)  # background is scheduled first, then evicted for important
    assert out.num_scheduled_tokens == {"important": 1} and out.total_num_scheduled_tokens == 1
    assert [c.request_id for c in out.cached_requests] == ["important"]
    assert out.finished_request_ids == {"background"} and set(res) == {"important"}
    assert sched.requests["background"].num_computed_tokens == 0


def test_a_request_preempts_itself_when_it_is_the_only_one():
    sched = make_scheduler(num_blocks=1)
    sched.add_request(make_request("a", 4))
    step(sched)
    out, res = step(sched)
    assert out.finished_request_ids == {"a"} and out.num_scheduled_tokens == {}
    assert res == {} and sched.requests["a"].status is RequestStatus.PREEMPTED
    assert out.total_num_scheduled_tokens == 0


def test_abort_waiting_and_running_requests():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", 4, arrival=0.0))
    sched.add_request(make_request("wait", 4, arrival=1.0))
    step(sched)
    aborted = sched.abort_requests(["wait", "run", "unknown"])
    assert [r.finish_reason for r in aborted] == [FinishReason.ABORT] * 2
    assert sched.abort_requests(["run"]) == []
    assert not sched.has_unfinished_requests() and sched.kv.usage == 0.0
    assert sched.requests == {}
    assert sched.schedule().finished_request_ids == {"run"}  # only what the workers know


def test_abort_between_schedule_and_update_drops_the_output():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    out = sched.schedule()
    sched.abort_requests(["a"])
    assert sched.update_from_output(out, ModelRunnerOutput(sampled={"a": TOKEN})) == {}


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "stop_reason", "num_out"),
    [
        ({}, [5, EOS], FinishReason.STOP, None, 2),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], FinishReason.LENGTH, None, 3),
        ({"stop_token_ids": [9]}, [5, 9], FinishReason.STOP, 9, 2),
        ({"min_tokens": 3}, [EOS, 9, EOS], FinishReason.STOP, None, 3),
        ({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9], FinishReason.STOP, 9, 2),
        ({"max_tokens": 2}, [5, 5], FinishReason.LENGTH, None, 2),
    ],
)
def test_stop_conditions(params, tokens, reason, stop_reason, num_out):
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, **params))
    script = iter(tokens)
    results = []
    while sched.has_unfinished_requests():
        _, res = step(sched, lambda rid: next(script))
        results.append(res["a"])
    assert [r.finish_reason for r in results[:-1]] == [None] * (num_out - 1)
    assert (results[-1].finish_reason, results[-1].stop_reason) == (reason, stop_reason)
    assert [r.new_token_ids[0] for r in results] == tokens[:num_out]


def test_max_model_len_ends_the_request():
    sched = make_scheduler(max_model_len=7)
    sched.add_request(make_request("a", 4, max_tokens=None))
    results = []
    while sched.has_unfinished_requests():
        results.append(step(sched)[1]["a"])
    assert len(results) == 3 and results[-1].finish_reason is FinishReason.LENGTH


def test_outputs_are_grouped_by_client():
    sched = make_scheduler()
    for rid, client in (("a", 0), ("b", 1), ("c", 1)):
        req = make_request(rid, 4)
        req.client_index = client
        sched.add_request(req)
    out = sched.schedule()
    sampled = dict.fromkeys(out.num_scheduled_tokens, TOKEN)
    grouped = sched.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    assert {k: [o.request_id for o in v] for k, v in grouped.items()} == {0: ["a"], 1: ["b", "c"]}


@pytest.mark.parametrize(("prompt_len", "hit"), [(9, 8), (8, 4), (5, 4), (4, 0)])
def test_prefix_hit_is_a_block_multiple_leaving_a_token(prompt_len, hit):
    sched = make_scheduler()
    sched.add_request(make_request("a", 12))
    step(sched)
    sched.add_request(make_request("b", prompt_len))
    out, res = step(sched)
    [new] = out.new_requests
    assert new.num_computed_tokens == hit and out.num_scheduled_tokens["b"] == prompt_len - hit
    assert res["b"].num_cached_tokens == hit
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12 + prompt_len, hit)
    assert stats.num_running_reqs == 2


def test_prefix_hit_counts_against_blocks_not_budget():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", 9))
    for _ in range(3):
        step(sched)
    sched.add_request(make_request("b", 9))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.new_requests[0].num_computed_tokens == 8


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=12, max_num_seqs=5, max_num_batched_tokens=16)
    prompts, max_tokens = {}, {}
    for i in range(30):
        rid = f"r{i}"
        shared = list(range(1, 9)) if rng.random() < 0.5 else []  # two blocks shared by half
        prompts[rid] = shared + [rng.randint(10, 50) for _ in range(rng.randint(1, 12))]
        max_tokens[rid] = rng.randint(1, 12)
        req = make_request(
            rid, prompts[rid], float(i), rng.randint(0, 2), max_tokens=max_tokens[rid]
        )
        sched.add_request(req)
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished: set[str] = set()
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            break
        running_before = {r.request_id for r in sched.running}
        out, res = step(sched, lambda rid: rng.choice([TOKEN, TOKEN, TOKEN, EOS]))
        for new in out.new_requests:
            assert new.token_ids == prompts[new.request_id] + outputs[new.request_id]
            assert new.num_computed_tokens % BS == 0
            assert new.num_computed_tokens < len(new.token_ids)
        for rid, o in res.items():
            outputs[rid].extend(o.new_token_ids)
            if o.finished:
                finished.add(rid)
        for rid in running_before - {r.request_id for r in sched.running} - finished:
            assert sched.requests[rid].status is RequestStatus.PREEMPTED
            assert rid in out.finished_request_ids  # told in the step that preempted it
        owned = {b for rid in sched.requests for b in sched.kv.block_ids(rid)}
        assert len(owned) == round(sched.kv.usage * sched.kv.num_blocks)
    assert finished == set(prompts) and sched.kv.usage == 0.0
    assert sched.num_preemptions > 0 and sched.kv.prefix_hits > 0
    for rid, toks in outputs.items():
        assert EOS not in toks[:-1]
        assert toks[-1] == EOS or len(toks) == max_tokens[rid]


def test_waiting_request_lookups_are_counted_once():
    """A request that waits for blocks is looked up every step but counted only on admission."""
    sched = make_scheduler(num_blocks=3, max_num_seqs=4)
    first = make_request("a", list(range(8)))
    second = make_request("b", list(range(100, 108)))
    sched.add_request(first)
    sched.add_request(second)
    for _ in range(3):
        sched.schedule()
    assert sched.make_stats().prefix_cache_queries == 8
