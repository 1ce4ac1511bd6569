"""The grammar stage in the visualizer: a constrained generation, its facts in "why this token", exact replays
and samples that continue the constraint, and constraints the page or the server refuses.

The reference is the API itself: the page's path is the tokens of the same constrained request, its grammar
facts are the trace's `extra.grammar`, and every text follows the regex.
"""

from __future__ import annotations

import re

import pytest
from visualizer_harness import (
    HTTP_ERROR_LOG,
    SEED,
    TEMPERATURE,
    TRACE_TOP,
    candidates,
    open_page,
    path_token_ids,
    request,
    row_count,
    select_token,
    set_controls,
    wait_finished,
    wait_idle,
)

PROMPT = "The three primary colors are"
# Its first tokens are forced (the grammar allows one token); the colour at the end is the model's choice.
REGEX = r"red, green and (blue|yellow)"
MAX_TOKENS = 8


def _constrain(page: object, kind: str, text: str = "") -> None:
    page.select_option("#constraint-kind", kind)
    if text:
        page.fill("#constraint-text", text)


def _path_texts(page: object) -> list[str]:
    """Each path's generated text, end-of-sequence tokens left out."""
    return page.evaluate("""() => state.branches.map(b => pathOf(b)
        .filter(t => !state.info.eos_token_ids.includes(t.id)).map(t => t.text).join(''))""")


def test_grammar_stage_in_why_this_token(browser: object, base_url: str) -> None:
    page, watch = open_page(browser, base_url)
    page.fill("#prompt", PROMPT)
    set_controls(
        page,
        **{
            "max-tokens": str(MAX_TOKENS),
            "seed": str(SEED),
            "temperature": str(TEMPERATURE),
            "trace-top": str(TRACE_TOP),
            "samples": "2",
        },
    )
    _constrain(page, "regex", REGEX)
    page.click("#generate")
    wait_finished(page)
    prompt_ids = request(base_url, "/tokenize", {"prompt": PROMPT})["tokens"]
    body = {
        "prompt": prompt_ids,
        "max_tokens": MAX_TOKENS,
        "temperature": TEMPERATURE,
        "seed": SEED,
        "trace": True,
        "trace_top": TRACE_TOP,
        "trace_stages": True,
        "structured_outputs": {"regex": REGEX},
    }
    reference = request(base_url, "/v1/completions", body)["choices"][0]
    assert path_token_ids(page) == [step["chosen_token_id"] for step in reference["trace"]]
    assert re.fullmatch(REGEX, reference["text"])
    assert [re.fullmatch(REGEX, text) is not None for text in _path_texts(page)] == [True]
    assert "regex red, green and (blue|ye…" in page.inner_text("[data-testid=tree-settings]")

    vocab_size = request(base_url, "/v1/visualizer/info")["vocab_size"]
    forced = [s["index"] for s in reference["trace"] if s["extra"]["grammar"]["forced"]]
    free = [s["index"] for s in reference["trace"] if not s["extra"]["grammar"]["forced"]]
    assert forced and free, "the regex should force some tokens and leave others to the model"
    for step in (forced[0], free[0]):
        grammar = reference["trace"][step]["extra"]["grammar"]
        select_token(page, step)
        note = page.locator("[data-testid=why-grammar]")
        assert int(note.get_attribute("data-num-allowed")) == grammar["num_allowed"]
        assert float(note.get_attribute("data-mass-removed")) == pytest.approx(grammar["mass_removed"])
        assert note.get_attribute("data-forced") == ("true" if grammar["forced"] else "false")
        allowed = f"{grammar['num_allowed']} of {vocab_size} tokens"
        assert page.inner_text("[data-testid=grammar-allowed]") == allowed
        mass = min(1.0, grammar["mass_removed"])
        shown = page.inner_text("[data-testid=grammar-mass-removed]")
        assert shown == ("> 99.9%" if 0.9995 < mass < 1 else f"{mass * 100:.1f}%")
        assert page.inner_text("[data-testid=grammar-forced]").startswith("yes" if grammar["forced"] else "no")
        removed = [c for c in reference["trace"][step]["candidates"] if c["removed_by"] == "grammar"]
        badges = page.locator("[data-testid=removed-by].by-grammar")
        assert badges.count() == len(removed) > 0
        assert badges.first.inner_text() == "removed by grammar"
        assert page.inner_text("[data-testid=grammar-removed-shown]").startswith(f"{len(removed)} of the ")
        # The allowed tokens are listed with their mass after the grammar stage, the chosen one among them.
        trace = reference["trace"][step]
        stage = next(s for s in trace["stages"] if s["name"] == "grammar")
        expected = {c["token_id"]: p for c, p in zip(trace["candidates"], stage["probs"]) if p > 0}
        listed = page.eval_on_selector_all(
            "[data-testid=grammar-allowed-token]",
            "els => els.map(e => [Number(e.dataset.tokenId), Number(e.dataset.prob)])",
        )
        assert dict(listed) == expected and trace["chosen_token_id"] in expected
        assert len(listed) == min(grammar["num_allowed"], TRACE_TOP)

    # The replay of a constrained step sends the constraint and the path before it: the recorded distribution.
    select_token(page, free[0])
    page.click("[data-testid=preview-now]")
    page.wait_for_selector("[data-testid=bar-preview]")
    for c in candidates(page):
        assert c["probPreview"] == c["probFinal"]
    page.click("[data-testid=show-stages]")
    page.wait_for_selector("[data-testid=stages-table]")
    names = page.eval_on_selector_all("[data-testid=stage-name]", "els => els.map(e => e.textContent)")
    assert names[1].startswith("after grammar (regex")

    # Samples from the middle of the text continue the constraint rather than start it over.
    select_token(page, forced[-1])
    page.click("[data-testid=samples-from-here]")
    wait_finished(page, branch_count=3)
    assert all(re.fullmatch(REGEX, text) for text in _path_texts(page)), _path_texts(page)
    assert watch.unexpected() == []
    page.close()


def test_export_and_import_carry_the_constraint(browser: object, base_url: str) -> None:
    page, watch = open_page(browser, base_url)
    page.fill("#prompt", PROMPT)
    set_controls(page, **{"max-tokens": "6", "seed": str(SEED), "temperature": str(TEMPERATURE)})
    _constrain(page, "choice", "red\ngreen, blue\nyellow")
    page.click("#generate")
    wait_finished(page)
    select_token(page, 0)
    page.click("[data-testid=samples-from-here]")
    wait_finished(page, branch_count=1 + 3)
    exported = page.evaluate("() => treeExport()")
    choices = ["red", "green, blue", "yellow"]
    assert all(p["settings"]["structured_outputs"] == {"choice": choices} for p in exported["paths"])
    assert all(text in choices for text in _path_texts(page))
    other, other_watch = open_page(browser, base_url)
    other.evaluate("data => importTree(data)", exported)
    other.wait_for_selector("[data-testid=import-report]", timeout=90_000)
    assert "every token identical" in other.inner_text("[data-testid=import-report]")
    other.close()
    assert watch.unexpected() == [] and other_watch.unexpected() == []
    page.close()


def test_invalid_constraints_are_refused_with_a_message(browser: object, base_url: str) -> None:
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": "2"})
    # Caught on the page: no request is sent.
    _constrain(page, "json", '{"type": "object",')
    page.click("#generate")
    page.wait_for_selector("[data-testid=error]:not([hidden])")
    assert "the JSON schema is not valid JSON" in page.inner_text("[data-testid=error-message]")
    assert page.get_attribute("#constraint-text", "aria-invalid") == "true"
    assert row_count(page) == 0
    # Refused by the server: its 400 names the field and the problem.
    _constrain(page, "regex", "a(b")
    page.click("#generate")
    page.wait_for_function("""() => document.querySelector('[data-testid=error-message]').textContent
        .includes('unclosed group')""")
    assert "param: structured_outputs.regex" in page.inner_text("[data-testid=error-detail]")
    assert page.get_attribute("#constraint-text", "aria-invalid") == "true"
    wait_idle(page)
    assert row_count(page) == 0
    assert watch.unexpected(allowed=(HTTP_ERROR_LOG,)) == []
    page.close()
