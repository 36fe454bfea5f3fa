"""Which placed bundle serves which rank (`stage_order`): whole pipeline stages on one node
each wherever the placement allows, this node's first (issue 42 item 8: PACK's placement split
a stage's TP ranks over nodes when ranks simply followed the nodes in turn)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from treadle.executor.ray_placement import stage_order  # noqa: E402


def stages(nodes: list[str], tp: int, here: str) -> list[list[str]]:
    order = stage_order(nodes, tp, here)
    assert sorted(order) == list(range(len(nodes)))  # each bundle serves one rank
    return [[nodes[i] for i in order[s : s + tp]] for s in range(0, len(order), tp)]


def test_a_stage_stays_on_one_node_when_the_placement_allows_it() -> None:
    # PACK put one bundle here, two on b, one on c: following the nodes in turn gave
    # stage 0 = (here, b) and stage 1 = (b, c), both split; one whole stage is possible.
    assert stages(["h", "b", "b", "c"], 2, "h") == [["b", "b"], ["h", "c"]]
    # Two bundles on each node: stage 0 here, stage 1 on the other.
    assert stages(["b", "b", "h", "h"], 2, "h") == [["h", "h"], ["b", "b"]]
    # Six bundles, tp 2: h has 2, b has 3, c has 1: two whole stages, h's first.
    assert stages(["h", "b", "c", "b", "b", "h"], 2, "h") == [["h", "h"], ["b", "b"], ["b", "c"]]


def test_without_tensor_parallelism_this_nodes_ranks_lead() -> None:
    assert stages(["b", "h", "b"], 1, "h") == [["h"], ["b"], ["b"]]
    assert stages(["b", "h"], 2, "h") == [["h", "b"]]  # one stage over two nodes: rank 0 here
