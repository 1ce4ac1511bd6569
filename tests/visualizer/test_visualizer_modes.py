"""Browser tests of the visualizer's modes: slow-motion stepping, "N samples from here" and the batching timeline.

They share the session's server and browser (conftest.py) with test_visualizer_page.py, and check what the page
shows against the API: a stepped token is the API's one-token answer for the same seed, the samples are the
choices of one n-sample request, and the timeline's passes are the engine's.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    running_server,
    screenshot,
    select_token,
    set_controls,
    wait_finished,
)

PHASES_TIMEOUT_MS = 30_000


def _default_prompt_ids(base_url: str, page: object) -> list[int]:
    return request(base_url, "/tokenize", {"prompt": page.input_value("#prompt")})["tokens"]


def _generated_reference(base_url: str, prompt_ids: list[int], max_tokens: int, temperature: float) -> list[int]:
    """The tokens of the request Generate sends for the page's default settings: what slow motion plays back."""
    body = {
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": SEED,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "trace": True,
    }
    return [s["chosen_token_id"] for s in request(base_url, "/v1/completions", body)["choices"][0]["trace"]]


def _next_token(page: object, count: int) -> None:
    """Press "next token" and wait until the path has `count` tokens and the new token's phases are complete."""
    page.click("[data-testid=stepper-next]")
    page.wait_for_function(
        "n => document.querySelectorAll('[data-testid=token]').length === n", arg=count, timeout=PHASES_TIMEOUT_MS
    )
    page.wait_for_selector("[data-testid=stepper-phase][data-phase=appended]", timeout=PHASES_TIMEOUT_MS)


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
    # The stepped path is the engine's: one request for the whole path, the one Generate sends, played back.
    reference = _generated_reference(base_url, prompt_ids, 24, TEMPERATURE)
    assert path_token_ids(page) == reference[:1]
    _next_token(page, 2)
    assert path_token_ids(page) == reference[:2]
    assert row_count(page) == 1
    # Phase by phase: each phase waits for a click.
    page.check("[data-testid=phase-by-phase]")
    page.click("[data-testid=stepper-next]")
    page.wait_for_function("document.querySelectorAll('[data-testid=token]').length === 3", timeout=PHASES_TIMEOUT_MS)
    page.wait_for_selector("[data-testid=stepper-phase][data-phase=forward]")
    assert path_token_ids(page) == reference[:3]
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


def test_slow_motion_pass_k_computes_one_new_kv_slot(browser: object, base_url: str) -> None:
    """The prompt's pass computes the prompt (less the cached blocks); every later pass computes one new KV slot,
    and each pass the page names is the engine's logged pass for this request."""
    page, watch = open_page(browser, base_url)
    page.fill("#prompt", PROMPT)
    page.check("#chat-template")
    set_controls(page, **{"seed": str(SEED), "temperature": str(TEMPERATURE), "max-tokens": "6"})
    page.click("#step-once")
    page.wait_for_selector("[data-testid=stepper-phase][data-phase=appended]", timeout=PHASES_TIMEOUT_MS)
    prompt_ids = request(base_url, "/tokenize", CHAT_REQUEST)["tokens"]
    forward = "[data-testid=stepper-phase][data-phase=forward]"
    request_id = page.get_attribute(forward, "data-request-id")
    logged = [
        (p["pass"], row)
        for p in request(base_url, "/v1/visualizer/passes?since=0")["passes"]
        for row in p["rows"]
        if row["request_id"] == request_id
    ]
    prompt_rows = [(n, row) for n, row in logged if row["is_prompt"]]
    decode_rows = [(n, row) for n, row in logged if not row["is_prompt"]]
    assert len(decode_rows) == 5 and all(row["num_tokens"] == 1 for _, row in decode_rows)
    for step in range(6):
        if step:
            _next_token(page, step + 1)
        new_slots = int(page.get_attribute("[data-testid=stepper-new-slots]", "data-new-slots"))
        cached = int(page.get_attribute("[data-testid=stepper-cached]", "data-cached"))
        context = int(page.get_attribute(forward, "data-context"))
        passes = [int(p) for p in page.get_attribute(forward, "data-passes").split(",")]
        assert context == len(prompt_ids) + step
        if step == 0:
            # The prompt's pass: cached vs new, as the engine computed them.
            assert passes == [n for n, _ in prompt_rows]
            assert new_slots == sum(row["num_tokens"] for _, row in prompt_rows) == context - cached
            assert page.locator("[data-testid=kv-strip-new]").count() == new_slots
        else:
            # Pass k: one new KV slot, every earlier one read from the cache.
            assert passes == [decode_rows[step - 1][0]]
            assert new_slots == 1 and cached == context - 1
            assert page.locator("[data-testid=kv-strip-new]").count() == 1
    assert path_token_ids(page) == _generated_reference(base_url, prompt_ids, 6, TEMPERATURE)
    assert page.get_attribute("[data-testid=path-status]", "data-stop-kind") == "length"
    assert watch.unexpected() == []
    page.close()


def test_step_n_times_then_generate_give_the_same_text(browser: object, base_url: str, tmp_path: Path) -> None:
    """Greedy is reproducible on the page: eight stepped tokens at T 0 are the first eight Generate writes. Stepping
    once sent one request per token, each prefilling its context anew; now a stepped path is the request Generate
    sends, played back, and under the default (exact) numerics either way gives the same tokens. An import that
    replays differently names the cause it finds at the first differing token."""
    page, watch = open_page(browser, base_url)
    set_controls(page, **{"seed": str(SEED), "temperature": "0", "max-tokens": "8"})
    page.click("#step-once")
    page.wait_for_selector("[data-testid=stepper-phase][data-phase=appended]", timeout=PHASES_TIMEOUT_MS)
    for count in range(2, 9):
        _next_token(page, count)
    page.click("#generate")
    wait_finished(page, branch_count=2)
    texts = page.evaluate("state.branches.map(b => pathOf(b).map(t => t.text).join(''))")
    ids = page.evaluate("state.branches.map(b => pathOf(b).map(t => t.id))")
    assert len(ids[0]) == 8 and ids[0] == ids[1] and texts[0] == texts[1]
    assert ids[1] == _generated_reference(base_url, _default_prompt_ids(base_url, page), 8, 0)
    # An export whose numbers no longer match this server: the import names what differs, and where.
    with page.expect_download() as download_info:
        page.click("#export-tree")
    exported = json.loads(Path(download_info.value.path()).read_text())
    assert exported["version"] == 2 and [p["kind"] for p in exported["paths"]] == ["step", "generate"]
    stepped, generated = exported["paths"]
    exported["paths"] = [stepped]
    exported["version"] = 1
    stepped["token_ids"][3] = ids[0][3] + 1
    tampered = tmp_path / "old-steps.json"
    tampered.write_text(json.dumps(exported))
    other, other_watch = open_page(browser, base_url)
    other.set_input_files("#import-tree", str(tampered))
    other.wait_for_selector("[data-testid=import-report]", timeout=90_000)
    report = other.inner_text("[data-testid=import-report]")
    assert "path 1 (at token 4" in report and "one request per token" in report
    exported["paths"] = [generated]
    exported["version"] = 2
    generated["traces"][2]["chosen_prob_raw"] /= 2
    tampered.write_text(json.dumps(exported))
    other.click("#clear-tree")
    other.set_input_files("#import-tree", str(tampered))
    other.wait_for_function(
        "() => (document.querySelector('[data-testid=import-report]') || {}).textContent?.includes('raw probability')",
        timeout=90_000,
    )
    report = other.inner_text("[data-testid=import-report]")
    assert "path 2 (at token 3" in report and "another model or other numerics" in report
    assert watch.unexpected() == [] and other_watch.unexpected() == []
    other.close()
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
    # Per-path figures from the engine: each sample is its own engine request (`<id>-0#<i>`), and its passes are
    # the pass log's rows of that request; they add up to the request's.
    logged = request(base_url, "/v1/visualizer/passes?since=0")["passes"]
    own_passes, own_tokens = [], []
    for branch in branches:
        page.click(f"[data-testid=tree-row][data-branch='{branch}'] [data-testid=tree-select]")
        page.wait_for_selector(f"[data-testid=path-info] .badge:text-is('path {branch}')")
        page.wait_for_selector("[data-testid=path-share]")
        engine_id = page.evaluate("engineRequestId(currentBranch())")
        passes = {p["pass"] for p in logged for row in p["rows"] if row["request_id"] == engine_id}
        assert int(page.inner_text("[data-testid=num-forward-passes]")) == len(passes)
        own_passes.append(passes)
        own_tokens.append(page.evaluate("generatedCount(currentBranch())"))
    metrics = page.evaluate("currentBranch().metrics")
    assert sum(own_tokens) == metrics["num_generated_tokens"]
    assert len(set().union(*own_passes)) == metrics["num_forward_passes"]
    share = page.inner_text("[data-testid=path-share]")
    assert f"the request's {metrics['num_generated_tokens']} tokens = {' + '.join(map(str, own_tokens))}" in share
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


def _ms(seconds: float) -> str:
    """The page's fmtMs."""
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def test_prefill_and_decode_per_token_with_the_warm_up_marked(browser: object) -> None:
    """Time per prompt token against time per decode token, from the request's metrics; the first request after the
    server starts is marked as the warm-up, and the next one is not."""
    with running_server(name="warmup") as url:
        page, watch = open_page(browser, url)
        set_controls(page, **{"max-tokens": "4", "seed": str(SEED)})
        page.click("#generate")
        wait_finished(page)
        page.wait_for_selector("[data-testid=warmup]")
        assert "(warm-up)" in page.inner_text("[data-testid=ttft]")
        page.click("#generate")
        wait_finished(page, branch_count=2)
        page.wait_for_selector("[data-testid=prefill-vs-decode]")
        assert page.locator("[data-testid=warmup]").count() == 0
        assert "warm-up" not in page.inner_text("[data-testid=ttft]")
        m = page.evaluate("currentBranch().metrics")
        per_prompt = m["time_to_first_token"] / (m["num_prompt_tokens"] - m["num_cached_tokens"])
        shown = page.inner_text("[data-testid=prefill-vs-decode]")
        assert shown.startswith(f"{_ms(per_prompt)} per prompt token computed vs {_ms(m['time_per_output_token'])}")
        assert "cheaper per token" in shown or "dearer per token" in shown
        assert watch.unexpected() == []
        page.close()


def test_kv_cache_comparison_is_the_pass_logs_arithmetic(browser: object, base_url: str) -> None:
    """With the cache: the slots the engine's passes computed for the path; without it: the whole context at every
    step, prompt + k, growing with n."""
    page, watch = open_page(browser, base_url)
    page.fill("#prompt", PROMPT)
    page.check("#chat-template")
    set_controls(page, **{"max-tokens": "6", "seed": str(SEED), "temperature": str(TEMPERATURE)})
    page.click("#generate")
    wait_finished(page)
    page.wait_for_selector("[data-testid=kv-compare]")
    engine_id = page.evaluate("engineRequestId(currentBranch())")
    rows = [
        row
        for p in request(base_url, "/v1/visualizer/passes?since=0")["passes"]
        for row in p["rows"]
        if row["request_id"] == engine_id
    ]
    context = len(request(base_url, "/tokenize", CHAT_REQUEST)["tokens"])
    generated = len(path_token_ids(page))
    steps = page.eval_on_selector_all(
        "[data-testid=kv-compare-step]", "els => els.map(e => [Number(e.dataset.with), Number(e.dataset.without)])"
    )
    assert [without for _, without in steps] == [context + k for k in range(generated)]
    prompt_slots = sum(row["num_tokens"] for row in rows if row["is_prompt"])
    assert [with_cache for with_cache, _ in steps] == [prompt_slots] + [1] * (generated - 1)
    assert int(page.get_attribute("[data-testid=kv-compare-with]", "data-slots")) == sum(r["num_tokens"] for r in rows)
    total_without = generated * context + generated * (generated - 1) // 2
    assert int(page.get_attribute("[data-testid=kv-compare-without]", "data-slots")) == total_without
    assert "not measured" in page.inner_text("[data-testid=kv-compare-time]")
    assert "no request ran without it" in page.inner_text("[data-testid=kv-compare]")
    doc_screenshot(page, "[data-testid=kv-compare]", "visualizer-kv-cache.png")
    assert watch.unexpected() == []
    page.close()
