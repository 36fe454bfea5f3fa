"""The rendezvous of `--nnodes`: what node 0's engine core and the other nodes' ranks say to
each other through the store on `--master-addr:--master-port` (`ipc/secure_store.py`), and
how: the keys, the `Plan` and each rank's `RankInfo` (msgpack, never pickle), sealed with an
HMAC of the cluster secret when there is one (`seal` / `unseal`), and the heartbeat period.
Node 0's side is `multinode.py`, the other nodes' `remote_node.py`.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
from datetime import timedelta
from typing import Any

import msgspec
import torch.distributed as dist

from treadle import envs
from treadle.ipc import cluster_auth
from treadle.ipc.secure_store import SecureStore
from treadle.ipc.shm_broadcast import Handle

BEAT_S = 0.5
"""A remote rank's heartbeat period."""
CALL_REPLY_S = 5.0
"""A store call that node 0's store does not answer in this long fails: the engine core is
gone."""
PLAN_KEY = "treadle/nodes/plan"
POLL_S = 0.2


class Plan(msgspec.Struct, kw_only=True):
    """What the engine core publishes for the other nodes."""

    session: str  # one per engine core: a node serves each session once
    nnodes: int
    tp: int
    pp: int
    broadcast: Handle


class RankInfo(msgspec.Struct, kw_only=True):
    """What a remote rank publishes once loaded."""

    pid: int
    ppid: int
    host: str
    replies: Handle


def rank_key(session: str, rank: int) -> str:
    return f"treadle/nodes/{session}/rank/{rank}"


def beat_key(session: str, rank: int) -> str:
    return f"treadle/nodes/{session}/beat/{rank}"


def error_key(session: str, node: int) -> str:
    return f"treadle/nodes/{session}/error/{node}"


def node_key(session: str, node: int) -> str:
    return f"treadle/nodes/{session}/node/{node}"


# -- sealed values ---------------------------------------------------------------------------


def _mac_key() -> bytes | None:
    keys = cluster_auth.cluster_keys()
    return None if keys is None else hashlib.blake2b(keys.client_secret, person=b"nodes").digest()


def seal(obj: Any) -> bytes:
    """msgpack, behind an HMAC of the cluster secret when there is one."""
    data = msgspec.msgpack.encode(obj)
    key = _mac_key()
    if key is None:
        return b"T0" + data
    return b"T1" + hmac.new(key, data, "sha256").digest() + data


def unseal(raw: bytes, kind: type[Any], what: str) -> Any:
    """The value `seal` made; `ValueError` saying why it is refused."""
    key = _mac_key()
    if raw[:2] == b"T1" and key is not None:
        tag, data = raw[2:34], raw[34:]
        if not hmac.compare_digest(tag, hmac.new(key, data, "sha256").digest()):
            raise ValueError(f"{what} is not sealed with this cluster's secret")
    elif raw[:2] == b"T0" and key is None:
        data = raw[2:]
    elif raw[:2] in (b"T0", b"T1"):
        sides = "the other side has a cluster secret and this one has none"
        if key is not None:
            sides = "this side has a cluster secret and the other has none"
        raise ValueError(f"{what}: {sides} (give every node the same --cluster-secret-file)")
    else:
        raise ValueError(f"{what} is not a treadle value")
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except msgspec.ValidationError as e:
        raise ValueError(f"{what} is malformed: {e}") from None


# -- addresses and the store -----------------------------------------------------------------


def node_ip(master_addr: str) -> str:
    """This node's address as the others reach it: TREADLE_HOST_IP, else the interface that
    routes to the master (no packet is sent)."""
    chosen = envs.host_ip()
    if chosen is not None:
        return chosen
    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))
            return str(s.getsockname()[0])
    except OSError:
        return master_addr


def put(store: dist.Store, key: str, value: bytes) -> None:
    store.set(key, value)  # type: ignore[arg-type]  # (bytes are stored as they are)


def client(host: str, port: int) -> SecureStore:
    """A client of node 0's store; a call that the store does not answer in 5 s fails (the
    engine core is gone)."""
    return SecureStore(host, port, timeout=timedelta(seconds=30), reply_s=CALL_REPLY_S)
