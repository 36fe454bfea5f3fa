"""A `torch.distributed` store whose socket takes the cluster secret (issue 22, item 4).

torch's `TCPStore` authenticates nobody: whoever reaches its port can read and rewrite the
rendezvous keys (gloo's addresses, treadle's plans and stage addresses) and so point the ranks
somewhere else. `StoreServer` keeps the same key-value store behind a ZMQ ROUTER that is a
CURVE server with the cluster's keys (`cluster_auth.secure`: a peer without the secret never
completes a handshake, and is logged); `SecureStore` is the `dist.Store` that the ranks hand
to `init_process_group` and use for treadle's own keys, over a DEALER per thread. Without a
secret (loopback, or `--insecure-cluster`) the socket is plain, as before.

Wire: a request is one msgpack frame `[id, op, key(s), value, wait_s]`, a reply
`[id, ok, value or error text]`; nothing is unpickled. Ops: `set`, `get` (waits up to `wait_s`
for the key), `add` (the value kept as decimal text, as TCPStore's), `check`, `wait`, `cas`
(TCPStore's `compare_set`), `del`, `num`. Bounded: keys of at most `MAX_KEY` bytes, values of
at most `MAX_VALUE`, at most `MAX_KEYS` keys, at most `MAX_PARKED` blocking calls waiting; a
malformed request is answered with an error
(or dropped when it has no id) and the server goes on.

A call that gets no reply (the server is gone, e.g. its engine core died) raises
`DistStoreError` after its wait plus `REPLY_S`; a late reply to an earlier call is ignored.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, TypeAlias

import msgspec
import torch.distributed as dist
import zmq

from treadle.ipc import cluster_auth
from treadle.ipc.zmq_utils import close_context, get_tcp_uri
from treadle.logger import init_logger

__all__ = ["SecureStore", "StoreServer"]

logger = init_logger(__name__)

REPLY_S = 10.0
"""A call waits this long past its own wait for the server's answer."""
MAX_KEY = 1024
MAX_VALUE = 64 << 20
MAX_KEYS = 1 << 16
MAX_PARKED = 4096
"""Blocking `get`/`wait` calls waiting at once; one more is refused at once."""
_DEFAULT_TIMEOUT = timedelta(seconds=300)  # TCPStore's

_Request: TypeAlias = tuple[int, str, str | list[str], bytes | int | list[bytes] | None, float]
_Reply: TypeAlias = tuple[int, bool, Any]  # the value: bytes, int, bool, None, or error text

DistStoreError = getattr(dist, "DistStoreError", RuntimeError)


class _Refused(Exception):
    """A request the store cannot serve: the text goes back to the caller."""


class StoreServer:
    """The store itself, served by a thread on a ROUTER bound at `host:port` (0: any free
    port, read back in `port`). `close()` stops it; callers that wait then get no answer."""

    def __init__(self, host: str, port: int = 0) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        cluster_auth.secure(self._sock, bind=True)
        try:
            self._sock.bind(get_tcp_uri(host, port))
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise OSError(f"the store cannot listen on {host}:{port}: {e}") from None
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.host = host
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._data: dict[str, bytes] = {}
        self._parked: list[tuple[float, bytes, int, str, list[str]]] = []
        self._decoder = msgspec.msgpack.Decoder(_Request)
        self._encoder = msgspec.msgpack.Encoder()
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="treadle-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            os.write(self._stop_w, b"x")
            self._thread.join(5)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.close()
            self._ctx.term()
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        while True:
            now = time.monotonic()
            wait_ms = 1000
            if self._parked:
                wait_ms = max(0, min(wait_ms, int((self._parked[0][0] - now) * 1000) + 1))
            events = dict(poller.poll(wait_ms))
            if self._stop_r in events:
                return
            if self._sock in events:
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._serve(frames)
            self._expire(time.monotonic())

    def _reply(self, peer: bytes, rid: int, ok: bool, value: Any) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([peer, self._encoder.encode((rid, ok, value))], zmq.NOBLOCK)

    def _serve(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        peer, payload = frames
        try:
            rid, op, key, value, wait_s = self._decoder.decode(payload)
        except msgspec.DecodeError:
            logger.warning("The store dropped a malformed request (%d bytes)", len(payload))
            return
        try:
            keys = key if isinstance(key, list) else [key]
            if any(len(k) > MAX_KEY for k in keys):
                raise _Refused(f"a key longer than {MAX_KEY} bytes")
            if op in ("get", "wait"):
                if all(k in self._data for k in keys):
                    self._reply(peer, rid, True, self._data[keys[0]] if op == "get" else None)
                elif not 0 <= wait_s <= 24 * 3600:
                    raise _Refused(f"a wait of {wait_s} s")
                elif len(self._parked) >= MAX_PARKED:
                    raise _Refused(f"{MAX_PARKED} calls wait already")
                else:
                    self._parked.append((time.monotonic() + wait_s, peer, rid, op, keys))
                    self._parked.sort(key=lambda p: p[0])
                return
            self._reply(peer, rid, True, self._apply(op, keys, value))
        except _Refused as e:
            self._reply(peer, rid, False, str(e))
            return
        if op in ("set", "add", "cas"):
            self._wake()

    def _apply(self, op: str, keys: list[str], value: Any) -> Any:
        data = self._data
        key = keys[0]
        if op == "check":
            return all(k in data for k in keys)
        if op == "num":
            return len(data)
        if op == "del":
            return data.pop(key, None) is not None
        if key not in data and len(data) >= MAX_KEYS:
            raise _Refused(f"the store holds {MAX_KEYS} keys already")
        if op == "set":
            if not isinstance(value, bytes) or len(value) > MAX_VALUE:
                raise _Refused(f"set takes bytes of at most {MAX_VALUE}")
            data[key] = value
            return None
        if op == "add":
            if not isinstance(value, int) or isinstance(value, bool):
                raise _Refused("add takes an integer")
            try:
                total = int(data.get(key, b"0")) + value
            except ValueError:
                raise _Refused(f"key {key!r} does not hold a number") from None
            data[key] = str(total).encode()
            return total
        if op == "cas":
            if not (isinstance(value, list) and len(value) == 2):
                raise _Refused("cas takes [expected, desired]")
            expected, desired = value
            if len(desired) > MAX_VALUE:
                raise _Refused(f"a value of more than {MAX_VALUE} bytes")
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                data[key] = desired
                return desired
            return expected if current is None else current
        raise _Refused(f"unknown store operation {op!r}")

    def _wake(self) -> None:
        """Answer the parked calls whose keys are all there now."""
        still = []
        for parked in self._parked:
            _, peer, rid, op, keys = parked
            if all(k in self._data for k in keys):
                self._reply(peer, rid, True, self._data[keys[0]] if op == "get" else None)
            else:
                still.append(parked)
        self._parked = still

    def _expire(self, now: float) -> None:
        while self._parked and self._parked[0][0] <= now:
            _, peer, rid, _, keys = self._parked.pop(0)
            self._reply(peer, rid, False, f"timed out waiting for {', '.join(keys)}")


class SecureStore(dist.Store):
    """A client of a `StoreServer` (or of the store a `SecureStore.host` made), usable
    wherever a `dist.Store` is: one DEALER socket per calling thread."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: timedelta = _DEFAULT_TIMEOUT,
        reply_s: float = REPLY_S,
    ) -> None:
        """`timeout`: how long `get`/`wait` wait for a key; `reply_s`: how long past that a
        call waits for the server to answer at all."""
        super().__init__()
        self._reply_s = reply_s
        self.host, self.port = host, port
        self._uri = get_tcp_uri(host, port)
        self._ipv6 = ":" in host
        self._timeout_s = timeout.total_seconds()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sockets: list[zmq.Socket[Any]] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(_Reply)
        self._finalizer = weakref.finalize(
            self, close_context, self._ctx, self._sockets, os.getpid()
        )

    def close(self) -> None:
        self._finalizer()

    def _socket(self) -> zmq.Socket[Any]:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            with self._lock:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if self._ipv6:
                    sock.setsockopt(zmq.IPV6, 1)
                cluster_auth.secure(sock, bind=False)
                sock.connect(self._uri)
                self._sockets.append(sock)
            self._local.sock = sock
        return sock

    def _call(self, op: str, key: str | list[str], value: Any = None, wait_s: float = 0.0) -> Any:
        sock = self._socket()
        rid = next(self._ids)
        sock.send(self._encoder.encode((rid, op, key, value, wait_s)))
        deadline = time.monotonic() + wait_s + self._reply_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                raise DistStoreError(
                    f"the store at {self.host}:{self.port} did not answer {op} in "
                    f"{wait_s + self._reply_s:.0f} s (is its engine core gone?)"
                )
            try:
                got, ok, result = self._decoder.decode(sock.recv())
            except msgspec.DecodeError:
                continue
            if got != rid:
                continue  # a late answer to a call that gave up
            if not ok:
                raise DistStoreError(f"store {op} {key!r}: {result}")
            return result

    # -- dist.Store ----------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        result: bytes = self._call("get", key, wait_s=self._timeout_s)
        return result

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        result: int = self._call("add", key, int(amount))
        return result

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return bool(self._call("check", list(keys)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        wait_s = self._timeout_s if timeout is None else timeout.total_seconds()
        self._call("wait", list(keys), wait_s=wait_s)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:  # type: ignore[override]
        pair = [v.encode() if isinstance(v, str) else bytes(v) for v in (expected, desired)]
        result: bytes = self._call("cas", key, pair)
        return result

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return bool(self._call("del", key))

    def num_keys(self) -> int:  # type: ignore[override]
        result: int = self._call("num", "")
        return result

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        self._timeout_s = timeout.total_seconds()
