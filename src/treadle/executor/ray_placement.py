"""Where Ray runs the ranks: placement groups, and which placed bundle serves which rank.

Each rank is one bundle of `--cpu-threads` CPUs. With -tp > 1 each pipeline stage first asks
for a STRICT_PACK group of its own (its -tp bundles on one node), so that no stage's
all-reduce crosses hosts; if a stage cannot be placed so within `STAGE_ON_ONE_NODE_WAIT_S`, one
PACK group of every rank (PACK only prefers one node, so it may split a stage), its ranks laid
out by `stage_order` (the executor then logs each split stage).
"""

from __future__ import annotations

import contextlib

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from treadle import envs

STAGE_ON_ONE_NODE_WAIT_S = 5.0  # for each stage's one-node group, before PACK over all

Placed = tuple[PlacementGroup, int, str]  # (group, bundle index, node id)


def place(tag: str, tp: int, pp: int, threads: int) -> tuple[list[PlacementGroup], list[Placed]]:
    """The ready groups, and the placed bundle of each rank (rank order). Raises
    RuntimeError, saying what to change, when Ray cannot place them in time."""
    here = ray.get_runtime_context().get_node_id()
    groups: list[PlacementGroup] = []
    if tp > 1 and max(node_cpus(), default=0) >= threads * tp:
        try:
            for stage in range(pp):
                groups.append(_group(tag, tp, threads, stage, STAGE_ON_ONE_NODE_WAIT_S))
        except RuntimeError:
            remove_groups(groups)
            groups = []
    if not groups:
        groups.append(_group(tag, tp * pp, threads, None, envs.ray_placement_timeout_s()))
    placed: list[Placed] = []
    for pg in groups:
        where = placement_group_table(pg)["bundles_to_node_id"]
        placed += [(pg, b, where[b]) for b in sorted(where)]
    order = stage_order([node for _, _, node in placed], tp, here)
    return groups, [placed[i] for i in order]


def stage_order(nodes: list[str], tp: int, here: str) -> list[int]:
    """An order of the placed bundles (`nodes[i]`: bundle i's node) for ranks 0, 1, ...: as
    many pipeline stages (runs of `tp` ranks) as the placement allows on one node each, the
    nodes with most bundles first, but a whole stage on this node (`here`) leads, so that
    rank 0 reads its steps through shared memory."""
    by_node: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        by_node.setdefault(node, []).append(i)
    ranked = sorted(by_node, key=lambda n: (-(len(by_node[n]) // tp), n != here, n))
    if len(by_node.get(here, ())) >= tp:
        ranked.remove(here)
        ranked.insert(0, here)
    whole: list[int] = []
    rest: list[int] = []
    for node in ranked:
        bundles = by_node[node]
        cut = len(bundles) // tp * tp
        whole += bundles[:cut]
        rest += bundles[cut:]
    return whole + rest


def _group(tag: str, n: int, threads: int, stage: int | None, timeout: float) -> PlacementGroup:
    """A ready group of `n` bundles of `threads` CPUs: one stage's on one node (STRICT_PACK),
    or every rank's (PACK, `stage` None)."""
    strategy = "PACK" if stage is None else "STRICT_PACK"
    name = f"treadle-{tag}" + ("" if stage is None else f"-pp{stage}")
    pg = placement_group([{"CPU": float(threads)}] * n, strategy=strategy, name=name)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except GetTimeoutError:
        remove_groups([pg])
        free = ray.available_resources().get("CPU", 0)
        raise RuntimeError(
            f"Ray could not place {n} workers of {threads} CPUs each (a {strategy} placement "
            f"group) in {timeout:g} s; the cluster has {free:g} CPUs free across "
            f"{len(alive_nodes())} nodes: `ray status` shows what it holds (lower "
            "--cpu-threads, add a node, or raise TREADLE_RAY_PLACEMENT_TIMEOUT_S)"
        ) from None
    return pg


def remove_groups(groups: list[PlacementGroup]) -> None:
    for pg in groups:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)


def node_cpus() -> list[float]:
    """Each alive node's CPUs (all of them, used or not)."""
    return [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]


def alive_nodes() -> dict[str, str]:
    """Ray node id -> its address, for the nodes alive now."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
