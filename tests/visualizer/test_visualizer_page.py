"""Browser tests of the generation visualizer against a real `tokenriver serve`: the main page and its defects.

The page is checked against the server itself: the tokens it shows are the tokens the API returns for the same
seed, a branch's continuation is what the API returns for the branch's prompt, and the bars are the trace's
probabilities. Every test also checks that the page logged no console error and threw no exception.

Set TOKENRIVER_UPDATE_SCREENSHOT=1 to copy the main screenshot to docs/visualizer.png.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator

import pytest
from visualizer_harness import (
    ACCESSIBILITY_JS,
    CHAT_REQUEST,
    HTTP_ERROR_LOG,
    MAX_TOKENS,
    PACE_EVENT_STREAMS,
    PACE_MS,
    PROMPT,
    ROOT,
    SEED,
    TEMPERATURE,
    TRACE_TOP,
    ConsoleWatch,
    candidates,
    doc_screenshot,
    fill_kept,
    focus_order,
    open_page,
    path_token_ids,
    reference_completion,
    request,
    row_count,
    screenshot,
    select_token,
    set_controls,
    sync_api,
    wait_finished,
    wait_idle,
)

expect = sync_api.expect


@pytest.fixture(scope="module")
def generated(browser: object, base_url: str) -> Iterator[tuple[object, ConsoleWatch]]:
    """One page that has generated MAX_TOKENS tokens from PROMPT; tests below inspect and branch it, in order."""
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
    # The engine can write all MAX_TOKENS tokens before the page reads the first network chunk, so the stream is
    # paced to one event per PACE_MS: whether partial paths show up then depends on the page, not on speed.
    page.evaluate(PACE_EVENT_STREAMS, PACE_MS)
    # Record every token count the page shows while the stream comes in.
    page.evaluate("""() => { window.seenTokenCounts = [];
        new MutationObserver(() => window.seenTokenCounts.push(
            document.querySelectorAll('#tokens [data-testid=token]').length))
          .observe(document.getElementById('tokens'), {childList: true}); }""")
    # Every completion request body the page sends, to check which settings a request used.
    page.evaluate("""() => { window.sentBodies = []; const realFetch = window.fetch;
        window.fetch = (url, init) => { if (String(url).includes('/v1/completions') && init && init.body)
          window.sentBodies.push(JSON.parse(init.body)); return realFetch(url, init); }; }""")
    page.click("#generate")
    wait_finished(page)
    yield page, watch
    page.close()


def _prompt_ids(base_url: str) -> list[int]:
    return request(base_url, "/tokenize", CHAT_REQUEST)["tokens"]


def _least_sure_step(page: object) -> int:
    """The step where the model was least sure (not the last, so a branch from it generates something)."""
    probs = page.eval_on_selector_all("[data-testid=token]", "els => els.map(e => Number(e.dataset.prob))")
    return min(range(1, MAX_TOKENS - 1), key=lambda i: probs[i])


def _select_path(page: object, branch_id: int) -> None:
    """Click a path's row in the tree and wait until the token row shows that path."""
    page.click(f"[data-testid=tree-row][data-branch='{branch_id}'] [data-testid=tree-select]")
    page.wait_for_selector(f"[data-testid=path-info] .badge:text-is('path {branch_id}')")


def _current_path_id(page: object) -> int:
    return int(page.get_attribute("[data-testid=tree-row].current", "data-branch"))


# ---------------------------------------------------------------- the engine's tokens, shown as they come


def test_prompt_tokens_match_the_tokenizer(generated: tuple, base_url: str) -> None:
    page, watch = generated
    shown = [
        int(x)
        for x in page.eval_on_selector_all("[data-testid=prompt-token]", "els => els.map(e => e.dataset.tokenId)")
    ]
    assert shown == _prompt_ids(base_url)
    assert watch.unexpected() == []


def test_generated_tokens_are_the_engines(generated: tuple, base_url: str) -> None:
    page, watch = generated
    reference = reference_completion(base_url, _prompt_ids(base_url), MAX_TOKENS)
    expected_ids = [step["chosen_token_id"] for step in reference["trace"]]
    assert path_token_ids(page) == expected_ids
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


def test_bars_of_a_selected_step(generated: tuple) -> None:
    page, watch = generated
    step = 1
    select_token(page, step)
    chosen_id = int(page.get_attribute(f"[data-testid=token][data-step='{step}']", "data-token-id"))
    shown = candidates(page)
    assert len(shown) >= TRACE_TOP
    assert sum(c["probRaw"] for c in shown) <= 1 + 1e-6
    assert sum(c["probFinal"] for c in shown) <= 1 + 1e-6
    assert all(0 <= c["probRaw"] <= 1 and 0 <= c["probFinal"] <= 1 for c in shown)
    assert [c["rank"] for c in shown] == sorted(c["rank"] for c in shown)
    for c in shown:
        assert c["rawWidth"] == pytest.approx(c["probRaw"] * 100, abs=0.01)
    # Raw logits are shown, and the raw probabilities are their softmax (ratios of exp(logit)).
    top, second = shown[0], shown[1]
    assert top["probRaw"] / second["probRaw"] == pytest.approx(math.exp(top["logit"] - second["logit"]), rel=1e-3)
    chosen = [c for c in shown if c["isChosen"]]
    assert len(chosen) == 1 and chosen[0]["tokenId"] == chosen_id and chosen[0]["hasChosenClass"]
    assert page.inner_text("[data-testid=why-rank]") == str(chosen[0]["rank"])
    assert "remaining" in page.inner_text("[data-testid=why-remaining]")
    screenshot(page, "selected-step.png")
    assert "null" not in page.inner_text("[data-testid=why]")
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
    page.wait_for_selector("[data-testid=why-step][data-step='2']")
    assert page.get_attribute("[data-testid=token][data-step='2']", "aria-pressed") == "true"
    assert watch.unexpected() == []


def test_popover_shows_the_top_candidates_next_to_the_token(generated: tuple) -> None:
    page, watch = generated
    popover = page.locator("[data-testid=popover]")
    page.click("h1")
    expect(popover).to_be_hidden()
    page.click("[data-testid=token][data-step='3']")
    expect(popover).to_be_visible()
    chip = page.eval_on_selector(
        "[data-testid=token][data-step='3']",
        "e => { const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, height: r.height}; }",
    )
    box = popover.bounding_box()
    # Right under the clicked token, not in another panel.
    assert 0 <= box["y"] - (chip["y"] + chip["height"]) <= 12
    assert abs(box["x"] - chip["x"]) <= 2
    expect(page.locator("[data-testid=popover-candidate]")).to_have_count(5)
    page.click("[data-testid=token][data-step='3']")
    expect(popover).to_be_hidden()
    assert watch.unexpected() == []


# ---------------------------------------------------------------- "why this token", exact


def test_preview_replays_the_step_exactly_and_leaves_the_settings_alone(generated: tuple, base_url: str) -> None:
    """Defects 10 and 12: the preview is the engine's own step under the preview settings, over the whole
    vocabulary, and it never changes the generation settings."""
    page, watch = generated
    step = 2
    select_token(page, step)
    # At the step's own settings the replay is the distribution the token was drawn from, bit for bit.
    page.click("[data-testid=preview-now]")
    page.wait_for_selector("[data-testid=bar-preview]")
    same = candidates(page)
    for c in same:
        assert c["probPreview"] == c["probFinal"]
    # Hotter: what the engine gives for the same context at T = 1.6 with top-p 0.9, not a renormalised guess.
    page.fill("#preview-temperature", "1.6")
    page.fill("#preview-top-p", "0.9")
    page.wait_for_function("""() => document.querySelector('[data-testid=preview-status]').textContent
        .includes('T 1.6, top-k 0, top-p 0.9')""")
    prefix = _prompt_ids(base_url) + path_token_ids(page)[:step]
    reference = request(
        base_url,
        "/v1/completions",
        {"prompt": prefix, "max_tokens": 1, "temperature": 1.6, "top_p": 0.9, "trace": True, "trace_top": 100},
    )
    expected = {c["token_id"]: c["prob_final"] for c in reference["choices"][0]["trace"][0]["candidates"]}
    hot = candidates(page)
    for c in hot:
        assert c["probPreview"] == expected.get(c["tokenId"], 0.0)
    assert hot[0]["probPreview"] != pytest.approx(same[0]["probPreview"], abs=1e-3)
    assert page.inner_text("[data-testid=preview-status]").startswith("Replay (what-if)")
    # The generation settings are untouched, and the tree states which settings the path used.
    assert page.input_value("#temperature") == str(TEMPERATURE)
    assert page.inner_text("[data-testid=tree-settings]") == f"T {TEMPERATURE} · seed {SEED}"
    assert watch.unexpected() == []


def _stage_rows(page: object) -> dict[int, list[float]]:
    """The stage table: token id → its probability in each column (raw softmax first)."""
    rows = page.eval_on_selector_all(
        "[data-testid=stages-table] tbody tr",
        """rows => rows.map(r => [Number(r.dataset.tokenId),
        [...r.querySelectorAll('[data-testid=stage-prob]')].map(td => Number(td.dataset.prob))])""",
    )
    return dict((token_id, probs) for token_id, probs in rows)


def _check_stages_are_recorded_and_replays_equal_them(page: object, base_url: str, step: int, settings: dict) -> None:
    """The stage table shows the step's recorded stages; a replay of the step under its own settings equals them."""
    select_token(page, step)
    page.click("[data-testid=show-stages]")
    page.wait_for_selector("[data-testid=stages-table]")
    trace = page.evaluate(f"pathOf(currentBranch())[{step}].trace")
    shown = _stage_rows(page)
    candidates_by_id = {c["token_id"]: i for i, c in enumerate(trace["candidates"])}
    for token_id, probs in shown.items():
        i = candidates_by_id[token_id]
        assert probs[0] == trace["candidates"][i]["prob_raw"]
        assert probs[1 : 1 + len(trace["stages"])] == [stage["probs"][i] for stage in trace["stages"]]
    prefix = page.evaluate("state.treePromptIds") + path_token_ids(page)[:step]
    replay = request(
        base_url,
        "/v1/completions",
        {"prompt": prefix, "max_tokens": 1, "trace": True, "trace_top": 100, **settings},
    )["choices"][0]["trace"][0]
    final = {c["token_id"]: c["prob_final"] for c in replay["candidates"]}
    raw = {c["token_id"]: c["prob_raw"] for c in replay["candidates"]}
    for token_id, probs in shown.items():
        assert probs[0] == pytest.approx(raw[token_id], abs=1e-6)
        if trace["method"] == "greedy":
            assert probs[-1] == (1.0 if token_id == trace["chosen_token_id"] else 0.0)
        else:
            assert probs[-1] == pytest.approx(final.get(token_id, 0.0), abs=1e-6)
    if trace["method"] == "greedy":
        assert replay["chosen_token_id"] == trace["chosen_token_id"]


def test_every_stage_of_a_step_is_the_recorded_step(generated: tuple, base_url: str) -> None:
    page, watch = generated
    select_token(page, 1)
    page.click("[data-testid=show-stages]")
    page.wait_for_selector("[data-testid=stages-table]")
    doc_screenshot(page, "[data-testid=why]", "visualizer-why.png")
    names = page.eval_on_selector_all("[data-testid=stage-name]", "els => els.map(e => e.textContent)")
    assert names[0] == "raw softmax" and names[1].startswith(f"after temperature {TEMPERATURE}")
    assert "not a replay" in page.inner_text("[data-testid=stages-table] caption")
    settings = {"temperature": TEMPERATURE, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
    for step in range(MAX_TOKENS):
        _check_stages_are_recorded_and_replays_equal_them(page, base_url, step, settings)
    shown = candidates(page)
    rows = _stage_rows(page)
    for c in shown:
        if c["tokenId"] in rows:
            assert rows[c["tokenId"]][-1] == c["probFinal"]
    assert watch.unexpected() == []


# ---------------------------------------------------------------- the tree


def test_branch_starts_with_the_clicked_token(generated: tuple, base_url: str) -> None:
    page, watch = generated
    step = _least_sure_step(page)
    select_token(page, step)
    parent_ids = path_token_ids(page)
    alternative = page.locator("button[data-testid=candidate]").first
    clicked_id = int(alternative.get_attribute("data-token-id"))
    assert clicked_id != parent_ids[step]
    alternative.click()
    wait_finished(page, branch_count=2)
    branch_ids = path_token_ids(page)
    assert branch_ids[:step] == parent_ids[:step]
    assert branch_ids[step] == clicked_id
    assert page.get_attribute(f"[data-testid=token][data-step='{step}']", "class").split().count("forced") == 1
    # The branch continues exactly as the engine does from prompt + path + clicked token.
    reference = reference_completion(base_url, _prompt_ids(base_url) + branch_ids[: step + 1], MAX_TOKENS - step - 1)
    assert branch_ids[step + 1 :] == [s["chosen_token_id"] for s in reference["trace"]]
    # Its cumulative log-probability is the sum of its tokens' log p_raw.
    probs = [float(p) for p in page.eval_on_selector_all("[data-testid=token]", "els => els.map(e => e.dataset.prob)")]
    assert float(page.inner_text("[data-testid=path-logprob]")) == pytest.approx(sum(map(math.log, probs)), abs=0.01)
    # The branch's request found the prompt's whole blocks in the prefix cache: each such block is marked a hit.
    cached = int(page.inner_text("[data-testid=num-prompt]").split("(")[1].rstrip(")"))
    assert cached >= 16
    assert page.locator("[data-testid=kv-block][data-hit=true]").count() == cached // 16
    # The branch used the generation settings, not the preview's (defect 10).
    assert page.evaluate("window.sentBodies.filter(b => b.stream).at(-1).temperature") == TEMPERATURE
    # Focus stays with the user's action (defect 15): on the new path's forced token, not on the page body.
    assert page.evaluate("document.activeElement.dataset.testid") == "token"
    rows = page.locator("[data-testid=tree-row]")
    expect(rows).to_have_count(2)
    page.click("[data-testid=tree-toggle]")
    expect(rows).to_have_count(1)
    page.click("[data-testid=tree-toggle]")
    expect(rows).to_have_count(2)
    assert watch.unexpected() == []


def test_compare_marks_the_first_divergent_token(generated: tuple) -> None:
    page, watch = generated
    step = int(page.get_attribute("[data-testid=token].forced", "data-step"))
    page.locator("[data-testid=compare-check]").nth(0).check()
    page.locator("[data-testid=compare-check]").nth(1).check()
    expect(page.locator("[data-testid=compare-item]")).to_have_count(2)
    assert int(page.get_attribute("[data-testid=compare-divergence]", "data-step")) == step
    expect(page.locator("[data-testid=compare-diverge-token]")).to_have_count(2)
    assert "margin" in page.inner_text("[data-testid=compare-margin]")
    select_token(page, step)
    page.click("h1")  # closes the candidates box, so the screenshot shows the panels under it
    shot = screenshot(page, "branch.png")
    if os.environ.get("TOKENRIVER_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "visualizer.png")
    page.locator("[data-testid=compare-check]").nth(0).uncheck()
    page.locator("[data-testid=compare-check]").nth(1).uncheck()
    assert watch.unexpected() == []


def test_a_second_alternative_at_the_same_step_is_a_sibling(generated: tuple) -> None:
    """Defect 1: branching again at a branch's first token makes a sibling under path 1, not a child."""
    page, watch = generated
    step = int(page.get_attribute("[data-testid=token].forced", "data-step"))
    branch_id = _current_path_id(page)
    select_token(page, step)
    other = page.locator("button[data-testid=candidate]").nth(1)
    other_id = int(other.get_attribute("data-token-id"))
    other.click()
    wait_finished(page, branch_count=3)
    new_id = _current_path_id(page)
    assert new_id != branch_id
    assert path_token_ids(page)[step] == other_id
    parents = page.eval_on_selector_all("[data-testid=tree-row]", "els => els.map(e => e.dataset.parent)")
    assert parents == ["", "1", "1"]
    assert watch.unexpected() == []


def test_picking_the_parents_token_returns_to_the_parent(generated: tuple) -> None:
    """Defect 2: in a branch, choosing the token path 1 had at that step selects path 1, no duplicate path."""
    page, watch = generated
    step = int(page.get_attribute("[data-testid=token].forced", "data-step"))
    sibling = _current_path_id(page)
    _select_path(page, 1)
    parent_ids = path_token_ids(page)
    _select_path(page, sibling)
    select_token(page, step)
    page.click(f"button[data-testid=candidate][data-token-id='{parent_ids[step]}']")
    page.wait_for_function("() => document.querySelector('[data-testid=tree-row].current').dataset.branch === '1'")
    assert row_count(page) == 3
    assert path_token_ids(page) == parent_ids
    assert watch.unexpected() == []


def test_tree_cells_take_the_keyboard(generated: tuple) -> None:
    """Defect 15: tree cells are focusable; arrows move between them and Enter selects without losing focus."""
    page, watch = generated
    _select_path(page, 1)
    page.focus("[data-testid=tree-cell][data-branch='1'][data-step='0']")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.dataset.step") == "1"
    page.keyboard.press("ArrowDown")
    assert page.evaluate("document.activeElement.dataset.branch") != "1"
    page.keyboard.press("ArrowUp")
    assert page.evaluate("document.activeElement.dataset.branch") == "1"
    step = page.evaluate("document.activeElement.dataset.step")
    page.keyboard.press("Enter")
    page.wait_for_selector(f"[data-testid=why-step][data-step='{step}']")
    assert page.evaluate("document.activeElement.dataset.testid") == "tree-cell"
    assert page.evaluate("document.activeElement.dataset.step") == step
    assert watch.unexpected() == []


def test_tree_labels_with_a_newline_stay_on_their_row(generated: tuple, base_url: str) -> None:
    """Defect 3: a path whose text holds a newline keeps its label on one row of the tree."""
    page, watch = generated
    newline_id = request(base_url, "/tokenize", {"prompt": "\n"})["tokens"][-1]
    _select_path(page, 1)
    select_token(page, 0)
    rows_before = row_count(page)
    fill_kept(page, "[data-testid=force-token-id]", str(newline_id))
    page.click("[data-testid=force-token]")
    wait_finished(page, branch_count=rows_before + 1)
    snippets = page.eval_on_selector_all("[data-testid=tree-snippet]", "els => els.map(e => e.textContent)")
    assert all("\n" not in s for s in snippets) and any("↵" in s for s in snippets)
    overflowing = page.eval_on_selector_all(
        "[data-testid=tree-row]", "els => els.filter(e => e.scrollHeight > e.clientHeight).length"
    )
    assert overflowing == 0
    assert watch.unexpected() == []


def test_a_typed_token_id_outlives_the_panel_being_rebuilt(generated: tuple) -> None:
    """A token id typed to force is kept when the panel is rebuilt before it is sent (a step's inspection arriving
    meanwhile rebuilt it, and the click sent an empty id)."""
    page, watch = generated
    _select_path(page, 1)
    select_token(page, 1)
    fill_kept(page, "[data-testid=force-token-id]", "7")
    typed_into = page.query_selector("[data-testid=force-token-id]")
    select_token(page, 0)
    select_token(page, 1)
    page.wait_for_function("input => !input.isConnected", arg=typed_into)
    assert page.input_value("[data-testid=force-token-id]") == "7"
    assert watch.unexpected() == []


def test_forcing_the_end_of_sequence_token_ends_the_branch(generated: tuple, base_url: str) -> None:
    """Defect 4: a branch forced onto <|im_end|> stops there, as the engine would."""
    page, watch = generated
    eos = request(base_url, "/v1/visualizer/info")["eos_token_ids"][0]
    _select_path(page, 1)
    select_token(page, 1)
    rows_before = row_count(page)
    fill_kept(page, "[data-testid=force-token-id]", str(eos))
    page.click("[data-testid=force-token]")
    wait_finished(page, branch_count=rows_before + 1)
    assert path_token_ids(page)[-1] == eos
    assert len(path_token_ids(page)) == 2
    assert page.inner_text("[data-testid=path-status]") == "finished: stop (end-of-sequence token)"
    assert page.get_attribute("[data-testid=path-status]", "data-stop-kind") == "eos"
    # Its real raw probability and rank, as the model saw it there (the prompt's logprob of the same token)...
    context = _prompt_ids(base_url) + path_token_ids(page)[:1]
    echoed = request(
        base_url, "/v1/completions", {"prompt": [*context, eos], "max_tokens": 1, "echo": True, "logprobs": 1}
    )["choices"][0]["logprobs"]["token_logprobs"][len(context)]
    prob = float(page.get_attribute("[data-testid=token][data-step='1']", "data-prob"))
    assert prob == pytest.approx(math.exp(echoed), rel=1e-4)
    select_token(page, 1)
    assert int(page.inner_text("[data-testid=why-rank]")) >= 1
    assert "null" not in page.inner_text("[data-testid=why]")
    # ...and Σ log p counts it.
    probs = [float(p) for p in page.eval_on_selector_all("[data-testid=token]", "els => els.map(e => e.dataset.prob)")]
    assert float(page.inner_text("[data-testid=path-logprob]")) == pytest.approx(sum(map(math.log, probs)), abs=0.01)
    assert watch.unexpected() == []


def test_export_and_import_replay_identically(generated: tuple, browser: object, base_url: str) -> None:
    page, watch = generated
    with page.expect_download() as download_info:
        page.click("#export-tree")
    saved = download_info.value.path()
    exported = json.loads(saved.read_text())
    assert exported["model"] and exported["prompt"]["token_ids"] == _prompt_ids(base_url)
    assert all("seed" in p["settings"] for p in exported["paths"])
    other, other_watch = open_page(browser, base_url)
    other.set_input_files("#import-tree", saved)
    other.wait_for_selector("[data-testid=import-report]", timeout=90_000)
    assert "every token identical" in other.inner_text("[data-testid=import-report]")
    assert row_count(other) == len(exported["paths"])
    other.close()
    assert watch.unexpected() == [] and other_watch.unexpected() == []


# ---------------------------------------------------------------- inputs and controls


def test_api_error_is_shown_and_leaves_no_empty_row(browser: object, base_url: str) -> None:
    """Defect 8: a failed request shows the server's error and adds no row to the tree."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"top-p": "0", "max-tokens": "2"})
    page.click("#generate")
    page.wait_for_selector("[data-testid=error]:not([hidden])")
    assert "top_p" in page.inner_text("[data-testid=error-message]")
    assert "param: top_p" in page.inner_text("[data-testid=error-detail]")
    assert page.get_attribute("#top-p", "aria-invalid") == "true"
    wait_idle(page)
    assert row_count(page) == 0
    assert watch.unexpected(allowed=(HTTP_ERROR_LOG,)) == []
    page.close()


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_tokens_below_one_is_refused(browser: object, base_url: str, value: str) -> None:
    """Defect 6: max tokens 0 or −5 is an error on the field, not a silent one-token generation."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": value})
    page.click("#generate")
    page.wait_for_selector("[data-testid=error]:not([hidden])")
    assert "max tokens" in page.inner_text("[data-testid=error-message]")
    assert page.get_attribute("#max-tokens", "aria-invalid") == "true"
    assert row_count(page) == 0
    assert watch.unexpected() == []
    page.close()


def test_generate_is_disabled_while_generating(browser: object, base_url: str) -> None:
    """Defect 7: a double click on Generate makes one root path."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": "3", "seed": str(SEED)})
    page.evaluate(PACE_EVENT_STREAMS, PACE_MS)
    page.dblclick("#generate")
    page.wait_for_selector("[data-testid=tree-row]")
    assert page.is_disabled("#generate")
    wait_finished(page)
    assert row_count(page) == 1
    assert page.is_enabled("#generate")
    assert watch.unexpected() == []
    page.close()


def test_a_new_prompt_asks_before_discarding_the_tree(browser: object, base_url: str) -> None:
    """Defect 9: editing the prompt and generating again asks first; keeping restores the tree's prompt."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": "2", "seed": str(SEED)})
    page.click("#generate")
    wait_finished(page)
    page.fill("#prompt", "A different prompt")
    page.click("#generate")
    expect(page.locator("[data-testid=confirm-new-tree]")).to_be_visible()
    assert "1 path" in page.inner_text("[data-testid=confirm-new-tree-text]")
    assert row_count(page) == 1
    page.click("[data-testid=confirm-keep]")
    assert page.input_value("#prompt") == "The three primary colors are"
    assert row_count(page) == 1
    page.fill("#prompt", "A different prompt")
    page.click("#generate")
    page.click("[data-testid=confirm-discard]")
    wait_finished(page)
    assert row_count(page) == 1
    expected = request(base_url, "/tokenize", {"prompt": "A different prompt"})["tokens"]
    shown = page.eval_on_selector_all("[data-testid=prompt-token]", "els => els.map(e => Number(e.dataset.tokenId))")
    assert shown == expected
    assert watch.unexpected() == []
    page.close()


def test_stop_leaves_an_engine_view_that_matches_the_engine(browser: object, base_url: str) -> None:
    """Defect 5: after Stop the engine panel settles on what /v1/engine says, and the path says it stopped."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": "400", "seed": str(SEED)})
    page.click("#generate")
    page.wait_for_function("document.querySelectorAll('[data-testid=token]').length >= 3", timeout=90_000)
    page.click("#stop-generation")
    wait_idle(page)
    page.wait_for_function(
        """() => { const el = document.querySelector('[data-testid=engine-requests]');
        return el && el.textContent === '0 / 0'; }""",
        timeout=15_000,
    )
    # The engine publishes its state once per loop pass: the abort shows there within a pass or two.
    deadline = time.monotonic() + 15
    engine = request(base_url, "/v1/engine")
    while engine["num_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
        engine = request(base_url, "/v1/engine")
    assert engine["num_running"] == 0
    page.wait_for_function(
        "n => document.querySelector('[data-testid=engine-blocks-used]').textContent.startsWith(n + ' of')",
        arg=engine["num_blocks_used"],
        timeout=5_000,
    )
    pending = page.inner_text("[data-testid=engine-pending]")
    assert pending.startswith("stopped after") and "appear when" not in pending
    assert page.inner_text("[data-testid=path-status]") == "stopped"
    assert watch.unexpected() == []
    page.close()


# ---------------------------------------------------------------- explanations and legibility


def test_each_stop_kind_reads_differently(browser: object, base_url: str) -> None:
    """Length, a stop string (its tokens marked as trimmed) and, in slow motion, the same limits."""
    page, watch = open_page(browser, base_url)
    prompt_ids = request(base_url, "/tokenize", {"prompt": page.input_value("#prompt")})["tokens"]
    greedy = request(
        base_url, "/v1/completions", {"prompt": prompt_ids, "max_tokens": 6, "temperature": 0, "trace": True}
    )["choices"][0]["trace"]
    stop = next(c["text"] for s in greedy[2:] for c in s["candidates"]
                if c["token_id"] == s["chosen_token_id"] and c["text"].strip() and "\n" not in c["text"])  # fmt: skip
    set_controls(page, **{"max-tokens": "3", "temperature": "0"})
    page.click("#generate")
    wait_finished(page)
    statuses = {
        page.get_attribute("[data-testid=path-status]", "data-stop-kind"): page.inner_text("[data-testid=path-status]")
    }
    set_controls(page, **{"max-tokens": "12", "stop": stop})
    page.click("#generate")
    wait_finished(page, branch_count=2)
    kind = page.get_attribute("[data-testid=path-status]", "data-stop-kind")
    statuses[kind] = page.inner_text("[data-testid=path-status]")
    assert kind == "stop-string" and stop.replace(" ", "␣") in statuses[kind] and "trimmed" in statuses[kind]
    trimmed = page.eval_on_selector_all("[data-testid=token].trimmed", "els => els.map(e => e.textContent)")
    assert trimmed and stop in "".join(trimmed).replace("␣", " ")
    assert set(statuses) == {"length", "stop-string"} and len(set(statuses.values())) == 2
    # Slow motion stops at max tokens too, and says so.
    set_controls(page, **{"max-tokens": "2", "stop": ""})
    page.click("[data-testid=tree-row][data-branch='1'] [data-testid=tree-select]")
    select_token(page, 0)
    page.click("#step-once")
    page.wait_for_selector("[data-testid=stepper-phase][data-phase=appended]", timeout=30_000)
    assert page.get_attribute("[data-testid=path-status]", "data-stop-kind") == "length"
    page.click("#step-once")
    page.wait_for_selector("[data-testid=error]:not([hidden])")
    assert "max tokens" in page.inner_text("[data-testid=error-message]")
    assert len(path_token_ids(page)) == 2
    assert watch.unexpected() == []
    page.close()


def test_greedy_steps_are_one_hot(browser: object, base_url: str) -> None:
    """Defect 11: a greedy step's final distribution is one-hot on the argmax; one token is kept."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": "2", "temperature": "0"})
    page.click("#generate")
    wait_finished(page)
    select_token(page, 0)
    shown = candidates(page)
    assert [c["probFinal"] for c in shown] == [1.0 if c["isChosen"] else 0.0 for c in shown]
    assert shown[0]["isChosen"]
    assert page.inner_text("[data-testid=why-kept]").startswith("1 (greedy")
    assert page.inner_text("[data-testid=why-prob-final]") == "1.000"
    assert "greedy" in page.inner_text("[data-testid=why-method]")
    # Its stage table is the recorded step, ending one-hot; a greedy replay picks the same token.
    path = path_token_ids(page)
    for step in range(len(path)):
        _check_stages_are_recorded_and_replays_equal_them(page, base_url, step, {"temperature": 0})
    assert _stage_rows(page)[path[-1]][-1] == 1.0
    assert watch.unexpected() == []
    page.close()


def test_cache_hint_tells_the_truth_about_short_prompts(browser: object, base_url: str, generated: tuple) -> None:
    """Defect 13: a prompt shorter than one KV block gets no prefix-cache hit, and the hint says so."""
    page, watch = open_page(browser, base_url)
    page.fill("#prompt", "Hi there")
    set_controls(page, **{"max-tokens": "1"})
    page.click("#generate")
    wait_finished(page)
    hint = page.inner_text("[data-testid=cache-hint]")
    assert "shorter than one KV block" in hint and "already in the KV cache" not in hint
    # The chat-templated prompt fills whole blocks: those are what a branch finds in the prefix cache.
    long_page, _ = generated
    assert "whole block" in long_page.inner_text("[data-testid=cache-hint]")
    assert watch.unexpected() == []
    page.close()


def test_layout_colours_and_wording(browser: object, base_url: str) -> None:
    """Defect 14: readable values, a colour-blind-safe scale, units, singulars, everything above the fold."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": "1", "seed": str(SEED)})
    # Prompt, Generate and the token row are above the fold at 1280×800.
    for selector in ("#prompt", "#generate", "#tokens"):
        box = page.locator(selector).bounding_box()
        assert box["y"] + box["height"] <= 800, selector
    page.click("#generate")
    wait_finished(page)
    # Measured in the page: the chip is re-rendered as engine stats arrive, so a handle could go stale.
    assert page.eval_on_selector("[data-testid=token]", "e => e.getBoundingClientRect().bottom") <= 800
    select_token(page, 0)
    # Probability values: at least 11 px, beside the bar rather than printed on it.
    # Read in one page-side check that retries while the panel re-renders (a detached element has no style).
    sizes_js = "() => [...document.querySelectorAll('.bar-value')].map(e => parseFloat(getComputedStyle(e).fontSize))"
    page.wait_for_function(
        f"() => {{ const s = ({sizes_js})(); return s.length > 0 && s.every(v => !isNaN(v)); }}", timeout=10_000
    )
    sizes = page.evaluate(sizes_js)
    assert sizes and min(sizes) >= 11
    assert page.eval_on_selector_all(".bar-track .bar-value", "els => els.length") == 0
    # Viridis: its dark end (68, 1, 84) and light end (253, 231, 37) are on the legend.
    legend = page.eval_on_selector(".legend-bar", "e => getComputedStyle(e).backgroundImage")
    assert "rgb(68, 1, 84)" in legend and "rgb(253, 231, 37)" in legend
    text = page.inner_text("body")
    assert "null" not in text and "undefined" not in text
    assert "1 token " in text or "1 token\n" in text or "1 token)" in text
    for wrong in ("1 tokens", "1 blocks", "1 KV blocks", "step 0 of", "1 passes", "1 decode passes"):
        assert wrong not in text, wrong
    assert "token 1 of 1" in page.inner_text("[data-testid=why-step]")
    shape = page.inner_text("[data-testid=engine-shape]")
    assert "tokens per block" in shape and "tokens max" in shape
    assert "int8 keys and values" in shape and "weights" not in shape  # the default pool; never a weight format
    assert "bytes" in page.inner_text("[data-testid=kv-bytes]") or "KiB" in page.inner_text("[data-testid=kv-bytes]")
    assert watch.unexpected() == []
    page.close()


CONTRAST_JS = """el => { const lum = c => { const [r, g, b] = c.match(/\\d+/g).slice(0, 3).map(v => {
    v = Number(v) / 255; return v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const style = getComputedStyle(el); const a = lum(style.color), b = lum(style.backgroundColor);
  return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05); }"""


def test_focus_live_text_and_contrast(browser: object, base_url: str) -> None:
    """Defect 12: Generate keeps the keyboard focus, the finished text is announced, chips and lanes are legible."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": "8", "seed": str(SEED), "temperature": "1.2"})
    page.focus("#generate")
    page.keyboard.press("Enter")
    wait_finished(page)
    assert page.evaluate("document.activeElement.id") == "generate"
    assert page.get_attribute("[data-testid=path-text]", "aria-live") == "polite"
    text = page.evaluate("pathOf(currentBranch()).map(t => t.text).join('')")
    page.wait_for_function("t => document.querySelector('[data-testid=path-text]').textContent.startsWith(t)", arg=text)
    # Queried and measured in one task of the page: a chip a render replaces between the two has no style.
    ratios = page.evaluate(f"() => [...document.querySelectorAll('[data-testid=token]')].map({CONTRAST_JS})")
    assert min(ratios) >= 4.5, ratios
    # Every colour of the scale, not only the ones this path happened to use.
    scale = page.evaluate(f"""() => [...Array(101).keys()].map(i => {{ const e = document.createElement('span');
        e.style.cssText = `background:${{probColor(i / 100)}};color:${{probInk(i / 100)}}`; document.body.append(e);
        const ratio = ({CONTRAST_JS})(e); e.remove(); return ratio; }})""")
    assert min(scale) >= 4.5
    page.wait_for_selector(".lane-label")
    sizes = page.evaluate(
        "() => [...document.querySelectorAll('.lane-label')].map(e => parseFloat(getComputedStyle(e).fontSize))"
    )
    assert min(sizes) >= 12
    assert watch.unexpected() == []
    page.close()


def test_narrow_screen_has_no_horizontal_scroll(browser: object, base_url: str) -> None:
    page, watch = open_page(browser, base_url, width=400, height=800)
    set_controls(page, **{"max-tokens": "3", "seed": str(SEED)})
    page.fill("#prompt", "Once upon a time")
    expected = request(base_url, "/tokenize", {"prompt": "Once upon a time"})["tokens"]
    page.wait_for_function(
        "n => document.querySelectorAll('[data-testid=prompt-token]').length === n", arg=len(expected)
    )
    page.click("#generate")
    wait_finished(page)
    shown = page.eval_on_selector_all("[data-testid=prompt-token]", "els => els.map(e => Number(e.dataset.tokenId))")
    assert shown == expected
    page.click("[data-testid=token][data-step='0']")
    assert page.evaluate("document.documentElement.scrollWidth") <= 400
    screenshot(page, "narrow.png")
    assert watch.unexpected() == []
    page.close()


def test_no_contrast_or_focus_violations(browser: object, base_url: str) -> None:
    """An axe-core stand-in run in the page: every visible text meets AA contrast against what is behind it, every
    focusable control has a name and no positive tabindex, and Tab walks the controls with the focus drawn."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": "8", "seed": str(SEED), "temperature": "1.2"})
    page.click("#generate")
    wait_finished(page)
    select_token(page, 2)
    page.click("[data-testid=show-stages]")
    page.wait_for_selector("[data-testid=stages-table]")
    page.click("#step-once")
    page.wait_for_selector("[data-testid=stepper-phase][data-phase=appended]", timeout=30_000)
    _select_path(page, 1)
    page.wait_for_selector("[data-testid=kv-compare]")
    problems = page.evaluate(ACCESSIBILITY_JS)
    assert problems == [], "\n".join(problems)
    order = focus_order(page, 30)
    assert all(stop["tag"] != "body" for stop in order), order
    assert all(stop["drawn"] for stop in order), [(s["tag"], s["id"], s["testid"]) for s in order if not s["drawn"]]
    # The controls come first, in reading order: prompt, then Generate and Step one token.
    ids = [stop["id"] for stop in order]
    assert ids.index("prompt") < ids.index("generate") < ids.index("step-once")
    assert watch.unexpected() == []
    page.close()
