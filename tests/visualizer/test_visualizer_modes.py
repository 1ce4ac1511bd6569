"""Browser tests of the visualizer's modes: slow-motion stepping, "N samples from here" and the batching timeline.

They share the session's server and browser (conftest.py) with test_visualizer_page.py, and check what the page
shows against the API: a stepped token is the API's one-token answer for the same seed, the samples are the
choices of one n-sample request, and the timeline's passes are the engine's.
"""

from __future__ import annotations

from visualizer_harness import (
    CHAT_REQUEST,
    PROMPT,
    SEED,
    TEMPERATURE,
    doc_screenshot,
    open_page,
    path_token_ids,
    request,
    row_count,
    screenshot,
    select_token,
    set_controls,
    wait_finished,
)

PHASES_TIMEOUT_MS = 30_000


def _default_prompt_ids(base_url: str, page: object) -> list[int]:
    return request(base_url, "/tokenize", {"prompt": page.input_value("#prompt")})["tokens"]


def _stepped_reference(base_url: str, prompt_ids: list[int], seed: int) -> int:
    body = {
        "prompt": prompt_ids,
        "max_tokens": 1,
        "temperature": TEMPERATURE,
        "seed": seed,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "trace": True,
    }
    return request(base_url, "/v1/completions", body)["choices"][0]["trace"][0]["chosen_token_id"]


def test_step_through_shows_each_phase_of_one_token(browser: object, base_url: str) -> None:
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"seed": str(SEED), "temperature": str(TEMPERATURE)})
    page.click("#step-once")
    page.wait_for_selector("[data-testid=stepper-phase][data-phase=appended]", timeout=PHASES_TIMEOUT_MS)
    phases = page.eval_on_selector_all("[data-testid=stepper-phase]", "els => els.map(e => e.dataset.phase)")
    # Context and forward pass, logits, the sampling stages in order, the draw, the token appended.
    assert phases[:2] == ["forward", "logits"] and phases[-2:] == ["draw", "appended"]
    assert set(phases[2:-2]) == {"stage"}
    draw = page.locator("[data-testid=stepper-draw]")
    uniform, start, end = (float(draw.get_attribute(f"data-{name}")) for name in ("uniform", "cdf-start", "cdf-end"))
    assert start <= uniform < end + 1e-6
    prompt_ids = _default_prompt_ids(base_url, page)
    new_slots = int(page.inner_text("[data-testid=stepper-new-slots]").split()[0])
    assert new_slots == len(prompt_ids)  # a prompt shorter than one block: nothing cached, every slot computed
    assert page.locator("[data-testid=kv-strip-new]").count() == new_slots
    assert page.locator("[data-testid=kv-strip-next]").count() == 1
    # The stage phases are the step's recorded stages (the top eight candidates of each).
    trace = page.evaluate("pathOf(currentBranch())[0].trace")
    top = sorted(range(len(trace["candidates"])), key=lambda i: trace["candidates"][i]["rank"])[:8]
    phase_probs = page.eval_on_selector_all(
        "[data-testid=stage-phase-prob]", "els => els.map(e => Number(e.dataset.prob))"
    )
    assert trace["stages"] and phase_probs == [stage["probs"][i] for stage in trace["stages"] for i in top]
    # The stepped token is the engine's: a one-token request with the position's seed.
    first = _stepped_reference(base_url, prompt_ids, SEED)
    assert path_token_ids(page) == [first]
    page.click("[data-testid=stepper-next]")
    page.wait_for_function("document.querySelectorAll('[data-testid=token]').length === 2", timeout=PHASES_TIMEOUT_MS)
    page.wait_for_selector("[data-testid=stepper-phase][data-phase=appended]", timeout=PHASES_TIMEOUT_MS)
    second = _stepped_reference(base_url, prompt_ids + [first], SEED + 1)
    assert path_token_ids(page) == [first, second]
    assert row_count(page) == 1
    # Phase by phase: each phase waits for a click.
    page.check("[data-testid=phase-by-phase]")
    page.click("[data-testid=stepper-next]")
    page.wait_for_function("document.querySelectorAll('[data-testid=token]').length === 3", timeout=PHASES_TIMEOUT_MS)
    page.wait_for_selector("[data-testid=stepper-phase][data-phase=forward]")
    clicks = 0
    while page.locator("[data-testid=stepper-phase][data-phase=appended]").count() == 0:
        assert page.locator("[data-testid=stepper-phase]").count() == clicks + 1
        page.click("[data-testid=stepper-next-phase]")
        clicks += 1
    assert clicks == len(phases) - 1
    expect_hidden = page.locator("[data-testid=stepper-next-phase]")
    assert expect_hidden.is_hidden()
    screenshot(page, "step-through.png")
    doc_screenshot(page, "[data-testid=stepper]", "visualizer-step-through.png")
    assert watch.unexpected() == []
    page.close()


def test_samples_from_here_share_the_prefix_and_the_passes(browser: object, base_url: str) -> None:
    page, watch = open_page(browser, base_url)
    page.fill("#prompt", PROMPT)
    page.check("#chat-template")
    set_controls(page, **{"max-tokens": "4", "seed": str(SEED), "temperature": str(TEMPERATURE), "samples": "3"})
    page.click("#generate")
    wait_finished(page)
    root = path_token_ids(page)
    select_token(page, 1)
    page.click("[data-testid=samples-from-here]")
    wait_finished(page, branch_count=4)
    prompt_ids = request(base_url, "/tokenize", CHAT_REQUEST)["tokens"]
    reference = request(
        base_url,
        "/v1/completions",
        {
            "prompt": prompt_ids + root[:2],
            "max_tokens": 2,
            "n": 3,
            "seed": SEED,
            "temperature": TEMPERATURE,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "trace": True,
        },
    )
    expected = {c["index"]: [s["chosen_token_id"] for s in c["trace"]] for c in reference["choices"]}
    branches = page.eval_on_selector_all("[data-testid=tree-row]", "els => els.map(e => e.dataset.branch)")[1:]
    for index, branch in enumerate(branches):
        page.click(f"[data-testid=tree-row][data-branch='{branch}'] [data-testid=tree-select]")
        page.wait_for_selector(f"[data-testid=path-info] .badge:text-is('path {branch}')")
        assert path_token_ids(page) == root[:2] + expected[index]
        assert f"sample {index + 1} of 3" in page.inner_text(f"[data-testid=tree-row][data-branch='{branch}']")
    # The samples' requests found the prompt's whole blocks in the prefix cache...
    cached = int(page.inner_text("[data-testid=num-prompt]").split("(")[1].rstrip(")"))
    assert cached >= 16
    # ...and ran together: some forward pass carried all three as decode rows.
    lanes = sorted(f"path {b}" for b in branches)
    page.wait_for_function(
        """lanes => {
        const byPass = {};
        for (const e of document.querySelectorAll('[data-testid=timeline-cell]'))
          if (lanes.includes(e.dataset.lane) && e.dataset.kind === 'decode')
            (byPass[e.dataset.pass] = byPass[e.dataset.pass] || new Set()).add(e.dataset.lane);
        return Object.values(byPass).some(s => s.size === lanes.length); }""",
        arg=lanes,
        timeout=10_000,
    )
    screenshot(page, "samples.png")
    doc_screenshot(page, "[data-testid=pass-timeline]", "visualizer-batching.png")
    doc_screenshot(page, "[data-testid=tree]", "visualizer-samples-tree.png")
    assert watch.unexpected() == []
    page.close()


def test_timeline_tells_prompt_chunks_from_decode_rows(browser: object, base_url: str) -> None:
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": "3", "seed": str(SEED)})
    page.click("#generate")
    wait_finished(page)
    page.wait_for_function("document.querySelectorAll(\"[data-testid=timeline-cell][data-lane='path 1']\").length >= 3")
    cells = page.eval_on_selector_all(
        "[data-testid=timeline-cell][data-lane='path 1']", "els => els.map(e => e.dataset.kind)"
    )
    # One prompt chunk, then one decode row per further token (the first token comes with the prefill).
    assert cells == ["prefill", "decode", "decode"]
    assert watch.unexpected() == []
    page.close()


def test_two_runs_compare_side_by_side(browser: object, base_url: str) -> None:
    """Two runs of one prompt at two temperatures: aligned, the first divergent token marked, both finals shown."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"max-tokens": "4", "seed": str(SEED), "temperature": "0"})
    page.click("#generate")
    wait_finished(page)
    greedy = path_token_ids(page)
    # A hot run can follow the greedy path and stop early (EOS): then nothing diverges, so try the next seed.
    for runs, seed in enumerate(("3", "4", "5", "6"), start=2):
        set_controls(page, **{"temperature": "1.8", "seed": seed})
        page.click("#generate")
        wait_finished(page, branch_count=runs)
        hot = path_token_ids(page)
        split = next((i for i, (a, b) in enumerate(zip(greedy, hot)) if a != b), None)
        if split is not None:
            break
    assert split is not None, "every hot run followed the greedy path; pick other seeds"
    page.locator("[data-testid=compare-check]").nth(0).check()
    page.locator("[data-testid=compare-check]").nth(runs - 1).check()
    assert int(page.get_attribute("[data-testid=compare-divergence]", "data-step")) == split
    finals = page.eval_on_selector_all("[data-testid=compare-final]", "els => els.map(e => e.textContent)")
    greedy_finals, hot_finals = finals[0::2], finals[1::2]
    # The greedy run's final distribution is one-hot; the hot run's spreads over the candidates.
    assert sorted(greedy_finals)[-1] == "1.000" and greedy_finals.count("0.000") == len(greedy_finals) - 1
    assert hot_finals.count("0.000") < len(hot_finals) - 1
    assert watch.unexpected() == []
    page.close()
