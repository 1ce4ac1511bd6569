"use strict";
/*
 * The batching timeline: the engine's recent forward passes (GET /v1/visualizer/passes), one column per pass,
 * one lane per request. A cell is a request's share of that pass: a prompt chunk (many tokens, prefill) or a
 * decode row (one token, plus draft tokens under speculative decoding). Requests that share a column shared
 * that forward pass: that is batching. Lanes are named after the page's paths; a request the page did not
 * start (another client, or a replay) is named as such.
 */

// Passes kept on screen: the last few generations' worth, so the grid stays readable.
const TIMELINE_PASSES = 48;

// Passes kept per engine request (slow motion, per-sample counts): every request's rows since the page opened, up
// to the engine's own log length, so a path's count never loses passes that scrolled off the grid.
const REQUEST_PASSES = 4096;

const timeline = {
  passes: [],
  lastPass: 0,
  requestLabels: new Map(),
  // Engine request id → [{pass, row}], oldest first.
  rowsByRequest: new Map(),
  numRows: 0,
  inflight: null,
  again: false,
};

/** Remember which path (or replay) a response id belongs to, so its engine request gets a readable lane name. */
function labelRequest(responseId, label) {
  if (responseId) timeline.requestLabels.set(responseId, label);
}

/**
 * The engine's request id of `branch`'s request: `<response id>-0`, plus `#<choice>` for each of n samples (null
 * before its first chunk arrived).
 */
function engineRequestId(branch) {
  for (const [responseId, label] of timeline.requestLabels) {
    if (!Array.isArray(label)) continue;
    const index = label.indexOf(branch);
    if (index < 0) continue;
    return label.length > 1 || branch.params.n ? `${responseId}-0#${index}` : `${responseId}-0`;
  }
  return null;
}

/** The logged passes that computed `branch`'s request, oldest first: [{pass, row}]. */
function passRowsOf(branch) {
  const id = engineRequestId(branch);
  return (id && timeline.rowsByRequest.get(id)) || [];
}

/**
 * The engine's request id is `<response id>-<prompt index>`, plus `#<choice>` for each of n samples or
 * `#beam<j>` for each beam of a beam search (its beams share its lane).
 */
function laneLabel(requestId) {
  const match = /^(.*)-(\d+)(?:#(\d+)|#beam\d+)?$/.exec(requestId);
  if (!match) return "another request";
  const label = timeline.requestLabels.get(match[1]);
  if (label === undefined) return "another request";
  if (typeof label === "string") return label;
  const branch = label[Number(match[3] || 0)];
  return branch ? `path ${branch.id}` : "another request";
}

/**
 * Fetch the passes logged since the last fetch. Calls that arrive while a fetch is in flight wait for it and for
 * one more round after it: a request's last pass, logged while an earlier fetch was on its way, is never missed.
 */
function refreshPasses() {
  if (timeline.inflight) {
    timeline.again = true;
    return timeline.inflight;
  }
  timeline.inflight = (async () => {
    do {
      timeline.again = false;
      await fetchPassesOnce();
    } while (timeline.again);
    timeline.inflight = null;
    scheduleRender();
  })();
  return timeline.inflight;
}

async function fetchPassesOnce() {
  try {
    const body = await apiJson(`/v1/visualizer/passes?since=${timeline.lastPass}`);
    if (body.passes.length) {
      timeline.passes = timeline.passes.concat(body.passes).slice(-TIMELINE_PASSES);
      addCostPasses(body.passes);
      for (const pass of body.passes) {
        for (const row of pass.rows) {
          if (!timeline.rowsByRequest.has(row.request_id)) timeline.rowsByRequest.set(row.request_id, []);
          timeline.rowsByRequest.get(row.request_id).push({ pass: pass.pass, row });
          timeline.numRows += 1;
        }
      }
      // Oldest requests go first when the store is full.
      for (const [id, rows] of timeline.rowsByRequest) {
        if (timeline.numRows <= REQUEST_PASSES) break;
        timeline.rowsByRequest.delete(id);
        timeline.numRows -= rows.length;
      }
      timeline.lastPass = body.passes[body.passes.length - 1].pass;
    }
  } catch (_) {
    // A server without the visualizer routes: the panel simply shows no timeline.
  }
}

/** Start from the engine's current counter, so the first generation is not buried under older passes. */
async function initTimeline() {
  try {
    const body = await apiJson("/v1/visualizer/passes?since=0");
    const passes = body.passes;
    timeline.lastPass = passes.length ? passes[passes.length - 1].pass : 0;
  } catch (_) {
    timeline.lastPass = 0;
  }
}

function passTimeline() {
  const passes = timeline.passes;
  if (!passes.length) return null;
  const lanes = [...new Set(passes.flatMap((p) => p.rows.map((r) => laneLabel(r.request_id))))];
  const cellW = 12;
  const laneH = 16;
  const labelW = 110;
  const width = labelW + passes.length * cellW;
  const height = lanes.length * laneH + 4;
  const shapes = lanes.map((lane, i) => svgEl("text", { x: 0, y: i * laneH + 12, class: "lane-label", text: lane }));
  passes.forEach((pass, column) => {
    const shared = pass.rows.length;
    pass.rows.forEach((row) => {
      const lane = lanes.indexOf(laneLabel(row.request_id));
      const kind = row.is_prompt ? "prefill" : "decode";
      shapes.push(
        svgEl(
          "rect",
          {
            x: labelW + column * cellW,
            y: lane * laneH + 2,
            width: cellW - 2,
            height: laneH - 3,
            class: `pass ${kind}`,
            "data-testid": "timeline-cell",
            "data-pass": pass.pass,
            "data-lane": laneLabel(row.request_id),
            "data-kind": kind,
            "data-shared": shared,
          },
          [
            svgEl("title", {
              text:
                `forward pass ${pass.pass}: ${laneLabel(row.request_id)} computed ` +
                `${row.is_prompt ? `a prompt chunk of ${plural(row.num_tokens, "token")}` : "one decode token"}` +
                `${row.num_draft_tokens ? ` + ${plural(row.num_draft_tokens, "draft token")} to verify` : ""}; ` +
                `${plural(shared, "request")} shared this pass`,
            }),
          ],
        ),
      );
      if (row.num_draft_tokens) {
        shapes.push(
          svgEl("rect", {
            x: labelW + column * cellW,
            y: lane * laneH + 2,
            width: 3,
            height: laneH - 3,
            class: "pass draft",
          }),
        );
      }
    });
  });
  const batched = passes.filter((p) => p.rows.length > 1).length;
  return el("div", { class: "pass-timeline", "data-testid": "pass-timeline" }, [
    el("h3", { text: "Forward passes, as the engine ran them" }),
    el("p", { class: "hint" }, [
      `The last ${plural(passes.length, "forward pass", "forward passes")}, one column each; `,
      el("span", { "data-testid": "timeline-batched", text: `${batched} of them carried more than one request` }),
      " (batching: one pass computes a row for every running request).",
    ]),
    el("div", { class: "timeline-scroll" }, [
      svgEl(
        "svg",
        {
          width,
          height,
          viewBox: `0 0 ${width} ${height}`,
          class: "timeline-grid",
          role: "img",
          "aria-label": `timeline of ${plural(passes.length, "forward pass", "forward passes")}`,
        },
        shapes,
      ),
    ]),
    el("p", { class: "timeline-legend" }, [
      el("span", { class: "key prefill" }),
      " prompt chunk (prefill) ",
      el("span", { class: "key decode" }),
      " decode row (one token) ",
      el("span", { class: "key draft" }),
      " with draft tokens",
    ]),
  ]);
}
