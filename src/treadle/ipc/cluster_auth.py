"""The cluster secret: tcp sockets only a holder of the secret can talk to (issue 22, item 4).

A socket between hosts is an open door unless something keys it: vLLM's multi-node sockets
were CVE-2025-30165 (anyone who could reach the port could send pickles). With a secret set
(`--cluster-secret-file F`, or `TREADLE_CLUSTER_SECRET` / `TREADLE_CLUSTER_SECRET_FILE` in
the environment, the same on every host), every tcp socket treadle makes speaks ZMQ CURVE:

- two Curve25519 key pairs come from the secret (blake2b, one per role): the server pair for
  sockets that bind, the client pair for sockets that connect. A peer that does not hold the
  secret cannot compute the server's public key, so it cannot even open the handshake;
- each process that binds a tcp socket runs a ZAP handler (a thread on that socket's context)
  that admits only the client key, so a leaked server key alone is not enough;
- a peer that is refused (no CURVE, the wrong secret, the wrong key) is logged with its address,
  from the socket's monitor (the handshake failure, then the disconnect of that connection);
- traffic is encrypted as well.

ipc sockets are local files (mode 0600) and are left as they are. Nothing that crosses hosts is
unpickled anyway: every message is msgpack (`ipc/serial.py`). Without a secret, a deployment
whose sockets face another host is refused at start-up (`ParallelConfig.check`) unless
`--insecure-cluster` says the user accepts open sockets.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import os
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from treadle.logger import init_logger

logger = init_logger(__name__)

ENV_SECRET = "TREADLE_CLUSTER_SECRET"
ENV_SECRET_FILE = "TREADLE_CLUSTER_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
ZAP_DOMAIN = b"treadle"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_REFUSAL_LOG_INTERVAL_S = 10.0  # one line per peer host per interval
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | _FAILED | zmq.EVENT_MONITOR_STOPPED


@dataclass(frozen=True)
class ClusterKeys:
    """z85 keys (40 characters) derived from the secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def read_secret_file(path: str) -> bytes:
    """The secret in `path` (a trailing newline dropped), checked. Raises ValueError saying what
    to change."""
    try:
        with open(path, "rb") as f:
            secret = f.read(MAX_SECRET_BYTES + 1)
    except OSError as e:
        raise ValueError(f"--cluster-secret-file {path!r}: {e.strerror or e}") from None
    return _checked(secret.rstrip(b"\r\n"), f"--cluster-secret-file {path!r}")


def _checked(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{where}: the cluster secret is {len(secret)} bytes; use at least "
            f"{MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > cluster.secret`)"
        )
    if len(secret) > MAX_SECRET_BYTES:
        raise ValueError(f"{where}: the cluster secret is over {MAX_SECRET_BYTES} bytes")
    return secret


def use_secret_file(path: str) -> None:
    """Check `path` and make it this process's secret, and its children's (through the
    environment, which spawned children inherit)."""
    read_secret_file(path)
    os.environ[ENV_SECRET_FILE] = os.path.abspath(path)
    os.environ.pop(ENV_SECRET, None)


def configured() -> bool:
    return bool(os.environ.get(ENV_SECRET) or os.environ.get(ENV_SECRET_FILE))


def cluster_keys() -> ClusterKeys | None:
    """This process's keys, or None without a secret. Raises ValueError for a bad secret."""
    text, path = os.environ.get(ENV_SECRET), os.environ.get(ENV_SECRET_FILE)
    if text:
        return _keys(_checked(text.encode(), ENV_SECRET))
    if path:
        return _keys(read_secret_file(path))
    return None


@functools.lru_cache(maxsize=4)
def _keys(secret: bytes) -> ClusterKeys:
    def pair(role: bytes) -> tuple[bytes, bytes]:
        raw = hashlib.blake2b(secret, digest_size=32, person=role).digest()
        private = z85.encode(raw)
        return zmq.curve_public(private), private

    server_public, server_secret = pair(b"treadle-server")
    client_public, client_secret = pair(b"treadle-client")
    return ClusterKeys(server_public, server_secret, client_public, client_secret)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine's loopback only."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def secure(sock: zmq.Socket[Any], bind: bool) -> None:
    """Make a tcp socket (before its bind or connect) a CURVE server or client with the
    cluster's keys; nothing without a secret."""
    keys = cluster_keys()
    if keys is None:
        return
    if bind:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        _Gate.of(sock.context, keys).watch(sock)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class _Gate:
    """One per ZMQ context that binds CURVE sockets: a thread answering ZAP requests (only the
    cluster's client key gets in) and reading the sockets' monitors to log who was refused.
    It ends when the context is terminated."""

    _gates: dict[tuple[int, int], _Gate] = {}  # (pid, context address) -> gate
    _lock = threading.Lock()

    @classmethod
    def of(cls, ctx: zmq.Context[Any], keys: ClusterKeys) -> _Gate:
        key = (os.getpid(), ctx.underlying)
        with cls._lock:
            gate = cls._gates.get(key)
            if gate is None:
                gate = cls._gates[key] = cls(ctx, keys, key)
            return gate

    def __init__(self, ctx: zmq.Context[Any], keys: ClusterKeys, key: tuple[int, int]) -> None:
        self._key = key
        self._client = z85.decode(keys.client_public)
        self._ctx: zmq.Context[Any] = zmq.Context.shadow(ctx.underlying)
        self._zap = self._ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)
        self._wake_addr = f"inproc://treadle-gate-{uuid.uuid4().hex}"
        self._wake = self._ctx.socket(zmq.PULL)
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.bind(self._wake_addr)
        self._pending: list[str] = []  # monitor addresses to connect, from other threads
        self._pending_lock = threading.Lock()
        self._logged: dict[str, float] = {}
        threading.Thread(target=self._run, name="treadle-zap", daemon=True).start()

    def watch(self, sock: zmq.Socket[Any]) -> None:
        """Log the peers this socket refuses (called by the socket's owner, before its bind)."""
        addr = f"inproc://treadle-monitor-{uuid.uuid4().hex}"
        sock.monitor(addr, _MONITORED)
        with self._pending_lock:
            self._pending.append(addr)
        with self._ctx.socket(zmq.PUSH) as poke:
            poke.setsockopt(zmq.LINGER, 0)
            poke.connect(self._wake_addr)
            poke.send(b"", zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        monitors: dict[zmq.Socket[Any], dict[str, Any]] = {}
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is self._zap:
                        self._answer(self._zap.recv_multipart())
                    elif sock is self._wake:
                        self._wake.recv()
                        with self._pending_lock:
                            pending, self._pending = self._pending, []
                        for addr in pending:
                            mon = self._ctx.socket(zmq.PAIR)
                            mon.setsockopt(zmq.LINGER, 0)
                            mon.connect(addr)
                            poller.register(mon, zmq.POLLIN)
                            monitors[mon] = {"peers": {}, "failed": 0, "queue": deque()}
                    else:
                        if not self._events(sock, monitors[sock]):
                            poller.unregister(sock)
                            del monitors[sock]
                            sock.close()
        except zmq.ContextTerminated:
            pass
        finally:
            for sock in [self._zap, self._wake, *monitors]:
                sock.close(linger=0)
            with self._lock:
                self._gates.pop(self._key, None)

    def _answer(self, frames: list[bytes]) -> None:
        """ZAP 1.0 (RFC 27): admit the cluster's client key only."""
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        ok = (
            mechanism == b"CURVE"
            and len(credentials) == 1
            and hmac.compare_digest(credentials[0], self._client)
        )
        if not ok:
            self._refused(
                address.decode(errors="replace") or "?", "a key that is not the cluster's"
            )
        status = (b"200", b"OK") if ok else (b"400", b"not a member of this cluster")
        self._zap.send_multipart([version, request_id, *status, b"", b""])

    def _events(self, mon: zmq.Socket[Any], state: dict[str, Any]) -> bool:
        """Read the monitor's waiting events, in order; False once it has stopped (its socket
        closed)."""
        queue: deque[dict[str, Any]] = state["queue"]
        _drain(mon, queue)
        while queue:
            if not self._event(mon, queue.popleft(), state):
                return False
        return True

    def _event(self, mon: zmq.Socket[Any], event: dict[str, Any], state: dict[str, Any]) -> bool:
        kind, value, endpoint = event["event"], event["value"], event["endpoint"]
        peers: dict[int, str] = state["peers"]
        if kind == zmq.EVENT_MONITOR_STOPPED:
            return False
        if kind == zmq.EVENT_ACCEPTED:
            peers[value] = _peer_of(value)
            # libzmq reports a connection's disconnect before it closes its fd, and the fd
            # may then serve another connection of this process (once in CI a refusal named
            # such a neighbour). So the address read is this connection's only if its
            # disconnect is not yet among the events waiting behind this one.
            queue: deque[dict[str, Any]] = state["queue"]
            _drain(mon, queue)
            for later in queue:
                if later["value"] == value and later["event"] == zmq.EVENT_ACCEPTED:
                    break
                if later["value"] == value and later["event"] == zmq.EVENT_DISCONNECTED:
                    peers[value] = "?"
                    break
        elif kind & _FAILED:
            state["failed"] += 1
        elif kind == zmq.EVENT_DISCONNECTED:
            peer = peers.pop(value, "?")
            if state["failed"]:
                # The io thread reports a failed handshake and then that connection's
                # disconnect, one after the other: this is the refused peer's.
                state["failed"] -= 1
                where = endpoint.decode(errors="replace")
                self._refused(peer, f"no CURVE handshake with the cluster's keys on {where}")
        return True

    def _refused(self, peer: str, why: str) -> None:
        host = peer.rsplit(":", 1)[0] if peer.count(":") == 1 else peer
        now = time.monotonic()
        if now - self._logged.get(host, -1e9) < _REFUSAL_LOG_INTERVAL_S:
            return  # a refused peer reconnects every 100 ms or so: one line per host
        if len(self._logged) > 1024:
            self._logged.clear()
        self._logged[host] = now
        logger.warning(
            "Refused a peer at %s: %s (it does not hold the cluster secret: "
            "--cluster-secret-file / TREADLE_CLUSTER_SECRET)",
            peer,
            why,
        )


def _drain(mon: zmq.Socket[Any], queue: deque[dict[str, Any]]) -> None:
    """Append every event already waiting on the monitor socket `mon` to `queue`."""
    while mon.poll(0, zmq.POLLIN):
        queue.append(dict(parse_monitor_message(mon.recv_multipart())))


def _peer_of(fd: int) -> str:
    """The remote address of libzmq's connection `fd` (read through a duplicate)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            host, port = s.getpeername()[:2]
            return f"{host}:{port}"
    except OSError:
        return "?"
