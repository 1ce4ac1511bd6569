"""Shared by the visualizer's browser tests: a real `tokenriver serve`, Debian's Chromium, and page helpers.

Debian's Chromium (/usr/bin/chromium) runs headless under Playwright's Python API; each test module starts one
server on a free port with the embedded default model and one browser. Screenshots go to
test-artifacts/visualizer/. Set TOKENRIVER_TEST_SERVER_URL to run against an already running server instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(
        "Debian's Chromium is not installed at /usr/bin/chromium (apt-get install chromium)", allow_module_level=True
    )
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "visualizer"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_TIMEOUT = 240.0
GENERATION_TIMEOUT_MS = 90_000
# Sampling settings typed into the page and sent to the API directly for the reference.
TEMPERATURE = 0.8
SEED = 11
MAX_TOKENS = 6
TRACE_TOP = 12
PROMPT = "What are the three primary colors?"
# The main page applies the chat template: the templated prompt is long enough to fill whole KV blocks, so a
# branch finds them in the prefix cache.
CHAT_REQUEST = {"messages": [{"role": "user", "content": PROMPT}], "add_generation_prompt": True}
# Wraps the page's fetch so a server-sent-event stream reaches the page one event at a time, `ms` apart.
PACE_EVENT_STREAMS = """ms => { const realFetch = window.fetch;
  window.fetch = async (...args) => {
    const response = await realFetch(...args);
    if (!(response.headers.get('content-type') || '').startsWith('text/event-stream')) return response;
    const reader = response.body.getReader(), decoder = new TextDecoder(), encoder = new TextEncoder();
    let buffer = '';
    const body = new ReadableStream({ async pull(controller) {
      for (;;) {
        const match = /\\r?\\n\\r?\\n/.exec(buffer);
        if (match) {
          const event = buffer.slice(0, match.index + match[0].length);
          buffer = buffer.slice(event.length);
          await new Promise(resolve => setTimeout(resolve, ms));
          controller.enqueue(encoder.encode(event));
          return;
        }
        const { value, done } = await reader.read();
        if (done) { if (buffer) controller.enqueue(encoder.encode(buffer)); controller.close(); return; }
        buffer += decoder.decode(value, { stream: true });
      }
    } });
    return new Response(body, { status: response.status, statusText: response.statusText,
                                headers: response.headers });
  }; }"""
PACE_MS = 60
# Chromium logs every non-2xx fetch as a console error; expected only where a test provokes an API error.
HTTP_ERROR_LOG = "Failed to load resource"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request(base_url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base_url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait_healthy(base_url: str, process: subprocess.Popen | None, log_path: Path | None) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            pytest.fail(f"`tokenriver serve` exited with code {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    pytest.fail(f"`tokenriver serve` did not answer /health within {SERVER_START_TIMEOUT:.0f} s")


@contextlib.contextmanager
def running_server(extra_args: tuple[str, ...] = (), name: str = "server") -> Iterator[str]:
    """A real `tokenriver serve` with the default model on a free local port (or TOKENRIVER_TEST_SERVER_URL)."""
    external = os.environ.get("TOKENRIVER_TEST_SERVER_URL")
    if external and not extra_args:
        wait_healthy(external.rstrip("/"), None, None)
        yield external.rstrip("/")
        return
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = ARTIFACTS / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            # The defaults, as `make run` serves: the tests compare a step's replays and a speculative run with the
            # recorded tokens, bit for bit.
            [sys.executable, "-m", "tokenriver.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *extra_args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log_path)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class ConsoleWatch:
    """Console errors and uncaught exceptions of one page."""

    def __init__(self, page: object) -> None:
        self.errors: list[str] = []
        page.on("console", lambda message: self.errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: self.errors.append(f"pageerror: {error}"))

    def unexpected(self, allowed: tuple[str, ...] = ()) -> list[str]:
        return [e for e in self.errors if not any(e.startswith(prefix) for prefix in allowed)]


def open_page(browser: object, base_url: str, width: int = 1280, height: int = 800) -> tuple[object, ConsoleWatch]:
    page = browser.new_page(viewport={"width": width, "height": height})
    watch = ConsoleWatch(page)
    page.goto(base_url + "/")
    page.wait_for_selector("[data-testid=prompt-token]")
    page.wait_for_selector("[data-testid=server-status]:has-text('ready')")
    return page, watch


def fill_kept(page: object, selector: str, value: str, attempts: int = 5) -> None:
    """Fill an input of a panel the page may rebuild, and check through a fresh query that the page kept the value.

    Why: a panel rebuilt while Playwright fills its input (a step's inspection arriving) leaves the value in the
    detached input, and the rebuilt one keeps what it held before (a user's keystrokes go to the focused, rebuilt
    input; Playwright's go to the element it resolved). Once the live input holds the value, later rebuilds keep it.
    """
    for _ in range(attempts):
        page.fill(selector, value)
        if page.input_value(selector) == value:
            return
    raise AssertionError(f"{selector} did not keep {value!r} after {attempts} fills")


def set_controls(page: object, **values: str) -> None:
    page.evaluate("document.querySelector('.more-settings').open = true")
    for element_id, value in values.items():
        page.fill(f"#{element_id}", value)


def wait_finished(page: object, branch_count: int = 1) -> None:
    page.wait_for_function(
        """n => { const rows = document.querySelectorAll('[data-testid=tree-row]');
                  return rows.length === n && !document.body.classList.contains('busy'); }""",
        arg=branch_count,
        timeout=GENERATION_TIMEOUT_MS,
    )


def path_token_ids(page: object) -> list[int]:
    return [int(x) for x in page.eval_on_selector_all("[data-testid=token]", "els => els.map(e => e.dataset.tokenId)")]


def candidates(page: object) -> list[dict]:
    return page.eval_on_selector_all(
        "[data-testid=candidate]",
        """els => els.map(e => ({
        tokenId: Number(e.dataset.tokenId), rank: Number(e.dataset.rank), probRaw: Number(e.dataset.probRaw),
        probFinal: Number(e.dataset.probFinal), probPreview: Number(e.dataset.probPreview),
        logit: Number(e.dataset.logit),
        isChosen: e.dataset.chosen === 'true', hasChosenClass: e.classList.contains('chosen'),
        rawWidth: parseFloat(e.querySelector('[data-testid=bar-raw]').style.width)}))""",
    )


def reference_completion(base_url: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """The same request the page makes, without streaming: the engine's own answer."""
    body = {
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": TEMPERATURE,
        "seed": SEED,
        "trace": True,
        "trace_top": TRACE_TOP,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    return request(base_url, "/v1/completions", body)["choices"][0]


def screenshot(page: object, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


def doc_screenshot(page: object, selector: str | None, name: str) -> None:
    """With TOKENRIVER_UPDATE_SCREENSHOT=1, save a screenshot for docs/ (of one element, or the whole page)."""
    if os.environ.get("TOKENRIVER_UPDATE_SCREENSHOT") != "1":
        return
    path = ROOT / "docs" / name
    if selector is None:
        page.screenshot(path=str(path), full_page=True)
    else:
        page.locator(selector).screenshot(path=str(path))


def wait_idle(page: object) -> None:
    """Until no request of the page is running (the body loses its `busy` class)."""
    page.wait_for_function("!document.body.classList.contains('busy')", timeout=GENERATION_TIMEOUT_MS)


def row_count(page: object) -> int:
    return page.locator("[data-testid=tree-row]").count()


def select_token(page: object, step: int) -> None:
    """Click the token chip of `step` and wait for "why this token" to show it."""
    page.click(f"[data-testid=token][data-step='{step}']")
    page.wait_for_selector(f"[data-testid=why-step][data-step='{step}']")


# An in-page stand-in for axe-core's contrast and focus rules (no network, no library): every visible text's
# contrast against the colour behind it (WCAG AA: 4.5:1, 3:1 for large text), and every focusable control named
# and drawn with a visible focus indicator. Returns the violations, each a short description.
ACCESSIBILITY_JS = """() => {
  const parse = c => { const m = c.match(/[\\d.]+/g); if (!m) return null;
    const [r, g, b, a] = m.map(Number); return {r, g, b, a: a === undefined ? 1 : a}; };
  const lum = ({r, g, b}) => [r, g, b].map(v => { v /= 255;
    return v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; })
    .reduce((s, v, i) => s + v * [0.2126, 0.7152, 0.0722][i], 0);
  const blend = (top, under) => ({r: top.r * top.a + under.r * (1 - top.a), g: top.g * top.a + under.g * (1 - top.a),
    b: top.b * top.a + under.b * (1 - top.a), a: 1});
  // The colour behind an element: its own and its ancestors' backgrounds, composed; null behind an image.
  const behind = el => { const layers = [];
    for (let e = el; e; e = e.parentElement) { const s = getComputedStyle(e);
      if (s.backgroundImage !== 'none') return null;
      const c = parse(s.backgroundColor); if (c && c.a > 0) { layers.push(c); if (c.a === 1) break; } }
    return layers.reverse().reduce((under, top) => blend(top, under), {r: 255, g: 255, b: 255, a: 1}); };
  const visible = el => { const r = el.getBoundingClientRect(); const s = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && s.visibility !== 'hidden' && s.opacity !== '0' && !el.closest('[hidden]')
      && !el.closest('.visually-hidden'); };
  const problems = [];
  for (const el of document.querySelectorAll('body *')) {
    if (el.closest('svg') || !visible(el)) continue;
    const hasText = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
    if (!hasText) continue;
    const s = getComputedStyle(el); const bg = behind(el); if (!bg) continue;
    const fg = blend(parse(s.color), bg);
    const ratio = (Math.max(lum(fg), lum(bg)) + 0.05) / (Math.min(lum(fg), lum(bg)) + 0.05);
    const size = parseFloat(s.fontSize); const bold = Number(s.fontWeight) >= 700;
    const needed = size >= 24 || (bold && size >= 18.66) ? 3 : 4.5;
    if (ratio < needed) problems.push(`contrast ${ratio.toFixed(2)} < ${needed}: ${el.tagName.toLowerCase()}.`
      + `${el.className} "${el.textContent.trim().slice(0, 30)}"`);
  }
  const focusable = [...document.querySelectorAll(
    'button, input, select, textarea, a[href], summary, [tabindex]')].filter(e => visible(e) && e.tabIndex >= 0
    && !e.disabled);
  for (const el of focusable) {
    if (el.tabIndex > 0) problems.push(`positive tabindex breaks the focus order: ${el.id || el.className}`);
    const label = el.getAttribute('aria-label') || el.textContent.trim() || (el.labels && el.labels.length
      && el.labels[0].textContent.trim()) || el.getAttribute('title') || el.closest('label');
    if (!label) problems.push(`focusable without a name: ${el.tagName.toLowerCase()}#${el.id}.${el.className}`);
  }
  return problems; }"""


def focus_order(page: object, presses: int) -> list[dict]:
    """Tab through the page from the top: each focused element, and whether its focus is drawn."""
    # A click on the (unfocusable) heading moves the sequential focus starting point to the top of the page.
    page.click("h1")
    seen = []
    for _ in range(presses):
        page.keyboard.press("Tab")
        seen.append(
            page.evaluate("""() => { const e = document.activeElement; const s = getComputedStyle(e);
            return {tag: e.tagName.toLowerCase(), id: e.id, testid: e.dataset.testid || '',
                    top: e.getBoundingClientRect().top + window.scrollY,
                    drawn: (s.outlineStyle !== 'none' && parseFloat(s.outlineWidth) > 0)
                           || s.boxShadow !== 'none'}; }""")
        )
    return seen
