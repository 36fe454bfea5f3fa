"""`EngineRestarts`: the per-engine restart states, driven as the API server's client drives
them (a real `InFlight` and `EngineRouter`; this host records what would go on the sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from treadle.config import RestartConfig
from treadle.frontend.engine_restarts import EngineRestarts
from treadle.frontend.engine_router import EngineRouter
from treadle.frontend.inflight import InFlight
from treadle.frontend.restart_sequence import RestartBudget, restart_child
from treadle.sampling_params import SamplingParams
from treadle.wire.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest


class Host:
    def __init__(self, num_engines: int) -> None:
        self.inflight = InFlight()
        self.router = EngineRouter(num_engines)
        self.sent: list[tuple[int, str]] = []  # (engine, request id) of each ADD
        self.aborted: list[tuple[int, list[str]]] = []
        self.failed: list[str] = []  # request ids failed by the dead-letter rule
        self.ended = False
        self.killable: frozenset[int] = frozenset()
        self.killed: list[int] = []

    def fail(self, reason: str) -> None:
        self.ended = True

    def spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        coro.close()

    async def respawn(self, rank: int) -> None: ...

    async def respawn_coordinator(self) -> None: ...

    def kill(self, rank: int) -> None:
        self.killed.append(rank)

    async def send_abort(self, rank: int, request_ids: list[str]) -> None:
        self.aborted.append((rank, request_ids))

    async def send_add(self, rank: int, request: EngineCoreRequest) -> None:
        self.sent.append((rank, request.request_id))

    def fail_calls(self, rank: int, cause: str) -> None: ...

    def fail_poisoned(self, rank: int, request_ids: list[str], cause: str) -> None:
        self.failed += request_ids

    def on_event(self, kind: str, engine: int, count: int) -> None: ...

    def add(self, rid: str, rank: int) -> None:
        request = EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=8), eos_token_id=2)
        self.router.route(request, rank)
        self.inflight.add(request, rank)


def progress(restarts: EngineRestarts, host: Host, engine: int, rid: str) -> None:
    """A token of `rid` from `engine`, as the client's output reader hands it on."""
    item = EngineCoreOutputs(engine_index=engine, outputs=[EngineCoreOutput(rid, [5])])
    asyncio.run(restarts.on_outputs(item, host.inflight.on_outputs(item)))


def test_two_engines_lost_at_once_hand_their_requests_to_the_one_left_one_at_a_time() -> None:
    host = Host(3)
    restarts = EngineRestarts(host, 3, RestartConfig(), max_waiting=8)
    host.router.slots = restarts.slots
    for rid, rank in (("a", 1), ("b", 2), ("c", 0)):
        host.add(rid, rank)
    asyncio.run(restarts.lost([1, 2]))
    # Neither moves onto the other lost engine; one suspect at a time on engine 0.
    assert restarts.states == ["up", "lost", "lost"]
    assert host.sent == [(0, "a")] and host.failed == []
    assert host.aborted == [(1, ["a"]), (2, ["b"])]
    progress(restarts, host, 0, "a")
    assert host.sent == [(0, "a"), (0, "b")] and host.failed == []
    assert {host.inflight.requests[r].engine for r in "abc"} == {0}
    assert host.inflight.count(0) == 3 and host.inflight.count(1) == 0
    # New requests never go to a lost engine, not even when every other one is restarting.
    restarts.down(0, "engine 0 died")
    request = EngineCoreRequest("d", [1], SamplingParams(max_tokens=8), eos_token_id=2)
    assert host.router.route(request, None) == 0
    assert restarts.readiness() == "engine core 0 is restarting"


def test_waiters_for_a_restarting_engine_wake_when_the_client_ends() -> None:
    host = Host(1)
    restarts = EngineRestarts(host, 1, RestartConfig(), max_waiting=8)
    host.router.slots = restarts.slots

    async def scenario() -> bool:
        restarts.down(0, "engine 0 died")
        waiter = asyncio.ensure_future(restarts.wait_up(0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        restarts.wake_all()
        await asyncio.wait_for(waiter, 1.0)
        return restarts.is_up(0)

    assert asyncio.run(scenario())


def test_the_budget_refuses_past_its_limit_and_says_which_flag() -> None:
    budget = RestartBudget(2)
    assert budget.spend("first") is None and budget.spend("second") is None
    refusal = budget.spend("third")
    assert refusal is not None and "--max-engine-restarts" in refusal and "third" in refusal
    assert budget.describe() == "restart 2 of at most 2 in 10 minutes"


@pytest.mark.parametrize("stalled", [False, True])
def test_a_resuming_engine_is_ready_unless_stalled(stalled: bool) -> None:
    host = Host(1)
    restarts = EngineRestarts(host, 1, RestartConfig(), max_waiting=8)
    host.router.slots = restarts.slots
    host.add("a", 0)
    host.add("b", 0)
    restarts.down(0, "engine 0 died")
    assert restarts.readiness() == "engine core 0 is restarting"
    asyncio.run(restarts.back(0, "now"))
    assert restarts.states[0] == "resuming" and host.sent == [(0, "a")]
    if stalled:  # (an idle past --engine-stall-timeout: not killed, nobody here can)
        restarts.stall(0, RestartConfig().engine_stall_timeout + 1.0)
    assert (restarts.readiness() is None) is not stalled


def test_a_stalled_engine_is_killed_again_when_its_next_process_stalls() -> None:
    """The supervisor's way (`down` when the pid is gone, `back` at the new hello), which
    never calls `died`: the first kill must not keep the next process from being killed."""
    host = Host(1)
    host.killable = frozenset({0})
    config = RestartConfig(engine_stall_timeout=1.0, engine_stall_kill_timeout=3.0)
    restarts = EngineRestarts(host, 1, config, max_waiting=8)
    host.router.slots = restarts.slots
    host.add("a", 0)
    for process in (1, 2):
        restarts.stall(0, 2.0)  # not ready, not killed yet
        assert restarts.slots[0].stalled and host.killed == [0] * (process - 1)
        restarts.stall(0, 4.0)
        restarts.stall(0, 4.25)  # (once per process)
        assert host.killed == [0] * process
        restarts.down(0, "EngineCore_DP0 (pid 1) is gone; its supervisor restarts it")
        asyncio.run(restarts.back(0, "(restarted by the supervisor)"))
        assert restarts.readiness() is None


def test_the_restart_sequence_spends_the_budget_and_fails_or_comes_back() -> None:
    budget = RestartBudget(1)
    said: list[str] = []

    async def start() -> None:
        said.append("started")

    async def broken() -> None:
        raise OSError("no room")

    async def back(took: float) -> None:
        said.append("back")

    sequence = restart_child("X", "x died", budget, start, said.append, said.append, back)
    assert sequence is not None and said == [
        "X died. Restarting it (restart 1 of at most 1 in 10 minutes)"
    ]
    asyncio.run(sequence)
    assert said[1:] == ["started", "back"]
    assert restart_child("X", "x died", budget, start, said.append) is None
    assert said[-1].endswith("(--max-engine-restarts)")
    sequence = restart_child("X", "x died", RestartBudget(1), broken, said.append)
    assert sequence is not None
    asyncio.run(sequence)
    assert said[-1] == "x died, and restarting it failed: OSError: no room"


def test_a_request_in_flight_at_two_deaths_fails_as_a_typed_error() -> None:
    host = Host(1)
    restarts = EngineRestarts(host, 1, RestartConfig(), max_waiting=8)
    host.router.slots = restarts.slots
    host.add("a", 0)
    restarts.down(0, "engine 0 died")
    asyncio.run(restarts.back(0, "now"))
    assert host.sent == [(0, "a")]
    restarts.down(0, "engine 0 died again")
    assert host.failed == ["a"] and host.inflight.count(0) == 0


class Spawning(Host):
    """A host that keeps what it spawns, to run it."""

    def __init__(self, num_engines: int) -> None:
        super().__init__(num_engines)
        self.tasks: list[Coroutine[Any, Any, None]] = []
        self.reason = ""

    def fail(self, reason: str) -> None:
        self.ended, self.reason = True, reason

    def spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        self.tasks.append(coro)

    async def respawn(self, rank: int) -> None:
        raise RuntimeError("the EngineCore_DP1 process failed to start: no GPU")

    def run(self) -> None:
        while self.tasks:
            asyncio.run(self.tasks.pop(0))


def test_an_engine_whose_restart_fails_is_lost_while_another_serves_else_the_end() -> None:
    from treadle.frontend.engine_state import Death

    host = Spawning(2)
    host.killable = frozenset({0, 1})
    restarts = EngineRestarts(host, 2, RestartConfig(), max_waiting=8)
    host.router.slots = restarts.slots
    host.add("a", 1)
    restarts.died(1, Death("the EngineCore_DP1 process died: exit code 1"))
    assert restarts.states == ["up", "restarting"]
    host.run()  # the restart fails: lost, its failed process killed, "a" resumes on engine 0
    assert restarts.states == ["up", "lost"] and not host.ended
    assert host.killed == [1] and host.sent == [(0, "a")]
    assert [slot.gone for slot in restarts.slots] == [False, True]
    death = restarts.slots[1].last_death
    assert death is not None and "restarting it failed" in death.cause and "no GPU" in death.cause
    assert restarts.readiness() == "engine core 1 is lost"
    restarts.died(1, Death("its killed process"))  # the kill's report: nothing more
    assert restarts.states == ["up", "lost"] and host.tasks == []
    # The last engine whose restart fails ends the client.
    restarts.died(0, Death("the EngineCore_DP0 process died: exit code 1"))
    host.run()
    assert host.ended and "restarting it failed" in host.reason


def test_a_lost_engine_that_rejoins_takes_requests_again() -> None:
    host = Host(2)
    restarts = EngineRestarts(host, 2, RestartConfig(), max_waiting=8)
    host.router.slots = restarts.slots
    host.add("a", 1)
    asyncio.run(restarts.lost([1]))
    asyncio.run(restarts.lost([1]))  # (a second report of it changes nothing)
    assert restarts.states == ["up", "lost"] and host.sent == [(0, "a")]
    asyncio.run(restarts.rejoined(1))
    assert restarts.states == ["up", "up"] and not any(s.gone for s in restarts.slots)
    assert restarts.readiness() is None and restarts.is_up(1)
    request = EngineCoreRequest("b", [1], SamplingParams(max_tokens=8), eos_token_id=2)
    assert host.router.route(request, 1) == 1
