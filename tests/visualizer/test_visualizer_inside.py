"""Browser tests of the visualizer's look inside the machine, against a real `tokenriver serve` with the defaults.

Panel 7 (inside the forward pass), the sparklines along a path, the draw's neighbourhood in the cumulative
distribution and panel 8 (beam search) are checked against the engine through its API: the page's numbers are the
server's, compared with `==`, and the server's beam steps are checked against LLM.generate in
tests/server/test_server_beam_trace.py.

Set TOKENRIVER_UPDATE_SCREENSHOT=1 to refresh docs/visualizer-inside.png and docs/visualizer-beams.png.
"""

from __future__ import annotations

import json
import math
import urllib.error
from collections.abc import Iterator

import pytest
from visualizer_harness import (
    ACCESSIBILITY_JS,
    CHAT_REQUEST,
    GENERATION_TIMEOUT_MS,
    HTTP_ERROR_LOG,
    MAX_TOKENS,
    PROMPT,
    SEED,
    TEMPERATURE,
    TRACE_TOP,
    ConsoleWatch,
    doc_screenshot,
    open_page,
    path_token_ids,
    reference_completion,
    request,
    select_token,
    set_controls,
    wait_finished,
)

BEAM_WIDTH = 3
# Records every completion body the page sends, so a test can send the very same request to the API.
RECORD_BODIES = """() => { window.sentBodies = []; const realFetch = window.fetch;
    window.fetch = (url, init) => { if (String(url).includes('/v1/completions') && init && init.body)
      window.sentBodies.push(JSON.parse(init.body)); return realFetch(url, init); }; }"""


@pytest.fixture(scope="module")
def generated(browser: object, base_url: str) -> Iterator[tuple[object, ConsoleWatch]]:
    """One page that has generated MAX_TOKENS sampled tokens from PROMPT under the chat template."""
    page, watch = open_page(browser, base_url)
    page.fill("#prompt", PROMPT)
    page.check("#chat-template")
    set_controls(
        page,
        **{
            "max-tokens": str(MAX_TOKENS),
            "seed": str(SEED),
            "trace-top": str(TRACE_TOP),
            "temperature": str(TEMPERATURE),
        },
    )
    page.evaluate(RECORD_BODIES)
    page.click("#generate")
    wait_finished(page)
    yield page, watch
    page.close()


@pytest.fixture(scope="module")
def prompt_ids(base_url: str) -> list[int]:
    return request(base_url, "/tokenize", CHAT_REQUEST)["tokens"]


@pytest.fixture(scope="module")
def reference(base_url: str, prompt_ids: list[int]) -> list[dict]:
    """The page's request, sent to the API without streaming: each step's trace as the engine records it."""
    return reference_completion(base_url, prompt_ids, MAX_TOKENS)["trace"]


def _show_inside(page: object, step: int, num_prompt_tokens: int) -> None:
    """Select token `step` and wait for panel 7 to show the inspection of the position that chose it."""
    select_token(page, step)
    position = num_prompt_tokens + step - 1
    page.wait_for_selector(f"[data-testid=inside-stack][data-position='{position}']", timeout=GENERATION_TIMEOUT_MS)


def _inspect(base_url: str, context: list[int]) -> dict:
    return request(base_url, "/v1/visualizer/inspect", {"token_ids": context, "position": len(context) - 1, "top_k": 5})


def _rows(page: object) -> list[list[float]]:
    """The attention grid's rows (each head, then the mean), as the numbers the page's cells carry."""
    return page.eval_on_selector_all(
        "[data-testid=attention-row]",
        "els => els.map(g => [...g.querySelectorAll('[data-testid=attention-cell]')]"
        ".map(c => Number(c.dataset.weight)))",
    )


# ---------------------------------------------------------------- inside the forward pass


def test_last_layer_lens_is_the_steps_recorded_top_token(
    generated: tuple, base_url: str, prompt_ids: list[int], reference: list[dict]
) -> None:
    page, watch = generated
    path = [step["chosen_token_id"] for step in reference]
    assert path_token_ids(page) == path
    for step in range(MAX_TOKENS):
        _show_inside(page, step, len(prompt_ids))
        recorded_top = min(reference[step]["candidates"], key=lambda c: c["rank"])["token_id"]
        logits = page.locator("[data-testid=inside-logits]")
        assert int(logits.get_attribute("data-top-token-id")) == recorded_top
        assert int(logits.get_attribute("data-recorded-top-token-id")) == recorded_top
    # The stack is the engine's, layer by layer: its lens tokens and its update norms.
    inspected = _inspect(base_url, prompt_ids + path[: MAX_TOKENS - 1])
    shown = page.eval_on_selector_all(
        "[data-testid=inside-layer]",
        "els => els.map(e => [Number(e.dataset.topTokenId), Number(e.dataset.attentionNorm), "
        "Number(e.dataset.mlpNorm)])",
    )
    assert shown == [
        [layer["logit_lens"][0]["token_id"], layer["attention_update_norm"], layer["mlp_update_norm"]]
        for layer in inspected["layers"]
    ]
    assert watch.unexpected() == []


def test_attention_rows_are_the_engines_and_sum_to_one(
    generated: tuple, base_url: str, prompt_ids: list[int], reference: list[dict]
) -> None:
    page, watch = generated
    step = 2
    _show_inside(page, step, len(prompt_ids))
    context = prompt_ids + [s["chosen_token_id"] for s in reference[:step]]
    inspected = _inspect(base_url, context)
    num_layers = inspected["num_layers"]
    # The keyboard walks the stack: ↑ from the last layer (the one shown first) shows the layer below it.
    page.focus(f"[data-testid=inside-layer][data-layer='{num_layers - 1}']")
    page.keyboard.press("ArrowUp")
    page.keyboard.press("ArrowUp")
    layer = num_layers - 3
    assert page.evaluate("document.activeElement.dataset.layer") == str(layer)
    assert page.get_attribute(f"[data-testid=inside-layer][data-layer='{layer}']", "aria-pressed") == "true"
    attention = inspected["layers"][layer]["attention"]
    rows = _rows(page)
    assert rows == attention["weights"] + [attention["mean"]]
    for row in rows:
        assert len(row) == len(context)
        assert math.fsum(row) == pytest.approx(1.0, abs=1e-5)
    # Head 1 from the heads' toolbar: the context's tokens, and the prompt's in panel 1, carry its weights.
    page.focus("[data-testid=inside-head][data-head='mean']")
    page.keyboard.press("ArrowRight")
    assert page.get_attribute("[data-testid=inside-head][data-head='0']", "aria-pressed") == "true"
    context_weights = page.eval_on_selector_all(
        "[data-testid=inside-context-token]", "els => els.map(e => Number(e.dataset.weight))"
    )
    assert context_weights == attention["weights"][0]
    prompt_marks = page.eval_on_selector_all(
        "#prompt-tokens [data-testid=prompt-token]", "els => els.map(e => Number(e.dataset.attention))"
    )
    assert prompt_marks == attention["weights"][0][: len(prompt_ids)]
    doc_screenshot(page, "section.panel:has(#inside)", "visualizer-inside.png")
    assert watch.unexpected() == []


# ---------------------------------------------------------------- the distribution over time


def test_sparklines_have_one_point_per_step_of_the_path(generated: tuple, reference: list[dict]) -> None:
    page, watch = generated
    expected = {
        "entropy": [s["entropy_raw"] for s in reference],
        "top1": [max(c["prob_raw"] for c in s["candidates"]) for s in reference],
        "kept": [s["num_candidates_kept"] for s in reference],
    }
    for metric, values in expected.items():
        points = page.eval_on_selector_all(
            f"[data-testid=sparkline][data-metric={metric}] [data-testid=sparkline-point]",
            "els => els.map(e => [Number(e.dataset.step), Number(e.dataset.value)])",
        )
        assert points == [[step, value] for step, value in enumerate(values)], metric
    assert watch.unexpected() == []


def test_the_draw_shows_its_neighbours_spans(generated: tuple, reference: list[dict]) -> None:
    page, watch = generated
    step = 1
    select_token(page, step)
    draw = reference[step]["extra"]["draw"]
    spans = page.eval_on_selector_all(
        "#why [data-testid=draw-cdf] [data-testid=cdf-neighbor]",
        """els => els.map(e => [Number(e.dataset.tokenId), Number(e.dataset.cdfStart), Number(e.dataset.cdfEnd),
                                  e.classList.contains('cdf-span')])""",
    )
    chosen = reference[step]["chosen_token_id"]
    assert spans == [[n["token_id"], n["cdf_start"], n["cdf_end"], n["token_id"] == chosen] for n in draw["neighbors"]]
    assert [n["token_id"] for n in draw["neighbors"]] == sorted(n["token_id"] for n in draw["neighbors"])
    (chosen_span,) = [n for n in draw["neighbors"] if n["token_id"] == chosen]
    assert (chosen_span["cdf_start"], chosen_span["cdf_end"]) == (draw["cdf_start"], draw["cdf_end"])
    assert draw["cdf_start"] <= draw["uniform"] < draw["cdf_end"] + 1e-6
    assert watch.unexpected() == []


# ---------------------------------------------------------------- beam search


def test_beam_rows_are_the_servers_beams(generated: tuple, base_url: str) -> None:
    page, watch = generated
    page.fill("#beam-width", str(BEAM_WIDTH))
    page.focus("#run-beams")
    page.keyboard.press("Enter")
    page.wait_for_selector("[data-testid=beam-final]", timeout=GENERATION_TIMEOUT_MS)
    sent = page.evaluate("window.sentBodies")
    beam_body = next(body for body in sent if body.get("beam_width") == BEAM_WIDTH)
    sample_body = next(body for body in sent[sent.index(beam_body) :] if "beam_width" not in body)
    response = request(base_url, "/v1/completions", beam_body)
    (steps,) = response["beam_steps"]
    beam_rows = page.eval_on_selector_all(
        "[data-testid=beam-row]",
        "els => els.map(e => [Number(e.dataset.step), Number(e.dataset.beam), e.dataset.tokenIds, "
        "Number(e.dataset.cumulativeLogprob)])",
    )
    assert beam_rows == [
        [step["index"], j, ",".join(map(str, beam["token_ids"])), beam["cumulative_logprob"]]
        for step in steps
        for j, beam in enumerate(step["beams"])
    ]
    continuations = page.eval_on_selector_all(
        "[data-testid=beam-continuation]",
        "els => els.map(e => [Number(e.dataset.step), Number(e.dataset.beam), Number(e.dataset.tokenId), "
        "Number(e.dataset.rank), Number(e.dataset.cumulativeLogprob), e.dataset.fate, e.dataset.nextBeam])",
    )
    expected = [
        [s["index"], j, c["token_id"], c["rank"], c["cumulative_logprob"], c["fate"], _blank(c["next_beam_index"])]
        for s in steps
        for j in range(len(s["beams"]))
        for c in s["continuations"]
        if c["beam_index"] == j
    ]
    assert continuations == expected
    assert {c[5] for c in continuations} >= {"running", "pruned"}
    finals = page.eval_on_selector_all(
        "[data-testid=beam-final]", "els => els.map(e => [e.dataset.tokenIds, Number(e.dataset.score)])"
    )
    assert finals == [[",".join(map(str, c["token_ids"])), c["beam_score"]] for c in response["choices"]]
    assert len(finals) == BEAM_WIDTH
    # Beam vs sampling: the sampled side is the engine's answer to the request the page sent beside the search.
    sample = request(base_url, "/v1/completions", sample_body)["choices"][0]
    sample_side = page.locator("[data-testid=sample-side]")
    assert float(sample_side.get_attribute("data-logprob")) == sum(sample["logprobs"]["token_logprobs"])
    page.evaluate("document.querySelectorAll('[data-testid=beam-step]')[1].open = true")
    doc_screenshot(page, "section.panel:has(#beams)", "visualizer-beams.png")
    assert page.evaluate(ACCESSIBILITY_JS) == []
    assert watch.unexpected() == []


def _blank(value: int | None) -> str:
    return "" if value is None else str(value)


# ---------------------------------------------------------------- a refused inspection


def test_a_refused_inspection_shows_the_servers_message(browser: object, base_url: str) -> None:
    page, watch = open_page(browser, base_url)
    long_prompt = "word " * 1100
    page.fill("#prompt", long_prompt)
    set_controls(page, **{"max-tokens": "1", "seed": str(SEED)})
    page.click("#generate")
    wait_finished(page)
    select_token(page, 0)
    page.wait_for_selector("[data-testid=inside-error]", timeout=GENERATION_TIMEOUT_MS)
    context = request(base_url, "/tokenize", {"prompt": long_prompt})["tokens"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        _inspect(base_url, context)
    assert refused.value.code == 400
    error = json.loads(refused.value.read())["error"]
    assert page.inner_text("[data-testid=inside-error-message]") == error["message"]
    assert error["param"] == "position"
    assert page.locator("[data-testid=inside-stack]").count() == 0
    assert page.is_hidden("#error")
    assert watch.unexpected(allowed=(HTTP_ERROR_LOG,)) == []
    page.close()
