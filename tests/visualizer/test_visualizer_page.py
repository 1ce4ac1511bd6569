"""Browser tests of the generation visualizer against a real `tokenriver serve`.

Debian's Chromium (/usr/bin/chromium) runs headless under Playwright's Python API; the server is started once
per module on a free port with the embedded default model. The page is checked against the server itself: the
tokens it shows are the tokens the API returns for the same seed, a branch's continuation is what the API
returns for the branch's prompt, and the bars are the trace's probabilities.

Screenshots go to test-artifacts/visualizer/. Set TOKENRIVER_UPDATE_SCREENSHOT=1 to also copy the main one to
docs/visualizer.png. Set TOKENRIVER_TEST_SERVER_URL to run against an already running server instead.
"""

from __future__ import annotations

import json
import math
import os
import shutil
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
    pytest.skip("Debian's Chromium is not installed at /usr/bin/chromium (apt-get install chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
expect = sync_api.expect

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "visualizer"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _request(base_url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base_url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_healthy(base_url: str, process: subprocess.Popen | None, log_path: Path | None) -> None:
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


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """A real `tokenriver serve` with the default model on a free local port."""
    external = os.environ.get("TOKENRIVER_TEST_SERVER_URL")
    if external:
        _wait_healthy(external.rstrip("/"), None, None)
        yield external.rstrip("/")
        return
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log_path = ARTIFACTS / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tokenriver.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log_path)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class ConsoleWatch:
    """Console errors and uncaught exceptions of one page."""

    def __init__(self, page: object) -> None:
        self.errors: list[str] = []
        page.on("console", lambda message: self.errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: self.errors.append(f"pageerror: {error}"))

    def unexpected(self, allowed: tuple[str, ...] = ()) -> list[str]:
        return [e for e in self.errors if not any(e.startswith(prefix) for prefix in allowed)]


def _open_page(browser: object, base_url: str, width: int = 1280, height: int = 800) -> tuple[object, ConsoleWatch]:
    page = browser.new_page(viewport={"width": width, "height": height})
    watch = ConsoleWatch(page)
    page.goto(base_url + "/")
    page.wait_for_selector("[data-testid=prompt-token]")
    return page, watch


def _set_controls(page: object, **values: str) -> None:
    for element_id, value in values.items():
        page.fill(f"#{element_id}", value)


def _wait_finished(page: object, branch_count: int = 1) -> None:
    page.wait_for_function(
        """n => { const rows = document.querySelectorAll('[data-testid=tree-row]');
                  return rows.length === n && !document.body.classList.contains('busy'); }""",
        arg=branch_count, timeout=GENERATION_TIMEOUT_MS)


def _path_token_ids(page: object) -> list[int]:
    return [int(x) for x in page.eval_on_selector_all("[data-testid=token]", "els => els.map(e => e.dataset.tokenId)")]


def _candidates(page: object) -> list[dict]:
    return page.eval_on_selector_all("[data-testid=candidate]", """els => els.map(e => ({
        tokenId: Number(e.dataset.tokenId), rank: Number(e.dataset.rank), probRaw: Number(e.dataset.probRaw),
        probFinal: Number(e.dataset.probFinal), probTemp: Number(e.dataset.probTemp),
        isChosen: e.dataset.chosen === 'true', hasChosenClass: e.classList.contains('chosen'),
        rawWidth: parseFloat(e.querySelector('[data-testid=bar-raw]').style.width)}))""")


def _reference_completion(base_url: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """The same request the page makes, without streaming: the engine's own answer."""
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": TEMPERATURE, "seed": SEED,
            "trace": True, "trace_top": TRACE_TOP, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
    return _request(base_url, "/v1/completions", body)["choices"][0]


def _screenshot(page: object, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


@pytest.fixture(scope="module")
def generated(browser: object, base_url: str) -> Iterator[tuple[object, ConsoleWatch]]:
    """One page that has generated MAX_TOKENS tokens from PROMPT; tests below inspect and branch it."""
    page, watch = _open_page(browser, base_url)
    page.fill("#prompt", PROMPT)
    page.check("#chat-template")
    _set_controls(page, **{"max-tokens": str(MAX_TOKENS), "seed": str(SEED), "trace-top": str(TRACE_TOP)})
    page.fill("#temperature", str(TEMPERATURE))
    # The engine can write all MAX_TOKENS tokens before the page reads the first network chunk, so the stream is
    # paced to one event per PACE_MS: whether partial paths show up then depends on the page, not on speed.
    page.evaluate(PACE_EVENT_STREAMS, PACE_MS)
    # Record every token count the page shows while the stream comes in.
    page.evaluate("""() => { window.seenTokenCounts = [];
        new MutationObserver(() => window.seenTokenCounts.push(
            document.querySelectorAll('#tokens [data-testid=token]').length))
          .observe(document.getElementById('tokens'), {childList: true}); }""")
    page.click("#generate")
    _wait_finished(page)
    yield page, watch
    page.close()


def test_prompt_tokens_match_the_tokenizer(generated: tuple, base_url: str) -> None:
    page, watch = generated
    expected = _request(base_url, "/tokenize", CHAT_REQUEST)
    shown = [int(x) for x in page.eval_on_selector_all("[data-testid=prompt-token]",
                                                       "els => els.map(e => e.dataset.tokenId)")]
    assert shown == expected["tokens"]
    assert watch.unexpected() == []


def test_generated_tokens_are_the_engines(generated: tuple, base_url: str) -> None:
    page, watch = generated
    prompt_ids = _request(base_url, "/tokenize", CHAT_REQUEST)["tokens"]
    reference = _reference_completion(base_url, prompt_ids, MAX_TOKENS)
    expected_ids = [step["chosen_token_id"] for step in reference["trace"]]
    assert _path_token_ids(page) == expected_ids
    # The engine view states the forward passes: one per decode token after the prefill's.
    assert int(page.inner_text("[data-testid=num-forward-passes]")) == len(expected_ids)
    assert page.locator("[data-testid=decode-pass]").count() == len(expected_ids) - 1
    assert int(page.inner_text("[data-testid=kv-blocks]")) >= 1
    assert watch.unexpected() == []


def test_tokens_stream_in_one_by_one(generated: tuple) -> None:
    page, watch = generated
    counts = set(page.evaluate("window.seenTokenCounts"))
    # Partial paths were on screen before the last token arrived (SSE read as it streams, not at the end).
    assert len(counts & set(range(1, MAX_TOKENS))) >= 2, counts
    assert watch.unexpected() == []


def test_bars_of_a_selected_step(generated: tuple, base_url: str) -> None:
    page, watch = generated
    step = 1
    page.click(f"[data-testid=token][data-step='{step}']")
    page.wait_for_selector(f"[data-testid=why-step]:has-text('step {step} of')")
    chosen_id = int(page.get_attribute(f"[data-testid=token][data-step='{step}']", "data-token-id"))
    candidates = _candidates(page)
    assert len(candidates) >= TRACE_TOP
    assert sum(c["probRaw"] for c in candidates) <= 1 + 1e-6
    assert sum(c["probFinal"] for c in candidates) <= 1 + 1e-6
    assert all(0 <= c["probRaw"] <= 1 and 0 <= c["probFinal"] <= 1 for c in candidates)
    assert [c["rank"] for c in candidates] == sorted(c["rank"] for c in candidates)
    for c in candidates:
        assert c["rawWidth"] == pytest.approx(c["probRaw"] * 100, abs=0.01)
    chosen = [c for c in candidates if c["isChosen"]]
    assert len(chosen) == 1 and chosen[0]["tokenId"] == chosen_id and chosen[0]["hasChosenClass"]
    assert page.inner_text("[data-testid=why-rank]") == str(chosen[0]["rank"])
    _screenshot(page, "selected-step.png")
    assert watch.unexpected() == []


def test_keyboard_moves_between_tokens_and_selects(generated: tuple) -> None:
    page, watch = generated
    page.focus("[data-testid=token][data-step='0']")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.dataset.step") == "2"
    # The focused token is visibly marked (the :focus-visible outline).
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") == "solid"
    page.keyboard.press("Enter")
    page.wait_for_selector("[data-testid=why-step]:has-text('step 2 of')")
    assert page.get_attribute("[data-testid=token][data-step='2']", "aria-pressed") == "true"
    assert watch.unexpected() == []


def test_temperature_reshapes_the_bars(generated: tuple) -> None:
    page, watch = generated
    page.click("[data-testid=token][data-step='0']")
    page.wait_for_selector("[data-testid=why-step]:has-text('step 0 of')")
    page.fill("#temperature", "0.5")
    cold = _candidates(page)
    page.fill("#temperature", "1.6")
    hot = _candidates(page)
    assert [c["tokenId"] for c in cold] == [c["tokenId"] for c in hot]
    # Renormalized over the shown candidates; a hotter softmax moves mass away from the top candidate.
    assert sum(c["probTemp"] for c in hot) == pytest.approx(1, abs=1e-6)
    assert hot[0]["probTemp"] < cold[0]["probTemp"]
    assert [c["probTemp"] for c in hot] != [c["probTemp"] for c in cold]
    page.fill("#temperature", "0")
    assert [c["probTemp"] for c in _candidates(page)][0] == 1
    page.fill("#temperature", str(TEMPERATURE))
    assert watch.unexpected() == []


def test_branch_starts_with_the_clicked_token(generated: tuple, base_url: str) -> None:
    page, watch = generated
    # Fork where the model was least sure (not the last step, so the branch generates something).
    probs = page.eval_on_selector_all("[data-testid=token]", "els => els.map(e => Number(e.dataset.prob))")
    step = min(range(1, MAX_TOKENS - 1), key=lambda i: probs[i])
    page.click(f"[data-testid=token][data-step='{step}']")
    page.wait_for_selector(f"[data-testid=why-step]:has-text('step {step} of')")
    parent_ids = _path_token_ids(page)
    alternative = page.locator("button[data-testid=candidate]").first
    clicked_id = int(alternative.get_attribute("data-token-id"))
    assert clicked_id != parent_ids[step]
    alternative.click()
    _wait_finished(page, branch_count=2)
    branch_ids = _path_token_ids(page)
    assert branch_ids[:step] == parent_ids[:step]
    assert branch_ids[step] == clicked_id
    assert page.get_attribute(f"[data-testid=token][data-step='{step}']", "class").split().count("forced") == 1
    # The branch continues exactly as the engine does from prompt + path + clicked token.
    prompt_ids = _request(base_url, "/tokenize", CHAT_REQUEST)["tokens"]
    reference = _reference_completion(base_url, prompt_ids + branch_ids[:step + 1], MAX_TOKENS - step - 1)
    assert branch_ids[step + 1:] == [s["chosen_token_id"] for s in reference["trace"]]
    # Its cumulative log-probability is the sum of its tokens' log p_raw.
    probs = [float(p) for p in page.eval_on_selector_all("[data-testid=token]", "els => els.map(e => e.dataset.prob)")]
    assert float(page.inner_text("[data-testid=path-logprob]")) == pytest.approx(sum(map(math.log, probs)), abs=0.01)
    rows = page.locator("[data-testid=tree-row]")
    expect(rows).to_have_count(2)
    page.click("[data-testid=tree-toggle]")
    expect(rows).to_have_count(1)
    page.click("[data-testid=tree-toggle]")
    expect(rows).to_have_count(2)
    page.locator("[data-testid=compare-check]").nth(0).check()
    page.locator("[data-testid=compare-check]").nth(1).check()
    expect(page.locator("[data-testid=compare-item]")).to_have_count(2)
    page.click(f"[data-testid=token][data-step='{step}']")
    shot = _screenshot(page, "branch.png")
    if os.environ.get("TOKENRIVER_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "visualizer.png")
    assert watch.unexpected() == []


def test_api_error_is_shown(browser: object, base_url: str) -> None:
    page, watch = _open_page(browser, base_url)
    _set_controls(page, **{"top-p": "0", "max-tokens": "2"})
    page.click("#generate")
    page.wait_for_selector("[data-testid=error]:not([hidden])")
    assert "top_p" in page.inner_text("[data-testid=error-message]")
    assert "param: top_p" in page.inner_text("[data-testid=error-detail]")
    assert page.get_attribute("#top-p", "aria-invalid") == "true"
    assert watch.unexpected(allowed=(HTTP_ERROR_LOG,)) == []
    page.close()


def test_narrow_screen_has_no_horizontal_scroll(browser: object, base_url: str) -> None:
    page, watch = _open_page(browser, base_url, width=400, height=800)
    _set_controls(page, **{"max-tokens": "3", "seed": str(SEED)})
    page.fill("#prompt", "Once upon a time")
    expected = _request(base_url, "/tokenize", {"prompt": "Once upon a time"})["tokens"]
    page.wait_for_function("n => document.querySelectorAll('[data-testid=prompt-token]').length === n",
                           arg=len(expected))
    page.click("#generate")
    _wait_finished(page)
    shown = page.eval_on_selector_all("[data-testid=prompt-token]", "els => els.map(e => Number(e.dataset.tokenId))")
    assert shown == expected
    page.click("[data-testid=token][data-step='0']")
    assert page.evaluate("document.documentElement.scrollWidth") <= 400
    _screenshot(page, "narrow.png")
    assert watch.unexpected() == []
    page.close()
