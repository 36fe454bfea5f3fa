"""Headless Chromium driven over the DevTools protocol (websocket), for tests of pages that
treadle serves; and a PNG reader to check that a screenshot shows something.

Chromium is Debian's `chromium` package, which `make test` installs (the Makefile's
`chromium` target)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import re
import shutil
import struct
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

INSTALL_HINT = "chromium is not installed: `make test` installs it (its `chromium` step)"


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """One headless browser with one page; `close()` kills it (by pid)."""

    def __init__(self, workdir: Path, timeout: float = 30.0) -> None:
        exe = chromium_path()
        if exe is None:
            raise FileNotFoundError(INSTALL_HINT)
        self.log_path = workdir / "chromium.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [
                exe,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--window-size=1400,1100",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
                f"--user-data-dir={workdir / 'profile'}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        self._ids = itertools.count(1)
        self.ws: ClientConnection | None = None
        try:
            self.ws = connect(self._devtools_url(timeout), max_size=None, open_timeout=timeout)
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            attached = self.call("Target.attachToTarget", targetId=target, flatten=True)
            self.session = attached["sessionId"]
            self.page("Page.enable")
        except BaseException:
            self.close()
            raise

    def _devtools_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"DevTools listening on (ws://\S+)", self.log_path.read_text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"chromium did not start:\n{self.log_path.read_text()}")

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its reply (events in between are dropped)."""
        assert self.ws is not None
        call_id = next(self._ids)
        message: dict[str, Any] = {"id": call_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        self.ws.send(json.dumps(message))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == call_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        return self.call(method, self.session, **params)

    def evaluate(self, expression: str) -> Any:
        reply = self.page(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Evaluate until the value is truthy; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.2)

    def screenshot(self, scale: float = 1.0) -> bytes:
        """The whole page as a PNG (`scale` < 1: smaller, quicker to check)."""
        size = self.page("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": scale}
        data = self.page(
            "Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True
        )
        return base64.b64decode(data["data"])

    def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                self.ws.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._log.close()


def check_screenshot(png: bytes) -> None:
    """A real picture: sizable, many colours, no colour covering nearly all of it."""
    width, height, rows = png_pixels(png)
    assert width > 300 and height > 300, (width, height)
    bpp = len(rows[0]) // width
    counts: dict[bytes, int] = {}
    for row in rows[::3]:
        for i in range(0, len(row), bpp * 3):
            pixel = row[i : i + 3]
            counts[pixel] = counts.get(pixel, 0) + 1
    total = sum(counts.values())
    assert len(counts) > 30, f"only {len(counts)} colours"
    assert max(counts.values()) / total < 0.9, "one colour covers the page"


def png_pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit RGB or RGBA PNG."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", b""
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, body = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), f"unexpected PNG format: depth {depth}, color {color}"
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, rows
