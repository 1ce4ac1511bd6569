"""The cost of a token in the visualizer, against the engine and the model file.

The references: the parameter count of the GGUF file itself (its tensors' elements, the tied embedding stored
once) and the engine's cost route; the batch plot and the roofline against the engine's pass log (one point per
logged pass, each pass's bytes as the engine counted them); a load's requests against their own metrics.
"""

from __future__ import annotations

import pytest
from visualizer_harness import (
    ACCESSIBILITY_JS,
    GENERATION_TIMEOUT_MS,
    doc_screenshot,
    open_page,
    request,
)

NUM_LOAD_REQUESTS = 4


def _open_cost_panel(browser: object, base_url: str) -> tuple[object, object]:
    page, watch = open_page(browser, base_url)
    page.wait_for_selector("[data-testid=cost-parameters]")
    return page, watch


def _last_pass(base_url: str) -> int:
    passes = request(base_url, "/v1/visualizer/passes")["passes"]
    return passes[-1]["pass"] if passes else 0


def _shown_passes(page: object, testid: str) -> list[int]:
    return page.eval_on_selector_all(f"[data-testid={testid}]", "els => els.map(e => Number(e.dataset.pass))")


def test_the_parameter_count_is_the_engines_and_the_model_files(
    browser: object, base_url: str, default_model_path: str
) -> None:
    gguf = pytest.importorskip("gguf")
    cost = request(base_url, "/v1/visualizer/cost")
    in_file = sum(int(tensor.n_elements) for tensor in gguf.GGUFReader(default_model_path).tensors)
    assert cost["num_parameters"] == in_file
    page, watch = _open_cost_panel(browser, base_url)
    shown = {
        name: int(page.get_attribute(f"[data-testid=cost-{name}]", "data-value"))
        for name in ("parameters", "multiply-adds", "weight-bytes")
    }
    assert shown == {
        "parameters": cost["num_parameters"],
        "multiply-adds": cost["multiply_adds_per_token"],
        "weight-bytes": cost["weight_bytes_per_pass"],
    }
    assert page.inner_text("[data-testid=cost-parameters]") == f"{in_file:,}"
    # Both ceilings of the roofline are drawn, from the machine the server measured.
    assert page.locator("[data-testid=roofline-bandwidth]").count() == 1
    assert page.locator("[data-testid=roofline-compute]").count() == 1
    assert watch.unexpected() == []
    page.close()


def test_the_batch_plot_gains_a_point_per_logged_pass(browser: object, base_url: str) -> None:
    page, watch = _open_cost_panel(browser, base_url)
    before = _last_pass(base_url)
    num_points = page.locator("[data-testid=batch-point]").count()
    # One request alone, then K together: the load table sets the two runs side by side.
    for k, num_runs in ((1, 1), (NUM_LOAD_REQUESTS, 2)):
        page.fill("#load-requests", str(k))
        page.click("#run-load")
        page.wait_for_function(
            "n => document.querySelectorAll('[data-testid=load-run][data-state=done]').length === n",
            arg=num_runs,
            timeout=GENERATION_TIMEOUT_MS,
        )
    logged = request(base_url, f"/v1/visualizer/passes?since={before}")["passes"]
    assert logged and all(p["seconds"] > 0 and p["num_tokens"] >= 1 for p in logged)
    assert max(len(p["rows"]) for p in logged) > 1  # the K requests shared passes
    expected = num_points + len(logged)
    page.wait_for_function(
        "n => document.querySelectorAll('[data-testid=batch-point]').length === n", arg=expected, timeout=10_000
    )
    new_passes = [p["pass"] for p in logged]
    assert [n for n in _shown_passes(page, "batch-point") if n > before] == new_passes
    assert [n for n in _shown_passes(page, "roofline-point") if n > before] == new_passes
    # The table's newest row reads what the engine counted for that pass.
    newest = page.locator("[data-testid=cost-pass-row]").first
    assert int(newest.get_attribute("data-pass")) == logged[-1]["pass"]
    assert int(newest.locator("[data-testid=cost-pass-bytes]").get_attribute("data-value")) == logged[-1]["bytes_read"]
    run = page.locator("[data-testid=load-run]").last
    assert run.get_attribute("data-requests") == str(NUM_LOAD_REQUESTS)
    assert run.locator("[data-testid=load-queue-time]").inner_text().endswith("ms")
    assert f"{NUM_LOAD_REQUESTS} requests done" in page.inner_text("[data-testid=load-status]")
    assert page.evaluate(ACCESSIBILITY_JS) == []
    doc_screenshot(page, "[data-testid=cost-panel]", "visualizer-cost.png")
    assert watch.unexpected() == []
    page.close()


def test_k_is_bounded_and_the_load_runs_from_the_keyboard(browser: object, base_url: str) -> None:
    page, watch = _open_cost_panel(browser, base_url)
    before = _last_pass(base_url)
    page.fill("#load-requests", "17")
    page.focus("#run-load")
    page.keyboard.press("Enter")
    page.wait_for_selector("[data-testid=error]:not([hidden])")
    assert "1 to 16" in page.inner_text("[data-testid=error-message]")
    assert page.get_attribute("#load-requests", "aria-invalid") == "true"
    assert _last_pass(base_url) == before  # nothing was sent
    page.fill("#load-requests", "2")
    page.focus("#load-requests")
    page.keyboard.press("Enter")
    page.wait_for_selector("[data-testid=load-run][data-state=done]", timeout=GENERATION_TIMEOUT_MS)
    assert page.get_attribute("#load-requests", "aria-invalid") is None
    assert page.evaluate("document.activeElement.id") == "load-requests"
    assert watch.unexpected() == []
    page.close()
