"""Images from strangers: a chat part's `image_url` (a `data:` URI, a `file://` path under
`--allowed-local-media-path`, an `http(s)://` URL of a host in `--allowed-media-domains`)
turned into a decoded RGB picture, or an `InvalidRequest` naming the part.

What is refused before any pixel is decoded: a body over `max_bytes` (a data URI's base64 is
measured before it is decoded); a format outside PNG, JPEG, WebP and GIF (Pillow is told to
try no other decoder: no SVG, no EPS through Ghostscript, no TIFF); more pixels than
`max_pixels` (read from the header: a few KB that declare 30,000 x 30,000 never allocate
900 MB); a path that resolves (`..`, symlinks) outside the allowed folder; a host not
allowed, or one that resolves to a loopback, private, link-local or reserved address, on
every redirect hop too. A GIF gives its first frame only (its other frames are never read).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import os
import socket
import ssl
import urllib.parse
import warnings
from dataclasses import dataclass

from PIL import Image

from treadle.validation import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""The decoders Pillow may use (`Image.open(formats=...)`); anything else is refused."""
MIME_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how big they may be (the CLI's image flags)."""

    allowed_local_path: str | None = None
    """`file://` URLs are taken only under this folder (a real path); None: never."""
    allowed_domains: tuple[str, ...] = ()
    """Hosts that `http(s)://` URLs may name (exact, lower case); empty: none."""
    allow_private_addresses: bool = False
    """Whether a host may resolve to a loopback, private or link-local address."""
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 25_000_000
    fetch_timeout_s: float = 10.0


def load_image(url: object, policy: MediaPolicy, where: str) -> Image.Image:
    """The RGB picture `url` names; raises `InvalidRequest(where, ...)` for anything refused
    (`where` names the part, e.g. "messages[0].content[1].image_url")."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest(where, "needs a url string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_uri(url, policy, where)
    elif scheme == "file":
        data = _local_file(url, policy, where)
    elif scheme in ("http", "https"):
        data = _fetch(url, policy, where)
    else:
        raise InvalidRequest(
            where, f"has an unsupported url scheme {scheme or url[:16]!r} (data:, file:, http(s):)"
        )
    return decode_image(data, policy, where)


def decode_image(data: bytes, policy: MediaPolicy, where: str) -> Image.Image:
    """Bytes -> an RGB picture (transparency over white, as Hugging Face's processors do),
    refusing what the module docstring lists before decoding a pixel."""
    if len(data) > policy.max_bytes:
        raise InvalidRequest(where, f"is {len(data)} bytes, over this server's {policy.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width <= 0 or height <= 0 or width * height > policy.max_pixels:
                raise InvalidRequest(
                    where,
                    f"declares {width} x {height} pixels, more than this server decodes "
                    f"({policy.max_pixels} pixels)",
                )
            image.seek(0)  # a GIF's first frame; its others are never read
            image.load()
    except InvalidRequest:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own check, at open: over 2 x 89 M
        raise InvalidRequest(
            where, f"declares more pixels than this server decodes ({policy.max_pixels}): {e}"
        ) from None
    except Image.UnidentifiedImageError as e:
        raise InvalidRequest(
            where, f"is not an image this server decodes ({', '.join(FORMATS)}): {e}"
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombWarning) as e:
        raise InvalidRequest(where, f"could not be decoded: {type(e).__name__}: {e}") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited over white (as transformers' `convert_to_rgb`)."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _data_uri(url: str, policy: MediaPolicy, where: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep:
        raise InvalidRequest(where, "is a data URI without a ',' before its data")
    meta = head[len("data:") :].split(";")
    mime = meta[0].strip().lower()
    if mime not in MIME_TYPES:
        raise InvalidRequest(
            where, f"has media type {mime or 'none'!r}; this server takes {sorted(MIME_TYPES)}"
        )
    if "base64" not in (m.strip().lower() for m in meta[1:]):
        raise InvalidRequest(where, "must be base64 (data:image/...;base64,...)")
    if len(body) * 3 // 4 > policy.max_bytes:  # measured before anything is decoded
        raise InvalidRequest(
            where, f"holds about {len(body) * 3 // 4} bytes, over this server's {policy.max_bytes}"
        )
    try:
        return base64.b64decode(body.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(where, f"is not valid base64: {e}") from None


def _local_file(url: str, policy: MediaPolicy, where: str) -> bytes:
    if policy.allowed_local_path is None:
        raise InvalidRequest(
            where, "is a file:// URL, which this server takes only with --allowed-local-media-path"
        )
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidRequest(where, f"names the host {parsed.netloc!r}; file:// URLs are local")
    path = os.path.realpath(urllib.parse.unquote(parsed.path))  # resolves `..` and symlinks
    root = policy.allowed_local_path
    if os.path.commonpath([path, root]) != root:
        raise InvalidRequest(where, f"is outside the allowed folder {root}")
    try:
        with open(path, "rb") as f:
            data = f.read(policy.max_bytes + 1)
    except OSError as e:
        raise InvalidRequest(where, f"cannot be read: {e.strerror or e}") from None
    if len(data) > policy.max_bytes:
        raise InvalidRequest(where, f"is over this server's {policy.max_bytes} bytes")
    return data


def _check_host(host: str, port: int, policy: MediaPolicy, where: str) -> None:
    """The host is allowed by name and every address it resolves to is a public one."""
    if host.lower().rstrip(".") not in policy.allowed_domains:
        allowed = ", ".join(policy.allowed_domains) or "none: see --allowed-media-domains"
        raise InvalidRequest(where, f"names the host {host!r}, not an allowed one ({allowed})")
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except OSError as e:
        raise InvalidRequest(where, f"names a host that does not resolve: {e}") from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not policy.allow_private_addresses and not address.is_global:
            raise InvalidRequest(
                where, f"resolves to {address}, a non-public address this server does not fetch"
            )


def _fetch(url: str, policy: MediaPolicy, where: str) -> bytes:
    """GET with at most `MAX_REDIRECTS` hops, each one's host checked, a size and a time cap."""
    for _ in range(MAX_REDIRECTS + 1):
        parsed = urllib.parse.urlparse(url)
        host = parsed.hostname or ""
        https = parsed.scheme == "https"
        port = parsed.port or (443 if https else 80)
        _check_host(host, port, policy, where)
        conn: http.client.HTTPConnection = (
            http.client.HTTPSConnection(
                host, port, timeout=policy.fetch_timeout_s, context=ssl.create_default_context()
            )
            if https
            else http.client.HTTPConnection(host, port, timeout=policy.fetch_timeout_s)
        )
        try:
            path = parsed.path or "/"
            conn.request("GET", path + (f"?{parsed.query}" if parsed.query else ""))
            response = conn.getresponse()
            if response.status in (301, 302, 303, 307, 308):
                target = response.getheader("Location") or ""
                url = urllib.parse.urljoin(url, target)
                if urllib.parse.urlparse(url).scheme not in ("http", "https"):
                    raise InvalidRequest(where, "redirects to a URL that is not http(s)")
                continue
            if response.status != 200:
                raise InvalidRequest(where, f"answered HTTP {response.status}")
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > policy.max_bytes:
                raise InvalidRequest(where, f"is {length} bytes, over this server's limit")
            data = response.read(policy.max_bytes + 1)
            if len(data) > policy.max_bytes:
                raise InvalidRequest(where, f"is over this server's {policy.max_bytes} bytes")
            return data
        except (OSError, http.client.HTTPException) as e:
            raise InvalidRequest(where, f"could not be fetched: {type(e).__name__}: {e}") from None
        finally:
            conn.close()
    raise InvalidRequest(where, f"redirects more than {MAX_REDIRECTS} times")
