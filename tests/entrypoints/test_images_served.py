"""Images sent to `treadle serve` as a user sends them (issue 39): the real `openai` client
with chat `image_url` parts (a data URI, a `file://` path under --allowed-local-media-path)
gets transformers' greedy text on a tiny random LLaVA; usage counts the image tokens; every
hostile image is a 400 that names its part, and the server answers the same text after."""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from llava_helpers import Reference, bomb_png, random_image
from serve_helpers import RemoteServer

QUESTION = "What is in the picture?"
PROMPT = f"USER: <image>\n{QUESTION} ASSISTANT:"
MAX = 10


def data_uri(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "GIF": "gif", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str, text: str = QUESTION, **extra: Any) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url, **extra}},
                {"type": "text", "text": text},
            ],
        }
    ]


@pytest.fixture(scope="module")
def reference(llava_reference: Reference) -> Reference:
    return llava_reference


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    random_image(1).save(folder / "cat.png")
    outside = tmp_path_factory.mktemp("outside")
    random_image(2).save(outside / "secret.png")
    os.symlink(outside / "secret.png", folder / "link.png")
    return folder


class MediaHost:
    """A small HTTP server on 127.0.0.1 that the tests name as `localhost`: an image, a
    redirect to another host (127.0.0.1, not allowed), a redirect loop, a declared 1 GB body."""

    def __init__(self) -> None:
        import http.server
        import threading

        png = io.BytesIO()
        random_image(9).save(png, format="PNG")
        body = png.getvalue()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                port = self.server.server_address[1]
                if self.path == "/cat.png":
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/out":
                    self.send_response(302)
                    self.send_header("Location", f"http://127.0.0.1:{port}/cat.png")
                    self.end_headers()
                elif self.path == "/loop":
                    self.send_response(302)
                    self.send_header("Location", "/loop")
                    self.end_headers()
                else:
                    self.send_response(200)
                    self.send_header("Content-Length", str(1 << 30))
                    self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()
        self.image = Image.open(io.BytesIO(body)).convert("RGB")

    def url(self, path: str) -> str:
        return f"http://localhost:{self.port}{path}"

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture(scope="module")
def media_host() -> Iterator[MediaHost]:
    host = MediaHost()
    yield host
    host.stop()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, llava: Path, media: Path
) -> Iterator[RemoteServer]:
    # Images of `localhost` (this machine: private addresses allowed for the test), pixels
    # through the tensor ring in vLLM's spelling.
    srv = RemoteServer(
        [
            str(llava),
            "--allowed-media-domains",
            "localhost",
            "--mm-tensor-ipc",
            "torch_shm",
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--limit-mm-per-prompt",
            '{"image": 2}',
            "--allowed-local-media-path",
            str(media),
        ],
        tmp_path_factory.mktemp("images-served"),
        env={"TREADLE_MEDIA_ALLOW_PRIVATE_ADDRESSES": "1"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX,
        temperature=0,
    )


def test_a_data_uri_image_gives_transformers_text(
    client: openai.OpenAI, reference: Reference
) -> None:
    image = random_image(3)
    out = chat(client, image_message(data_uri(image)))
    expected = reference.greedy(PROMPT, [image], MAX)
    assert out.choices[0].message.content == reference.tokenizer.decode(
        expected, skip_special_tokens=True
    )
    # usage counts the image's 576 tokens as prompt tokens
    assert out.usage.prompt_tokens == len(reference.prompt_ids(PROMPT))


def metrics(client: openai.OpenAI) -> dict[str, float]:
    """The server's /metrics samples (summed over their labels) by name."""
    text = httpx.get(str(client.base_url).replace("/v1/", "/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_a_file_under_the_allowed_folder(
    client: openai.OpenAI, reference: Reference, media: Path
) -> None:
    image = Image.open(media / "cat.png").convert("RGB")
    out = chat(client, image_message((media / "cat.png").as_uri()))
    expected = reference.greedy(PROMPT, [image], MAX)
    text = reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert out.choices[0].message.content == text
    # The same image again: the encoder does not run again (its features are cached).
    before = metrics(client)
    again = chat(client, image_message((media / "cat.png").as_uri()))
    assert again.choices[0].message.content == text
    after = metrics(client)
    assert after["treadle:mm_encoder_images_total"] == before["treadle:mm_encoder_images_total"]
    assert (
        after["treadle:mm_encoder_cache_hits_total"] > before["treadle:mm_encoder_cache_hits_total"]
    )
    assert after["treadle:request_images_count"] == before["treadle:request_images_count"] + 1


def test_two_images_in_one_message(client: openai.OpenAI, reference: Reference) -> None:
    a, b = random_image(4), random_image(5, 300, 600)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(a)}},
                {"type": "image_url", "image_url": {"url": data_uri(b, "JPEG")}},
                {"type": "text", "text": "Which is brighter?"},
            ],
        }
    ]
    out = chat(client, messages)
    # transformers reads the JPEG as the server decodes it
    b_jpeg = Image.open(io.BytesIO(base64.b64decode(data_uri(b, "JPEG").split(",")[1])))
    expected = reference.greedy(
        "USER: <image>\n<image>\nWhich is brighter? ASSISTANT:", [a, b_jpeg.convert("RGB")], MAX
    )
    assert out.choices[0].message.content == reference.tokenizer.decode(
        expected, skip_special_tokens=True
    )


HOSTILE = {
    "not-an-image": "data:image/png;base64," + base64.b64encode(b"hello, world").decode(),
    "truncated-png": None,  # filled below
    "bomb": "data:image/png;base64," + base64.b64encode(bomb_png(30_000, 30_000, 8)).decode(),
    "svg": "data:image/svg+xml;base64,"
    + base64.b64encode(b'<svg xmlns="http://www.w3.org/2000/svg"/>').decode(),
    "bmp-in-png-clothes": None,  # filled below
    "not-base64": "data:image/png;base64,@@@@",
    "file-outside": "file:///etc/passwd",
    "file-dotdot": None,  # filled below
    "file-symlink-out": None,  # filled below
    "http-not-allowed": "http://127.0.0.1:1/x.png",
    "metadata-service": "http://169.254.169.254/latest/meta-data",
    "ftp": "ftp://example.com/x.png",
}


def hostile_urls(media: Path) -> dict[str, str]:
    png = io.BytesIO()
    random_image(6).save(png, format="PNG")
    bmp = io.BytesIO()
    random_image(7, 40, 40).save(bmp, format="BMP")
    urls = dict(HOSTILE)
    urls["truncated-png"] = (
        "data:image/png;base64,"
        + base64.b64encode(png.getvalue()[: len(png.getvalue()) // 2]).decode()
    )
    urls["bmp-in-png-clothes"] = (
        "data:image/png;base64," + base64.b64encode(bmp.getvalue()).decode()
    )
    urls["file-dotdot"] = f"file://{media}/../{media.name}/../../../etc/passwd"
    urls["file-symlink-out"] = (media / "link.png").as_uri()
    return {k: v for k, v in urls.items() if v is not None}


def test_every_hostile_image_is_a_400_naming_its_part(
    server: RemoteServer, client: openai.OpenAI, media: Path, reference: Reference
) -> None:
    model = client.models.list().data[0].id
    for name, url in hostile_urls(media).items():
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": model, "messages": image_message(url), "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert (
            "messages[0].content[0].image_url" in (error.get("param") or "") + error["message"]
        ), (name, error)
    # The server serves the same text after all of them.
    test_a_data_uri_image_gives_transformers_text(client, reference)


def test_limits_and_shapes_are_refused(server: RemoteServer, client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    url = data_uri(random_image(8, 64, 64))
    three = [{"type": "image_url", "image_url": {"url": url}}] * 3
    for body, needle in (
        ({"messages": [{"role": "user", "content": three}]}, "limit-mm-per-prompt"),
        ({"messages": image_message(url, detail="high")}, "detail"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "input_audio",
        ),
        ({"messages": image_message(url), "truncate_prompt_tokens": 100}, "cannot cut"),
        (
            {"messages": [{"role": "user", "content": "a literal <image> without an image"}]},
            "placeholder",
        ),
    ):
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": model, "max_tokens": 2, **body},
            timeout=30,
        )
        assert r.status_code == 400, (body, r.text)
        assert needle in r.text, (needle, r.text)


def image_streams(client: openai.OpenAI, urls: list[str], max_tokens: int) -> Any:
    """One greedy chat stream per image, in threads; (futures, tokens seen per stream)."""
    import concurrent.futures

    seen = [0] * len(urls)
    model = client.models.list().data[0].id

    def one(i: int) -> str:
        stream = client.chat.completions.create(
            model=model,
            messages=image_message(urls[i]),  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                seen[i] += 1
        return text

    pool = concurrent.futures.ThreadPoolExecutor(len(urls))
    return [pool.submit(one, i) for i in range(len(urls))], seen, pool


def test_kill_9_of_the_engine_core_under_8_image_streams_resumes_them(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    import signal
    import time

    urls = [data_uri(random_image(30 + i, 200 + 10 * i, 300)) for i in range(8)]
    futures, _, pool = image_streams(client, urls, 40)
    undisturbed = [f.result(120) for f in futures]
    pool.shutdown()
    futures, seen, pool = image_streams(client, urls, 40)
    deadline = time.monotonic() + 120
    while min(seen) < 3:
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    os.kill(server.pid_of("treadle::EngineCore_DP0"), signal.SIGKILL)
    resumed = [f.result(180) for f in futures]
    pool.shutdown()
    assert resumed == undisturbed
    assert "resuming" in server.output()


def test_an_http_image_of_an_allowed_host_and_what_is_refused(
    server: RemoteServer, client: openai.OpenAI, reference: Reference, media_host: MediaHost
) -> None:
    out = chat(client, image_message(media_host.url("/cat.png")))
    expected = reference.greedy(PROMPT, [media_host.image], MAX)
    assert out.choices[0].message.content == reference.tokenizer.decode(
        expected, skip_special_tokens=True
    )
    model = client.models.list().data[0].id
    for path, needle in (
        ("/out", "127.0.0.1"),  # a redirect out of the allowed hosts
        ("/loop", "redirects more than"),
        ("/huge", "over this server"),
    ):
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": model, "messages": image_message(media_host.url(path)), "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 400, (path, r.text)
        assert needle in r.text and "image_url" in r.text, (path, r.text)


def test_tokenize_counts_the_image_tokens(server: RemoteServer, reference: Reference) -> None:
    r = httpx.post(
        server.url + "/tokenize",
        json={"messages": image_message(data_uri(random_image(3)))},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(reference.prompt_ids(PROMPT))


def test_a_real_bomb_never_decodes_in_the_api_server(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    """A valid 6,000 x 6,000 PNG of ~100 KB (108 MB of pixels decoded, 137 MiB of RSS when
    Pillow decodes it): refused from its header, the API server's peak RSS unchanged."""
    api = server.proc.pid  # one API server: the `treadle serve` process itself

    def peak_kib() -> int:
        with open(f"/proc/{api}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    before = peak_kib()
    url = "data:image/png;base64," + base64.b64encode(bomb_png(6000, 6000)).decode()
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": client.models.list().data[0].id,
            "messages": image_message(url),
            "max_tokens": 2,
        },
        timeout=30,
    )
    assert r.status_code == 400 and "pixels" in r.text, r.text
    assert peak_kib() - before < 32 * 1024
