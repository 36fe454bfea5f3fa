"""treadle.ipc.engine_auth: only an engine with its front end's token binds its rank."""

from __future__ import annotations

import pytest

from treadle.ipc.engine_auth import (
    EngineIdentities,
    EngineRefusedError,
    engine_token,
    new_key,
    seal_control,
)


def test_a_token_binds_its_rank_and_launch_only() -> None:
    key = new_key()
    ids = EngineIdentities(key, 2)
    assert ids.identity(0) == b""  # nothing bound: sends to it are dropped by the ROUTER
    assert ids.admit(b"peer-a", 0, 1, engine_token(key, 0, 1)) is True
    assert ids.identity(0) == b"peer-a"
    # The same engine connected again (a new connection, the same launch).
    assert ids.admit(b"peer-b", 0, 1, engine_token(key, 0, 1)) is False
    assert ids.identity(0) == b"peer-b"
    # A restarted engine: a later launch.
    assert ids.admit(b"peer-c", 0, 2, engine_token(key, 0, 2)) is True
    assert ids.identity(0) == b"peer-c" and ids.launch(0) == 2


@pytest.mark.parametrize(
    ("rank", "launch", "token", "why"),
    [
        (0, 1, b"", "wrong or missing token"),
        (0, 1, b"x" * 32, "wrong or missing token"),
        (0, 1, engine_token(b"other key", 0, 1), "wrong or missing token"),
        (1, 1, "token of rank 0", "wrong or missing token"),
        (0, 2, "token of launch 1", "wrong or missing token"),
        (0, 1, "token of launch 1", "older than the current one"),  # a replay of a dead one
        (5, 1, b"", "unknown engine rank"),
        (-1, 1, b"", "unknown engine rank"),
    ],
)
def test_a_claim_without_proof_changes_nothing(
    rank: int, launch: int, token: bytes | str, why: str
) -> None:
    key = new_key()
    ids = EngineIdentities(key, 2)
    ids.admit(b"engine", 0, 2, engine_token(key, 0, 2))
    if token == "token of rank 0":
        token = engine_token(key, 0, launch)
    elif token == "token of launch 1":
        token = engine_token(key, rank, 1)
    assert isinstance(token, bytes)
    with pytest.raises(EngineRefusedError, match=why):
        ids.admit(b"impostor", rank, launch, token)
    assert ids.identity(0) == b"engine" and ids.launch(0) == 2


def test_a_control_message_counts_only_with_its_senders_proof() -> None:
    """What an engine pushes to say it stopped or died carries (rank, launch) and an HMAC
    under that launch's token: another process of the same user cannot forge one."""
    key = new_key()
    ids = EngineIdentities(key, 2)
    ids.admit(b"engine", 1, 2, engine_token(key, 1, 2))
    tokens = [engine_token(key, 1, 2), engine_token(b"another front end", 1, 2)]
    mine, theirs = seal_control(tokens, 1, 2, [b"ENGINE_CORE_DEAD", b"report"])
    assert mine[:2] == theirs[:2] == [b"ENGINE_CORE_DEAD", b"report"] and mine[2] != theirs[2]
    assert ids.check_control(mine) == 1
    newer = seal_control([engine_token(key, 1, 3)], 1, 3, [b"ENGINE_CORE_STOPPED"])[0]
    assert ids.check_control(newer) == 1  # (its hello may come later than its death)
    older = seal_control([engine_token(key, 1, 1)], 1, 1, [b"ENGINE_CORE_STOPPED"])[0]
    forged = [
        (theirs, "wrong proof"),  # another front end's
        ([b"ENGINE_CORE_DEAD", b"other report", mine[2]], "wrong proof"),  # changed body
        ([b"ENGINE_CORE_STOPPED", mine[2]], "wrong proof"),
        ([b"ENGINE_CORE_STOPPED", b"\x00" * 40], "wrong proof"),
        ([b"ENGINE_CORE_STOPPED"], "no proof"),
        ([b"ENGINE_CORE_STOPPED", b"x" * 10], "no proof"),
        ([b"ENGINE_CORE_STOPPED", b"\x07" + b"\x00" * 39], "unknown engine rank 7"),
        (older, "older than the current one"),
    ]
    for frames, why in forged:
        with pytest.raises(EngineRefusedError, match=why):
            ids.check_control(frames)
