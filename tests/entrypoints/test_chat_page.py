"""The chat page (`GET /` and `/chat`) on one real server behind `--api-key` and `--root-path`:
served without a key and self-contained; in headless Chromium (DevTools protocol) it asks for
the key, streams an answer, stops one, sends its settings, and draws model output as markdown
without ever turning it into HTML."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chromium import INSTALL_HINT, Chromium, check_screenshot, chromium_path

from serve_helpers import RemoteServer

KEY = "chat-s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 16384
"""The served model's context: room for an answer long enough to be stopped."""
LAST = "window.chat.messages[window.chat.messages.length - 1]"
PAYLOAD = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:  # type: ignore[no-untyped-def]
    # The tiny model with a longer context (its weights are position-free: RoPE).
    tiny = Path(tiny_model_factory("llama"))
    model = tmp_path_factory.mktemp("chat-model")
    for f in tiny.iterdir():
        shutil.copy(f, model / f.name)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (model / "config.json").write_text(json.dumps(config))
    args = [str(model), "--served-model-name", "tiny", "--api-key", KEY, "--root-path", "/proxy"]
    srv = RemoteServer(args, tmp_path_factory.mktemp("chat"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    if chromium_path() is None:
        pytest.fail(INSTALL_HINT)
    chromium = Chromium(tmp_path_factory.mktemp("chromium"))
    yield chromium
    chromium.close()


def test_the_page_is_served_without_a_key_and_self_contained(server: RemoteServer) -> None:
    for path in ("/", "/chat", "/proxy/", "/proxy/chat"):
        page = httpx.get(server.url + path, timeout=10)
        assert page.status_code == 200, path
        assert page.headers["content-type"].startswith("text/html"), path
        assert 'id="prompt"' in page.text and 'href="dashboard"' in page.text, path
    # No CDN, no remote font or script: nothing that names a URL with a scheme, and no
    # absolute path (it would miss the --root-path prefix).
    assert re.findall(r"https?://|//[\w.-]+\.\w+/", page.text) == []
    assert re.findall(r"""(?:src|href)=["']/""", page.text) == []
    assert "fetch(BASE + path" in page.text
    assert httpx.get(server.url + "/proxy/v1/models", timeout=10).status_code == 401


def _open(browser: Chromium, url: str) -> None:
    browser.page("Page.navigate", url=url)
    assert browser.wait_for("document.readyState === 'complete' && window.chat !== undefined")


def _ask(browser: Chromium, question: str) -> None:
    """Type the question into the box and press Enter, as a person would."""
    browser.evaluate("document.getElementById('prompt').focus()")
    browser.page("Input.insertText", text=question)
    for kind in ("keyDown", "keyUp"):
        browser.page(
            "Input.dispatchKeyEvent",
            type=kind,
            key="Enter",
            code="Enter",
            windowsVirtualKeyCode=13,
            **({"text": "\r"} if kind == "keyDown" else {}),
        )


def _set(browser: Chromium, field: str, value: str) -> None:
    browser.evaluate(
        f"(e => {{ e.value = {json.dumps(value)}; e.dispatchEvent(new Event('change')); }})"
        f"(document.getElementById({json.dumps(field)}))"
    )


def _metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf"^treadle:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"metric {name} missing"
    return float(m.group(1))


def test_asks_for_the_key_streams_an_answer_and_stops_it(
    server: RemoteServer, browser: Chromium
) -> None:
    _open(browser, server.url + "/proxy/chat")
    browser.evaluate("localStorage.clear()")
    _open(browser, server.url + "/proxy/chat")
    # No key yet: /v1/models answered 401, so the page asks for one.
    assert browser.wait_for("!document.getElementById('keyform').hidden")
    browser.evaluate(f"document.getElementById('keyinput').value = {json.dumps(KEY)}")
    browser.evaluate("document.querySelector('#keyform button').click()")
    assert browser.wait_for("document.getElementById('model').options.length === 1")
    assert browser.evaluate("localStorage.getItem('treadle-api-key')") == KEY
    assert (
        browser.evaluate("document.getElementById('dashboard-link').pathname") == "/proxy/dashboard"
    )

    # Greedy (no end of text in the first thousands of tokens of this model, whatever the
    # run) and no max_tokens: the answer would run to the end of the 16k context.
    _set(browser, "temperature", "0")
    _ask(browser, "Tell me a long story.")
    assert browser.wait_for("window.chat.streaming")
    lengths: list[int] = []
    deadline = time.monotonic() + 60
    while len(set(lengths)) < 3 and time.monotonic() < deadline:
        lengths.append(browser.evaluate(f"{LAST}.content.length"))
        time.sleep(0.1)
    assert len(set(lengths)) >= 3 and lengths == sorted(lengths), lengths  # it streams in
    assert browser.evaluate("window.chat.streaming"), "the answer ended before it could be stopped"
    assert not browser.evaluate("document.getElementById('stop').hidden")
    assert _metric(server, "num_requests_running") == 1
    sent = browser.evaluate("window.chat.lastRequest")
    assert sent["stream"] is True and sent["model"] == "tiny" and sent["temperature"] == 0
    assert sent["messages"] == [{"role": "user", "content": "Tell me a long story."}]
    assert "max_tokens" not in sent

    browser.evaluate("document.getElementById('stop').click()")
    assert browser.wait_for("!window.chat.streaming")
    stopped = browser.evaluate(f"{LAST}.content")
    assert browser.evaluate(f"{LAST}.note") == "stopped" and stopped
    # The server aborted the request: nothing runs, its KV blocks are free.
    deadline = time.monotonic() + 10
    while _metric(server, "num_requests_running") or _metric(server, "kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the server did not abort the stopped request"
        time.sleep(0.2)
    assert browser.evaluate(f"{LAST}.content") == stopped  # nothing came after Stop
    assert not browser.evaluate("document.getElementById('send').hidden")
    # The stopped turn is kept in the browser, with its question.
    kept = json.loads(browser.evaluate("localStorage.getItem('treadle-chat-conversation')"))
    assert [m["role"] for m in kept["messages"]] == ["user", "assistant"]
    assert kept["messages"][1]["content"] == stopped


def _answer(browser: Chromium, question: str) -> dict[str, Any]:
    """Ask, and wait for the whole answer (or the error shown instead)."""
    before = browser.evaluate("window.chat.messages.length")
    _ask(browser, question)
    done = f"window.chat.messages.length >= {before + 2} && !window.chat.streaming"
    assert browser.wait_for(done, timeout=60)
    last: dict[str, Any] = browser.evaluate(LAST)
    return last


def test_settings_go_with_the_request_and_are_kept(server: RemoteServer, browser: Chromium) -> None:
    _open(browser, f"{server.url}/proxy/#key={KEY}")
    browser.evaluate("document.getElementById('newchat').click()")
    browser.evaluate("document.getElementById('toggle-settings').click()")
    assert browser.evaluate("!document.getElementById('settings').hidden")
    _set(browser, "system", "You are terse.")
    _set(browser, "temperature", "0")
    _set(browser, "max-tokens", "5")
    first = _answer(browser, "Hello?")
    assert first["role"] == "assistant" and not first.get("error"), first
    assert first["note"].startswith("finished: length · 5 tokens"), first["note"]
    sent = browser.evaluate("window.chat.lastRequest")
    assert (sent["temperature"], sent["max_tokens"]) == (0, 5)
    assert sent["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello?"},
    ]
    # Kept across a reload; at temperature 0 the same question gets the same answer.
    _open(browser, f"{server.url}/proxy/")
    assert browser.evaluate("document.getElementById('system').value") == "You are terse."
    assert browser.evaluate("document.querySelectorAll('#messages .msg').length") == 2
    browser.evaluate("document.getElementById('newchat').click()")
    assert browser.evaluate("document.querySelectorAll('#messages .msg').length") == 0
    again = _answer(browser, "Hello?")
    assert again["content"] == first["content"]


def test_a_server_error_is_shown_in_the_chat(server: RemoteServer, browser: Chromium) -> None:
    _open(browser, f"{server.url}/proxy/chat#key={KEY}")
    browser.evaluate("document.getElementById('newchat').click()")
    _set(browser, "max-tokens", str(CONTEXT * 2))  # more than the context: a 400
    shown = _answer(browser, "Hello?")
    assert shown["error"] is True and "max_tokens" in shown["content"], shown
    text = browser.evaluate("document.querySelector('#messages .msg.error').textContent")
    assert shown["content"] in text
    _set(browser, "max-tokens", "")


# What the model is made to say (a regex constraint added to the page's request): markdown,
# and an element that would run script if the page ever made HTML of model output.
SAID = f"**Bold** and `code` {PAYLOAD}\n```python\nprint(1 < 2)\n```\n- one\n- two"
FORCE_OUTPUT = """(regex => {
  const original = window.fetch;
  window.alerted = false;
  window.alert = () => { window.alerted = true; };
  window.fetch = (url, options) => {
    if (options && options.body) {
      const body = JSON.parse(options.body);
      body.structured_outputs = { regex };
      options = { ...options, body: JSON.stringify(body) };
    }
    return original(url, options);
  };
})"""
"""Wraps the page's `fetch` so that its requests carry a regex the answer must match."""


def test_markdown_is_drawn_and_model_html_is_shown_as_text(
    server: RemoteServer, browser: Chromium, tmp_path: Path
) -> None:
    _open(browser, f"{server.url}/proxy/chat#key={KEY}")
    browser.evaluate("document.getElementById('newchat').click()")
    regex = "\\n".join(re.escape(line) for line in SAID.split("\n"))
    browser.evaluate(f"{FORCE_OUTPUT}({json.dumps(regex)})")
    said = _answer(browser, "Say it.")
    assert said["content"] == SAID, said

    for reloaded in (False, True):  # drawn as it came, then from the browser's storage
        if reloaded:
            _open(browser, f"{server.url}/proxy/chat")
        last = "document.querySelector('#messages .msg.assistant:last-child .body')"
        assert browser.evaluate(f"{last}.querySelector('strong').textContent") == "Bold"
        assert browser.evaluate(f"{last}.querySelector('p > code').textContent") == "code"
        assert browser.evaluate(
            f"{last}.querySelector('pre > code.language-python').textContent"
        ) == ("print(1 < 2)")
        assert browser.evaluate(f"{last}.querySelectorAll('ul > li').length") == 2
        assert browser.evaluate("document.querySelectorAll('#messages img').length") == 0
        assert PAYLOAD in browser.evaluate(f"{last}.textContent")
        assert browser.evaluate("window.alerted") in (False, None)

    check_screenshot(browser.screenshot(scale=0.5))
