"""The visualizer against a server that decodes speculatively (n-gram drafts): drafted, accepted and replaced
tokens are marked per step, the acceptance rule is stated, and the engine view counts the drafts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from visualizer_harness import (
    doc_screenshot,
    open_page,
    path_token_ids,
    request,
    running_server,
    screenshot,
    set_controls,
    wait_finished,
)

# Text that repeats, so the n-gram proposer finds earlier occurrences to copy as drafts.
REPEATING_PROMPT = "one two three four, one two three four, one two three four, one two three four, one two"
# True once an accepted draft token on the page is underlined solid (a rejected one's mark is another shape).
ACCEPTED_MARK_IS_SOLID = """() => { const token = document.querySelector('[data-testid=token].draft-accepted');
    return token !== null && getComputedStyle(token).borderBottomStyle === 'solid'; }"""


@pytest.fixture(scope="module")
def speculative_url() -> Iterator[str]:
    with running_server(("--speculative-draft", "ngram", "--num-speculative-tokens", "3"), name="speculative") as url:
        yield url


def test_speculative_view_marks_drafts_and_states_the_rule(browser: object, speculative_url: str) -> None:
    page, watch = open_page(browser, speculative_url)
    page.fill("#prompt", REPEATING_PROMPT)
    set_controls(page, **{"max-tokens": "12", "temperature": "0"})
    page.click("#generate")
    wait_finished(page)
    body = {"prompt": REPEATING_PROMPT, "max_tokens": 12, "temperature": 0, "trace": True}
    response = request(speculative_url, "/v1/completions", body)
    reference = response["choices"][0]["trace"]
    assert path_token_ids(page) == [s["chosen_token_id"] for s in reference]
    accepted = [s["index"] for s in reference if s["extra"].get("speculative", {}).get("accepted")]
    assert accepted, "the n-gram proposer drafted nothing on a repeating prompt"
    shown = page.eval_on_selector_all(
        "[data-testid=token].draft-accepted", "els => els.map(e => Number(e.dataset.step))"
    )
    assert shown == accepted
    page.click(f"[data-testid=token][data-step='{accepted[0]}']")
    note = page.inner_text("[data-testid=why-speculative]")
    assert "accepted" in note and "argmax" in note
    assert "ngram" in page.inner_text("[data-testid=engine-speculative]")
    # Marks differ by shape, and a legend says which is which.
    assert "accepted" in page.inner_text("[data-testid=spec-legend]")
    # Asked of the element on the page each time: a panel rebuilt by data arriving meanwhile replaces the token
    # elements, and a replaced one, detached, has no computed style.
    page.wait_for_function(ACCEPTED_MARK_IS_SOLID, timeout=10_000)
    # The pass count is the engine's (passes, not tokens), and so are the per-pass figures.
    metrics = response["metrics"]
    assert int(page.inner_text("[data-testid=num-forward-passes]")) == metrics["num_forward_passes"] < len(reference)
    per_pass = page.inner_text("[data-testid=spec-per-pass]")
    assert per_pass.startswith(f"{metrics['num_generated_tokens'] / metrics['num_forward_passes']:.2f} tokens per pass")
    # The timeline marks the verification passes that carried draft tokens.
    assert page.locator("[data-testid=timeline-cell]").count() >= 1
    screenshot(page, "speculative.png")
    doc_screenshot(page, "[data-testid=why-speculative]", "visualizer-speculative.png")
    assert watch.unexpected() == []
    page.close()
