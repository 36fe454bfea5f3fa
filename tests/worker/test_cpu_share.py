"""Sharing the CPU (worker/cpu_share.py): fewer model threads while other processes take the
cores, all of them again once the cores are free; outputs do not depend on the thread count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treadle import envs
from treadle.worker import cpu_share
from treadle.worker.cpu_share import Reading, ThreadGovernor, read_proc


@pytest.fixture
def governor() -> ThreadGovernor:
    set_to: list[int] = []
    g = ThreadGovernor(2, pinned=False, apply=set_to.append)
    g.set_to = set_to  # type: ignore[attr-defined]
    return g


def feed(g: ThreadGovernor, steps: list[tuple[float, float]], start: float = 100.0) -> None:
    """Readings WINDOW_S apart, each (run delay, idle) in core-seconds per second."""
    delay = idle = 0.0
    before = Reading(start, delay, idle)
    for i, (waiting, free) in enumerate(steps, 1):
        delay += waiting * cpu_share.WINDOW_S
        idle += free * cpu_share.WINDOW_S
        now = Reading(start + i * cpu_share.WINDOW_S, delay, idle)
        g.decide(before, now)
        before = now


def test_threads_waiting_for_a_core_cost_a_thread(governor: ThreadGovernor) -> None:
    feed(governor, [(0.1, 0.0), (0.2, 0.0)])
    assert governor.threads == 2  # under SHRINK_AT: a thread now and then is not a neighbour
    feed(governor, [(0.4, 0.0)] * 4)
    assert governor.threads == 2  # nor the server's own work around a single stream
    feed(governor, [(0.6, 0.0)])
    assert governor.threads == 1
    feed(governor, [(0.9, 0.0)] * 4)
    assert governor.threads == 1  # never fewer than one
    assert governor.set_to == [1]  # type: ignore[attr-defined]


def test_a_free_core_gives_the_thread_back_after_the_hold(governor: ThreadGovernor) -> None:
    feed(governor, [(0.6, 0.0)])
    assert governor.threads == 1
    # One free window is not enough; two in a row are, once MIN_HOLD_S has passed.
    feed(governor, [(0.0, 1.0), (0.0, 0.0), (0.0, 1.0)], start=100.5)
    assert governor.threads == 1
    feed(governor, [(0.0, 1.0), (0.0, 1.0)], start=102.0)
    assert governor.threads == 2
    assert governor.set_to == [1, 2]  # type: ignore[attr-defined]


def test_a_neighbour_that_comes_back_makes_it_wait_longer(governor: ThreadGovernor) -> None:
    feed(governor, [(0.6, 0.0)])  # shrink at t=100.5
    feed(governor, [(0.0, 1.0)] * 3, start=100.5)  # grow at t=102.0 (hold 1 s)
    assert governor.threads == 2
    feed(governor, [(0.6, 0.0)], start=102.0)  # shrink again 0.5 s after growing: a flap
    assert governor.threads == 1 and governor._hold_s == 2 * cpu_share.MIN_HOLD_S
    feed(governor, [(0.0, 1.0)] * 3, start=102.5)  # 1.5 s later: still held
    assert governor.threads == 1
    feed(governor, [(0.0, 1.0)] * 2, start=104.0)
    assert governor.threads == 2


def test_a_pinned_count_never_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_share, "read_proc", lambda cpus: pytest.fail("read /proc"))

    def never(threads: int) -> None:
        pytest.fail(f"set {threads} threads")

    for g in (
        ThreadGovernor(2, pinned=True, apply=never),
        ThreadGovernor(1, pinned=False, apply=never),
    ):
        g.after_step()
        assert not g.active and g.threads == g.most


def test_the_governor_keeps_the_count_for_a_runner_that_reads_it() -> None:
    g = ThreadGovernor(2, pinned=False)  # (no setter: the lean runner passes `threads` itself)
    feed(g, [(1.0, 0.0)])
    assert g.threads == 1


def test_a_one_rank_runner_sets_the_engines_count_in_its_process_or_a_chosen_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine core process's model runs on `model_threads()`; a user's process keeps its
    threads unless the user chose a count; TP workers set their own (worker_proc)."""
    from treadle.parallel_config import ParallelConfig

    monkeypatch.setattr(cpu_share, "_engine_process", False)
    monkeypatch.delenv("TREADLE_CPU_THREADS", raising=False)
    assert not cpu_share.sets_model_threads(ParallelConfig())
    assert cpu_share.sets_model_threads(ParallelConfig(cpu_threads=1))
    cpu_share.mark_engine_process()
    assert cpu_share.sets_model_threads(ParallelConfig())
    assert not cpu_share.sets_model_threads(ParallelConfig(tensor_parallel_size=2))


def test_read_proc_sums_this_processes_threads_and_its_cpus(tmp_path: Path) -> None:
    for tid, delay_ns in (("10", 1_500_000_000), ("11", 500_000_000)):
        task = tmp_path / "self" / "task" / tid
        task.mkdir(parents=True)
        (task / "schedstat").write_text(f"123 {delay_ns} 7\n")
    (tmp_path / "self" / "task" / "12").mkdir()  # a thread that ended meanwhile
    tick = os.sysconf("SC_CLK_TCK")
    (tmp_path / "stat").write_text(
        f"cpu  1 2 3 {9 * tick} {9 * tick} 0 0\n"
        f"cpu0 1 2 3 {2 * tick} {1 * tick} 0 0\n"
        f"cpu1 1 2 3 {4 * tick} 0 0 0\n"
        f"cpu2 1 2 3 {100 * tick} 0 0 0\n"
        "intr 5 6\n"
    )
    reading = read_proc({0, 1}, tmp_path)
    assert reading is not None
    assert reading.run_delay_s == pytest.approx(2.0)
    assert reading.idle_s == pytest.approx(7.0)  # cpu0 idle + iowait, cpu1; not cpu2
    assert read_proc({0}, tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"proc/self/cgroup": "0::/box\n", "sys/fs/cgroup/box/cpu.max": "150000 100000\n"}, 2),
        ({"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "50000 100000\n"}, 1),
        ({"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "max 100000\n"}, None),
        (
            {
                "proc/self/cgroup": "4:memory:/x\n1:cpu,cpuacct:/\n",
                "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "100000\n",
                "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
            },
            1,
        ),
        (
            {
                "proc/self/cgroup": "1:cpu:/\n",
                "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
                "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
            },
            None,
        ),
        ({}, None),
    ],
)
def test_usable_cpus_follows_the_cgroup_quota(
    tmp_path: Path, files: dict[str, str], cpus: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    expected = affinity if cpus is None else min(affinity, cpus)
    assert envs.usable_cpus(str(tmp_path)) == expected


def _generate(default_model_path: str, threads: str) -> list[tuple[list[int], list[float]]]:
    code = (
        "import sys, json\n"
        "from treadle import LLM, SamplingParams\n"
        "llm = LLM(model=sys.argv[1], max_model_len=1024)\n"
        "p = ['The capital of France is', 'def fib(n):' * 40]\n"
        "outs = llm.generate(p, SamplingParams(max_tokens=24, temperature=0, logprobs=0))\n"
        "print(json.dumps([[o.outputs[0].token_ids, [lp[t].logprob for lp, t in "
        "zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]] for o in outs]))\n"
    )
    env = dict(os.environ, TREADLE_CPU_THREADS=threads)
    run = subprocess.run(
        [sys.executable, "-c", code, default_model_path],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [(ids, lps) for ids, lps in json.loads(run.stdout.splitlines()[-1])]


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to run the model on 2 threads"
)
@pytest.mark.serial  # (measures the cores left idle: nothing may run beside it)
def test_a_thread_count_change_is_no_bigger_than_a_batch_change(default_model_path: str) -> None:
    """1 and 2 threads: the same greedy tokens, logprobs equal to rounding (oneDNN blocks a
    GEMM differently per thread count, as it does per batch size)."""
    one, two = _generate(default_model_path, "1"), _generate(default_model_path, "2")
    for (ids1, lps1), (ids2, lps2) in zip(one, two, strict=True):
        assert ids1 == ids2
        assert lps1 == pytest.approx(lps2, abs=1e-4)


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) != 2,
    reason="sized for a 2-CPU machine (two busy loops take both cores)",
)
@pytest.mark.serial  # (measures the cores left idle: nothing may run beside it)
def test_busy_neighbours_take_a_thread_and_give_it_back(
    default_model_path: str, tmp_path: Path
) -> None:
    """Two busy loops on a 2-CPU machine: the engine core drops to one thread; the loops
    stopped: back to two (the log says both)."""
    code = (
        "import sys, time\n"
        "from treadle import LLM, SamplingParams\n"
        "llm = LLM(model=sys.argv[1], max_model_len=512)\n"
        "params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)\n"
        "end = time.monotonic() + 240\n"
        "while time.monotonic() < end:\n"
        "    llm.generate(['Tell me a story.'], params, use_tqdm=False)\n"
    )
    env = dict(os.environ, TREADLE_LOGGING_LEVEL="INFO")
    env.pop("TREADLE_CPU_THREADS", None)
    log_path = tmp_path / "engine.log"
    with open(log_path, "w") as log:
        llm = subprocess.Popen(
            [sys.executable, "-c", code, default_model_path], stderr=log, stdout=log, env=env
        )

    def wait_for(text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in log_path.read_text():
            assert llm.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {text!r}:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.2)

    try:
        wait_for("Maximum concurrency", 120)  # loaded and generating
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        try:
            wait_for("Model threads 2 -> 1 of 2", 60)
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        cpus = set(os.sched_getaffinity(0))
        before = read_proc(cpus)
        try:
            wait_for("Model threads 1 -> 2 of 2", 30)
        except AssertionError:
            after = read_proc(cpus)
            assert before is not None and after is not None
            idle = (after.idle_s - before.idle_s) / (after.when - before.when)
            if idle < cpu_share.GROW_IDLE:  # other work on this machine kept both cores busy
                pytest.skip(
                    f"only {idle:.2f} of a core was idle after the busy loops stopped: no core "
                    "to give back (runs when nothing else keeps this machine busy)"
                )
            raise
    finally:
        llm.terminate()
        try:
            llm.wait(30)
        except subprocess.TimeoutExpired:
            llm.kill()
            llm.wait()
