"""ZMQ sockets and addresses for the front end <-> engine core channels (ARCHITECTURE §2).

- `make_zmq_socket` binds by default, except PUSH, SUB and XSUB, which connect. High-water marks
  of ROUTER, DEALER, PUSH and PULL are 0 (no limit); XPUB is verbose (it sees every
  subscription). Sockets it makes remove the ipc socket files they bound when they close.
- Local peers talk over `ipc://$TREADLE_RPC_BASE_PATH/<uuid4>` (socket files mode 0600); remote
  ones over tcp, binding port 0 and reading the real port back from LAST_ENDPOINT, never probing
  for a free port first (that races). With a cluster secret every tcp socket speaks CURVE
  with keys derived from it (`cluster_auth.py`): a peer without the secret is refused and logged.
- On the ROUTER/DEALER pair each engine connection has a random routing identity, bound to
  the engine's DP rank by its first message (`engine_auth.py`). Each message to an engine is
  `[identity][type byte][msgpack][aux...]`, the type byte an `EngineCoreRequestType`.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import socket
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import zmq

from treadle import envs
from treadle.ipc import cluster_auth
from treadle.logger import init_logger
from treadle.wire.engine import EngineCoreRequestType

__all__ = [
    "EngineCoreRequestType",
    "get_bound_address",
    "get_ip",
    "get_open_zmq_ipc_path",
    "get_tcp_uri",
    "make_zmq_socket",
    "split_zmq_path",
    "zmq_socket_ctx",
]

logger = init_logger(__name__)

_CONNECT_TYPES = (zmq.PUSH, zmq.SUB, zmq.XSUB)
_UNLIMITED_HWM_TYPES = (zmq.ROUTER, zmq.DEALER, zmq.PUSH, zmq.PULL)
_IPC_PATH_MAX = 107  # sun_path is 108 bytes on Linux, NUL included

# ipc socket files bound and not removed yet -> the pid that bound them (a forked child must not
# remove its parent's files). Removed at exit at the latest.
_bound_ipc_files: dict[str, int] = {}


def close_context(ctx: zmq.Context[Any], sockets: list[zmq.Socket[Any]], pid: int) -> None:
    """Close `sockets` (emptying the list) and terminate `ctx`, which ends its IO threads;
    nothing in a forked child of process `pid` (it holds copies of its parent's)."""
    if os.getpid() != pid:
        return
    for sock in sockets:
        with contextlib.suppress(zmq.ZMQError):
            sock.close()
    sockets.clear()
    with contextlib.suppress(zmq.ZMQError):
        ctx.term()


def get_open_zmq_ipc_path() -> str:
    """A fresh `ipc://` address in `TREADLE_RPC_BASE_PATH` (default: the temp dir)."""
    base = envs.rpc_base_path()
    path = os.path.join(base, str(uuid.uuid4()))
    if len(path) > _IPC_PATH_MAX:
        raise ValueError(
            f"ipc socket path {path!r} is longer than {_IPC_PATH_MAX} bytes; set "
            "TREADLE_RPC_BASE_PATH to a shorter directory"
        )
    return f"ipc://{path}"


def get_tcp_uri(host: str, port: int) -> str:
    """`tcp://host:port`, with brackets around an IPv6 host."""
    if _is_ipv6(host):
        return f"tcp://[{host}]:{port}"
    return f"tcp://{host}:{port}"


def split_zmq_path(path: str) -> tuple[str, str, str]:
    """`tcp://[::1]:5555` -> ("tcp", "::1", "5555"); `ipc:///tmp/x` -> ("ipc", "/tmp/x", "")."""
    scheme, sep, rest = path.partition("://")
    if not sep or not rest:
        raise ValueError(f"invalid zmq address {path!r}")
    if scheme in ("ipc", "inproc"):
        return scheme, rest, ""
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise ValueError(f"invalid zmq address {path!r}: expected host:port")
    return scheme, host.strip("[]"), port


def get_ip() -> str:
    """This host's address as other hosts would reach it: TREADLE_HOST_IP, else the interface
    that routes outward (no packet is sent); 127.0.0.1 if none."""
    chosen = envs.host_ip()
    if chosen is not None:
        return chosen
    for family, probe in (
        (socket.AF_INET, ("8.8.8.8", 80)),
        (socket.AF_INET6, ("2001:4860::", 80)),
    ):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(probe)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return "127.0.0.1"


def get_bound_address(sock: zmq.Socket[Any]) -> str:
    """The address `sock` last bound, with the real port when it bound `tcp://host:0`."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class _CleanupMixin:
    """Removes the ipc socket files this socket bound when it closes (libzmq leaves them)."""

    _treadle_ipc_files: list[str]

    def close(self, linger: int | None = None) -> None:
        super().close(linger)  # type: ignore[misc]
        for path in self._treadle_ipc_files:
            _remove_ipc_file(path)
        self._treadle_ipc_files = []


_socket_classes: dict[type, type] = {}


def _socket_class(ctx: zmq.Context[Any]) -> type:
    base = ctx._socket_class
    cls = _socket_classes.get(base)
    if cls is None:
        cls = type(f"Treadle{base.__name__}", (_CleanupMixin, base), {})
        _socket_classes[base] = cls
    return cls


def make_zmq_socket(
    ctx: zmq.Context[Any],
    path: str,
    socket_type: int,
    bind: bool | None = None,
    identity: bytes | None = None,
    linger: int | None = None,
    options: dict[int, int] | None = None,
) -> zmq.Socket[Any]:
    """Make a socket on `ctx` (sync or asyncio) and bind or connect it to `path`.

    `bind=None` binds every type except PUSH, SUB and XSUB. Binding `tcp://host:0` picks a free
    port: read it back with `get_bound_address`. ipc files are made 0600 and removed on close.
    `options` are set before the bind or connect (e.g. heartbeats).
    """
    sock: zmq.Socket[Any] = ctx.socket(socket_type, socket_class=_socket_class(ctx))
    sock._treadle_ipc_files = []  # type: ignore[attr-defined]
    try:
        if socket_type in _UNLIMITED_HWM_TYPES:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        if socket_type == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if linger is not None:
            sock.setsockopt(zmq.LINGER, linger)
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        scheme, host, _ = split_zmq_path(path)
        if scheme == "tcp" and _is_ipv6(host):
            sock.setsockopt(zmq.IPV6, 1)
        if bind is None:
            bind = socket_type not in _CONNECT_TYPES
        if scheme == "tcp":
            cluster_auth.secure(sock, bind)
        if bind:
            sock.bind(path)
            if scheme == "ipc":
                os.chmod(host, 0o600)
                sock._treadle_ipc_files.append(host)  # type: ignore[attr-defined]
                _bound_ipc_files[host] = os.getpid()
        else:
            sock.connect(_from_host_ip(path) if scheme == "tcp" else path)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _from_host_ip(path: str) -> str:
    """`tcp://dest` from TREADLE_HOST_IP when set (libzmq's `tcp://source;dest`): the peer and
    /topology see this host's chosen address, not whichever one the kernel picks."""
    source = envs.host_ip()
    if source is None or ";" in path:
        return path
    _, host, _ = split_zmq_path(path)
    if _is_ipv6(source) != _is_ipv6(host):
        return path  # a v4 source cannot reach a v6 peer (or the reverse)
    src = f"[{source}]" if _is_ipv6(source) else source
    return f"tcp://{src}:0;{path.removeprefix('tcp://')}"


@contextlib.contextmanager
def zmq_socket_ctx(
    path: str,
    socket_type: int,
    bind: bool | None = None,
    linger: int = 0,
    identity: bytes | None = None,
) -> Iterator[zmq.Socket[Any]]:
    """A socket on its own context, closed and the context terminated on exit."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = make_zmq_socket(ctx, path, socket_type, bind=bind, identity=identity, linger=linger)
        try:
            yield sock
        finally:
            sock.close(linger=linger)
    finally:
        ctx.term()


_ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's flags: a listening socket


def ipc_listening(address: str) -> bool:
    """Whether some process listens on the ipc socket `address` now (Linux's /proc/net/unix;
    False where that cannot be read). A front end that stopped or died does not."""
    path = split_zmq_path(address)[1]
    with contextlib.suppress(OSError, ValueError), open("/proc/net/unix") as table:
        for line in table:
            fields = line.split()
            if len(fields) == 8 and fields[7] == path and int(fields[3], 16) & _ACCEPTING:
                return True
    return False


def remove_ipc_files(addresses: Iterable[str]) -> None:
    """Remove the socket files of `ipc://` addresses that a child bound and, killed, could not
    remove itself (call once the child is gone)."""
    for address in addresses:
        scheme, path, _ = split_zmq_path(address)
        if scheme == "ipc":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _remove_ipc_file(path: str) -> None:
    if _bound_ipc_files.pop(path, None) != os.getpid():
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).version == 6
    except ValueError:
        return False


@atexit.register
def _remove_leftover_ipc_files() -> None:
    for path in list(_bound_ipc_files):
        _remove_ipc_file(path)
