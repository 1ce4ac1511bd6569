"""The guided tour against a real `tokenriver serve` with the defaults: one page walks every stop in order.

At each stop the value the dialog states is checked against the engine through its API: the prompt's token ids
against /tokenize, the forward passes against the pass log, the lens's top token against /v1/visualizer/inspect and
the step's recorded trace, every generation against the same request sent again without streaming (the page's
requests are recorded as it sends them), the load's batches against the pass log, the beams against the server's
beam search. The dialog is reached and left with the keyboard (Tab to Start, Enter, arrows, Escape), and Skip and
Restart do what they say. The tests run in file order on one page: each stop starts from where the last one left.

Set TOKENRIVER_UPDATE_SCREENSHOT=1 to refresh docs/tour-NN-<stop>.png, one per stop, cropped to the outlined panel.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import pytest
from visualizer_harness import (
    ACCESSIBILITY_JS,
    ROOT,
    ConsoleWatch,
    open_page,
    path_token_ids,
    request,
    screenshot,
    sync_api,
)

# The stops in the order the issue gives them, by the ids tour.js declares.
STOPS = [
    "tokens",
    "passes",
    "inside",
    "why",
    "temperature",
    "fork",
    "commitment",
    "kv-cache",
    "batching",
    "speculative",
    "beams",
    "stop",
]
TOUR_PROMPT = "The three primary colors are"
# A stop runs at most a few short requests (the load: five of 16 tokens); the first one also warms the engine up.
STOP_TIMEOUT_MS = 120_000
# The docs screenshots: the outlined panel, at most this tall (from the part the stop points at, where it has one).
SHOT_MAX_HEIGHT = 640
# True once the walkthrough article `id` has the focus and lies wholly on screen, clear of the tour's dialog.
ARTICLE_CLEAR = """id => { const article = document.getElementById(id); const r = article.getBoundingClientRect();
    const d = document.getElementById('tour').getBoundingClientRect();
    const clear = r.bottom <= d.top || r.top >= d.bottom || r.right <= d.left || r.left >= d.right;
    return document.activeElement === article && r.top >= -1 && r.bottom <= innerHeight && clear; }"""
# Once the dialog's link has been followed and the page scrolls, panel 7 (above the walkthrough) grows by `px`, as it
# does when its inspection arrives.
GROW_INSIDE_AS_LINK_SCROLLS = """px => document.getElementById('tour-doc').addEventListener('click', () =>
    addEventListener('scroll', () => { const filler = document.createElement('div'); filler.style.height = `${px}px`;
      document.getElementById('inside').append(filler); }, {once: true}), {once: true})"""
# Records every completion body the page sends, so a test can send the very same request to the API.
RECORD_BODIES = """() => { window.sentBodies = []; const realFetch = window.fetch;
    window.fetch = (url, init) => { if (String(url).includes('/v1/completions') && init && init.body)
      window.sentBodies.push(JSON.parse(init.body)); return realFetch(url, init); }; }"""


class Tour:
    """The page walking the tour, and what earlier stops learned that later ones check against."""

    def __init__(self, page: object, watch: ConsoleWatch, base_url: str) -> None:
        self.page = page
        self.watch = watch
        self.base_url = base_url
        self.num_sent = 0
        self.last_pass = 0
        self.seen: dict[str, object] = {}

    def move(self, key: str | None = None, button: str | None = None) -> None:
        """Go to the next stop with a key pressed in the dialog or a click on its button; mark what was sent and
        logged so far, so the stop's own requests and passes can be told apart."""
        self.num_sent = len(self.page.evaluate("window.sentBodies"))
        self.last_pass = last_pass(self.base_url)
        if key:
            self.page.keyboard.press(key)
        else:
            self.page.click(f"[data-testid={button}]")

    def proof(self, index: int) -> dict:
        """Wait for stop `index`'s claim to be filled in by the engine, check the dialog around it, return the value."""
        stop = STOPS[index]
        selector = f"[data-testid=tour][data-stop='{stop}'] [data-testid=tour-proof][data-ready=true]"
        try:
            self.page.wait_for_selector(selector, timeout=STOP_TIMEOUT_MS)
        except sync_api.TimeoutError:
            said = self.page.inner_text("[data-testid=tour]")
            error = self.page.inner_text("#error") if self.page.is_visible("#error") else ""
            pytest.fail(f"stop {index + 1} ({stop}) got no answer: the dialog says {said!r}; error box: {error!r}")
        check_dialog(self.page, index)
        update_screenshot(self.page, index)
        check_walkthrough(self.page, index)
        return json.loads(self.page.get_attribute("[data-testid=tour-proof]", "data-value"))

    def sent(self) -> list[dict]:
        """The completion bodies the page sent since the last move."""
        return self.page.evaluate("window.sentBodies")[self.num_sent :]

    def logged(self) -> list[dict]:
        """The passes the engine logged since the last move."""
        return request(self.base_url, f"/v1/visualizer/passes?since={self.last_pass}")["passes"]


def last_pass(base_url: str) -> int:
    passes = request(base_url, "/v1/visualizer/passes")["passes"]
    return passes[-1]["pass"] if passes else 0


def again(base_url: str, body: dict) -> dict:
    """The page's streamed request, sent again without streaming: the engine's own answer."""
    plain = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    return request(base_url, "/v1/completions", plain)


def check_dialog(page: object, index: int) -> None:
    """The dialog names its stop, links its article in the page's walkthrough (the server serves no docs/), and the
    stop's panel alone is outlined, on screen."""
    assert page.inner_text("[data-testid=tour-count]") == f"Stop {index + 1} of {len(STOPS)}"
    assert page.get_attribute("[data-testid=tour]", "role") == "dialog"
    title_id = page.get_attribute("[data-testid=tour]", "aria-labelledby")
    assert page.inner_text(f"#{title_id}").strip()
    assert page.eval_on_selector("[data-testid=tour-proof]", "e => e.closest('[aria-live]') !== null")
    link = page.get_attribute("[data-testid=tour-doc]", "href")
    assert link == f"#walkthrough-stop-{index + 1}", link
    assert f"stop {index + 1})" in page.inner_text("[data-testid=tour-doc]")
    assert page.locator(f"#walkthrough article{link}").count() == 1
    panel = page.evaluate(f"TOUR_STOPS[{index}].panel")
    page.wait_for_function(
        """s => { const r = document.querySelector(s).getBoundingClientRect();
                  return r.top < innerHeight && r.bottom > 0; }""",
        arg=panel,
        timeout=10_000,
    )
    outlined = page.eval_on_selector_all(".tour-highlight", "els => els.length")
    assert outlined == 1 and page.eval_on_selector(panel, "e => e.classList.contains('tour-highlight')")


def check_walkthrough(page: object, index: int) -> None:
    """A click on the dialog's link opens the walkthrough at the stop's article, scrolls it into view clear of the
    dialog and focuses it; the article quotes the sentence the dialog does, under the stop's title, with what its
    panel shows. The focus then goes back to where it was in the dialog, whose keys move the tour."""
    link = page.get_attribute("[data-testid=tour-doc]", "href")
    focused = page.evaluate_handle("document.activeElement")
    page.click("[data-testid=tour-doc]")
    page.wait_for_function(ARTICLE_CLEAR, arg=link[1:], timeout=10_000)
    assert page.eval_on_selector("#walkthrough details", "e => e.open")
    article = page.locator(link)
    assert article.is_visible()
    sentence = article.locator("[data-testid=walkthrough-claim]").inner_text()
    assert page.inner_text("[data-testid=tour-claim]") == f"“{sentence}”"
    assert article.locator("h3").inner_text() == f"Stop {index + 1}: {page.inner_text('[data-testid=tour-title]')}"
    assert page.inner_text("[data-testid=tour-look]") in article.inner_text()
    focused.evaluate("e => e.focus()")


def update_screenshot(page: object, index: int) -> None:
    """With TOKENRIVER_UPDATE_SCREENSHOT=1, docs/tour-NN-<stop>.png: the outlined panel (from the part the stop points
    at, where it has one), at most SHOT_MAX_HEIGHT tall, without the dialog, in a palette of 256 colours."""
    if os.environ.get("TOKENRIVER_UPDATE_SCREENSHOT") != "1":
        return
    image = pytest.importorskip("PIL.Image")
    box = page.evaluate(
        f"""() => {{ const stop = TOUR_STOPS[{index}];
        const panel = document.querySelector(stop.panel).getBoundingClientRect();
        const detail = stop.detail && document.querySelector(stop.detail);
        const top = detail ? Math.max(panel.top, detail.getBoundingClientRect().top - 48) : panel.top;
        return {{x: panel.left + scrollX - 6, y: top + scrollY - 6, width: panel.width + 12,
                 height: Math.min(panel.bottom - top + 12, {SHOT_MAX_HEIGHT})}}; }}"""
    )
    path = ROOT / "docs" / f"tour-{index + 1:02d}-{STOPS[index]}.png"
    page.evaluate("document.getElementById('tour').style.opacity = '0'")
    page.screenshot(path=str(path), clip=box, full_page=True)
    page.evaluate("document.getElementById('tour').style.opacity = ''")
    image.open(path).convert("RGB").quantize(256).save(path, optimize=True)


@pytest.fixture(scope="module")
def tour(browser: object, base_url: str) -> Iterator[Tour]:
    page, watch = open_page(browser, base_url)
    page.evaluate(RECORD_BODIES)
    yield Tour(page, watch, base_url)
    page.close()


# ---------------------------------------------------------------- the stops, in order


def test_tab_reaches_start_and_enter_opens_the_first_stop(tour: Tour, base_url: str) -> None:
    page = tour.page
    # The walkthrough is in the page, collapsed until the dialog's link opens it.
    assert page.is_visible("#walkthrough summary") and page.is_hidden("#walkthrough-stop-1")
    page.click("h1")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.dataset.testid") == "tour-start"
    assert page.is_hidden("[data-testid=tour]")
    tour.move(key="Enter")
    value = tour.proof(0)
    assert page.evaluate("document.getElementById('tour').contains(document.activeElement)")
    assert page.get_attribute("[data-testid=tour-start]", "aria-expanded") == "true"
    ids = request(base_url, "/tokenize", {"prompt": TOUR_PROMPT})["tokens"]
    assert value == {"count": len(ids), "ids": ids}
    tour.seen["prompt_ids"] = ids
    assert page.evaluate(ACCESSIBILITY_JS) == []


def test_one_forward_pass_per_token(tour: Tour, base_url: str) -> None:
    tour.move(key="ArrowRight")
    value = tour.proof(1)
    # The pass log grew by one pass per generated token: the prompt's pass gave the first.
    assert len(tour.logged()) == value["generated"] == value["passes"]
    (body,) = tour.sent()
    assert body["prompt"] == tour.seen["prompt_ids"]
    answer = again(base_url, body)["choices"][0]
    assert path_token_ids(tour.page) == answer["token_ids"]
    assert len(answer["token_ids"]) == value["generated"]
    tour.seen["path"] = answer


def test_inside_the_pass_the_last_layers_top_is_the_steps(tour: Tour, base_url: str) -> None:
    tour.move(button="tour-next")
    value = tour.proof(2)
    screenshot(tour.page, "tour-inside.png")
    trace = tour.seen["path"]["trace"]
    step = value["step"]
    recorded_top = min(trace[step]["candidates"], key=lambda c: c["rank"])["token_id"]
    assert value["top"] == value["recordedTop"] == recorded_top
    context = tour.seen["prompt_ids"] + tour.seen["path"]["token_ids"][:step]
    inspected = request(
        base_url, "/v1/visualizer/inspect", {"token_ids": context, "position": len(context) - 1, "top_k": 5}
    )
    assert value["numLayers"] == inspected["num_layers"]
    assert inspected["layers"][-1]["logit_lens"][0]["token_id"] == value["top"]
    # The stop selected the path's least sure token.
    assert step == min(range(len(trace)), key=lambda i: trace[i]["chosen_prob_raw"])


def test_why_this_token_is_the_recorded_step(tour: Tour) -> None:
    tour.move(key="ArrowRight")
    value = tour.proof(3)
    step = tour.seen["path"]["trace"][value["step"]]
    chosen = next(c for c in step["candidates"] if c["token_id"] == step["chosen_token_id"])
    assert (value["tokenId"], value["rank"], value["probRaw"], value["probFinal"]) == (
        chosen["token_id"],
        chosen["rank"],
        chosen["prob_raw"],
        chosen["prob_final"],
    )
    assert value["numCandidates"] == len(step["candidates"])


def test_temperature_sharpens_and_flattens_one_distribution(tour: Tour, base_url: str) -> None:
    tour.move(key="ArrowRight")
    value = tour.proof(4)
    (replay,) = [body for body in tour.sent() if body.get("max_tokens") == 1]
    assert replay["temperature"] == 1.6
    replayed = request(base_url, "/v1/completions", replay)["choices"][0]["trace"][0]
    top = next(c for c in replayed["candidates"] if c["rank"] == 1)
    assert value["tokenId"] == top["token_id"] and value["probPreview"] == top["prob_final"]
    recorded = next(c for c in tour.seen["path"]["trace"][value["step"]]["candidates"] if c["rank"] == 1)
    assert (value["probRaw"], value["probFinal"]) == (recorded["prob_raw"], recorded["prob_final"])
    # T 0.8 sharpened the top token's probability, T 1.6 flattens it.
    assert value["probPreview"] < value["probRaw"] < value["probFinal"]


def test_the_fork_two_samples_of_one_prompt(tour: Tour, base_url: str) -> None:
    tour.move(key="ArrowRight")
    value = tour.proof(5)
    (body,) = tour.sent()
    assert body["n"] == 2
    answer = again(base_url, body)
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    shown = [tour.page.evaluate(f"pathOf(branchById({i})).map(t => t.id)") for i in value["ids"]]
    assert shown == [c["token_ids"] for c in choices]
    a, b = shown
    split = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert value["step"] == split
    assert len(value["tokens"]) == 2, "the two samples should part somewhere"
    tour.seen["fork"] = {"body": body, "choices": choices, "split": split}


def test_commitment_the_path_goes_on_from_a_forced_token(tour: Tour, base_url: str) -> None:
    tour.move(key="ArrowRight")
    value = tour.proof(6)
    fork = tour.seen["fork"]
    step = value["step"]
    assert step == fork["split"]
    parent = fork["choices"][0]
    trace = parent["trace"][step]
    # The least likely recorded candidate that is neither the token drawn nor an end of sequence.
    eos = set(request(base_url, "/v1/visualizer/info")["eos_token_ids"])
    others = [c for c in trace["candidates"] if c["token_id"] != trace["chosen_token_id"] and c["token_id"] not in eos]
    forced = max(others, key=lambda c: c["rank"])
    assert (value["tokenId"], value["probRaw"]) == (forced["token_id"], forced["prob_raw"])
    (body,) = tour.sent()
    assert body["prompt"] == fork["body"]["prompt"] + parent["token_ids"][:step] + [value["tokenId"]]
    continuation = again(base_url, body)["choices"][0]["token_ids"]
    assert path_token_ids(tour.page)[step + 1 :] == continuation


def test_the_kv_cache_against_recomputing(tour: Tour, base_url: str) -> None:
    tour.move(key="ArrowRight")
    value = tour.proof(7)
    (body,) = tour.sent()
    answer = again(base_url, body)
    num_prompt, num_generated = answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
    assert value["numBlocks"] == answer["metrics"]["kv_blocks"]
    # The prompt once, then one new slot per pass; without the cache, the whole context at every step.
    assert value["withSlots"] == num_prompt + num_generated - 1
    assert value["withoutSlots"] == sum(num_prompt + k for k in range(num_generated))


def test_batching_the_load_shares_passes(tour: Tour) -> None:
    tour.move(key="ArrowRight")
    value = tour.proof(8)
    logged = tour.logged()
    assert [run["k"] for run in value["runs"]] == [1, 4]
    assert value["maxBatch"] == max(len(p["rows"]) for p in logged) > 1
    assert len(tour.sent()) == 5


def test_speculative_decoding_counts_passes_on_the_default_server(tour: Tour, base_url: str) -> None:
    tour.move(key="ArrowRight")
    value = tour.proof(9)
    assert request(base_url, "/v1/engine").get("speculative_draft") is None
    (body,) = tour.sent()
    answer = again(base_url, body)
    assert path_token_ids(tour.page) == answer["choices"][0]["token_ids"]
    # Without drafts: one token per forward pass.
    assert value == {"passes": value["generated"], "generated": len(answer["choices"][0]["token_ids"]), "drafts": None}


def test_beam_search_rows_are_the_servers(tour: Tour, base_url: str) -> None:
    tour.move(key="ArrowRight")
    value = tour.proof(10)
    beam_body = next(body for body in tour.sent() if body.get("beam_width"))
    response = request(base_url, "/v1/completions", beam_body)
    (steps,) = response["beam_steps"]
    assert value["numBeams"] == len(response["choices"]) == 3
    assert value["numRows"] == sum(len(step["beams"]) for step in steps) > 0
    assert value["beamLogprob"] == sum(response["choices"][0]["logprobs"]["token_logprobs"])
    finals = tour.page.eval_on_selector_all("[data-testid=beam-final]", "els => els.map(e => e.dataset.tokenIds)")
    assert finals == [",".join(map(str, c["token_ids"])) for c in response["choices"]]


def test_stop_conditions_read_as_the_api_says(tour: Tour, base_url: str) -> None:
    tour.move(key="ArrowRight")
    value = tour.proof(11)
    (body,) = tour.sent()
    assert body["stop"] == ["."]
    choice = again(base_url, body)["choices"][0]
    reason, stop_reason = choice["finish_reason"], choice.get("stop_reason")
    expected = reason if reason != "stop" else "stop-string" if isinstance(stop_reason, str) else "eos"
    assert value["kind"] == expected
    assert tour.page.inner_text("[data-testid=tour-next]") == "Finish"


# ---------------------------------------------------------------- moving about, and leaving


def test_back_restart_and_skip(tour: Tour) -> None:
    page = tour.page
    page.keyboard.press("ArrowLeft")
    page.wait_for_selector("[data-testid=tour][data-stop=beams]")
    tour.move(button="tour-restart")
    assert tour.proof(0)["ids"] == tour.seen["prompt_ids"]
    assert page.get_attribute("[data-testid=tour-back]", "aria-disabled") == "true"
    page.click("[data-testid=tour-skip]")
    assert page.is_hidden("[data-testid=tour]")
    assert page.evaluate("document.activeElement.dataset.testid") == "tour-start"
    assert page.eval_on_selector_all(".tour-highlight", "els => els.length") == 0
    assert page.get_attribute("[data-testid=tour-start]", "aria-expanded") == "false"


def test_starting_over_a_tree_asks_first_and_escape_leaves(tour: Tour) -> None:
    page = tour.page
    page.keyboard.press("Enter")
    # The tour would discard the tree the last stops built: the page asks, as it does for a new prompt.
    page.wait_for_selector("[data-testid=confirm-new-tree]:not([hidden])")
    assert "tour" in page.inner_text("[data-testid=confirm-new-tree-text]")
    page.click("[data-testid=confirm-discard]")
    tour.proof(0)
    page.keyboard.press("Escape")
    assert page.is_hidden("[data-testid=tour]")
    assert page.evaluate("document.activeElement.dataset.testid") == "tour-start"
    assert tour.watch.unexpected() == []


def test_the_article_scrolls_clear_of_the_dialog_while_a_panel_above_grows(browser: object, base_url: str) -> None:
    """A panel above the walkthrough that fills in while the link's scroll runs (panel 7's inspection, answered after
    the stop's proof) moves the article down: the page still brings it clear of the dialog."""
    page, watch = open_page(browser, base_url)
    page.click("[data-testid=tour-start]")
    page.wait_for_selector("[data-testid=tour-proof][data-ready=true]", timeout=STOP_TIMEOUT_MS)
    page.evaluate(GROW_INSIDE_AS_LINK_SCROLLS, 500)
    page.click("[data-testid=tour-doc]")
    page.wait_for_function(ARTICLE_CLEAR, arg="walkthrough-stop-1", timeout=10_000)
    assert page.eval_on_selector("#inside", "e => e.lastElementChild.style.height") == "500px"
    assert watch.unexpected() == []
    page.close()


# ---------------------------------------------------------------- the docs


def test_docs_walkthrough_has_a_heading_per_stop(tour: Tour) -> None:
    """docs/visualizer.md mirrors the page's walkthrough for readers of the repository: "### Stop N: title" for
    every stop, in the tour's order."""
    titles = tour.page.evaluate("TOUR_STOPS.map(stop => stop.title)")
    assert len(titles) == len(STOPS)
    text = (ROOT / "docs" / "visualizer.md").read_text()
    headings = re.findall(r"^### (Stop \d+: .+)$", text, flags=re.MULTILINE)
    assert headings == [f"Stop {i + 1}: {title}" for i, title in enumerate(titles)]
