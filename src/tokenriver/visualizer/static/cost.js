"use strict";
/*
 * Panel 9: the cost of a token. What one forward pass of the loaded model computes and reads, from GET
 * /v1/visualizer/cost (parameters, multiply-adds per token, weight bytes per pass, KV bytes per context token, and
 * the machine's read bandwidth and float32 rate, measured by the server at start), set beside what each logged
 * pass took, from GET /v1/visualizer/passes (its wall time, tokens, multiply-adds and bytes read, counted by the
 * engine). Nothing here is estimated on the page but the ratios of those numbers.
 *
 * - The roofline: arithmetic intensity (FLOPs per byte read, a multiply-add being 2 FLOPs) on x, the pass's
 *   achieved FLOP/s on y, both logarithmic, under two ceilings: the read bandwidth × intensity (memory-bound, left
 *   of the ridge), which bounds every pass, and the float32 rate (compute-bound, right of it), a reference the
 *   engine's integer kernels may exceed.
 *   A decode pass of one request reads every weight for one token's work and sits toward the memory end; a
 *   prefill does the work of its whole prompt for the same bytes and sits toward the compute end; batching moves
 *   decode passes along the x axis.
 * - Pass time and tokens/s against batch size (the requests a pass carried), one point per pass as requests run.
 *   The load button sends K concurrent completions through the OpenAI API; their queue time (arrival to first
 *   scheduled) comes from each response's metrics and is shown apart from the passes' time.
 *
 * The passes arrive through timeline.js's fetch (addCostPasses): every pass logged since the page opened.
 */

// Passes kept for the plots: every pass since the page opened, up to this many (the engine logs 512 at a time).
const COST_PASSES = 2048;
// Rows of the recent-passes table.
const COST_TABLE_ROWS = 8;
// The load button's bounds and each of its requests' length: enough to fill a batch, not to hold the machine.
const MAX_LOAD_REQUESTS = 16;
const LOAD_MAX_TOKENS = 16;
// Load runs kept in the comparison table.
const LOAD_RUNS_KEPT = 6;

const costView = {
  // GET /v1/visualizer/cost, or the error that kept it from the page.
  facts: null,
  error: null,
  // Logged passes since the page opened, oldest first.
  passes: [],
  // Load runs, newest last: {k, seconds, results: [{tokens, metrics}], failed, running}.
  runs: [],
  // What the panel was last drawn from: it is redrawn only when that changes (it holds a node per pass).
  drawnKey: null,
};

/** Keep the passes timeline.js fetched (it fetches each one once). */
function addCostPasses(passes) {
  costView.passes = costView.passes.concat(passes).slice(-COST_PASSES);
}

/** One pass as the plots use it; a multi-step entry's time is shared by its passes. */
function passPoint(pass) {
  const seconds = pass.seconds / (pass.num_passes || 1);
  const flops = 2 * pass.multiply_adds;
  return {
    pass: pass.pass,
    kind: pass.rows.some((row) => row.is_prompt) ? "prefill" : "decode",
    requests: pass.rows.length,
    tokens: pass.num_tokens,
    bytes: pass.bytes_read,
    seconds,
    flops,
    intensity: flops / pass.bytes_read,
    rate: flops / seconds,
    tokensPerSecond: pass.num_tokens / seconds,
  };
}

/* ---------------------------------------------------------------- numbers */

/** 135 M, 2.1 G: counts and rates in decimal prefixes, as FLOPs and bandwidths are quoted. */
function fmtSi(value, unit = "") {
  const prefixes = [
    [1e12, "T"],
    [1e9, "G"],
    [1e6, "M"],
    [1e3, "k"],
  ];
  for (const [scale, prefix] of prefixes) {
    if (Math.abs(value) >= scale) return `${(value / scale).toFixed(value / scale >= 100 ? 0 : 1)} ${prefix}${unit}`;
  }
  return `${value.toFixed(value >= 10 || Number.isInteger(value) ? 0 : 1)}${unit ? ` ${unit}` : ""}`;
}

function median(values) {
  const sorted = values.filter((v) => v !== null && v !== undefined).sort((a, b) => a - b);
  if (!sorted.length) return null;
  const middle = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2;
}

/* ---------------------------------------------------------------- facts */

function costFacts(facts) {
  const machine = facts.machine;
  const list = factList([
    ["parameters", facts.num_parameters.toLocaleString("en-US"), "cost-parameters"],
    ["multiply-adds per token", facts.multiply_adds_per_token.toLocaleString("en-US"), "cost-multiply-adds"],
    ["weights read per pass", fmtBytes(facts.weight_bytes_per_pass), "cost-weight-bytes"],
    ["KV read per context token", fmtBytes(facts.kv_bytes_per_token), "cost-kv-bytes"],
    ["memory read bandwidth", fmtSi(machine.read_bytes_per_second, "B/s"), "cost-bandwidth"],
    ["float32 arithmetic", fmtSi(machine.flops_per_second, "FLOP/s"), "cost-flops"],
    ["ridge point", `${machine.ridge_intensity.toFixed(1)} FLOP/byte`, "cost-ridge"],
  ]);
  list.querySelector("[data-testid=cost-parameters]").dataset.value = facts.num_parameters;
  list.querySelector("[data-testid=cost-multiply-adds]").dataset.value = facts.multiply_adds_per_token;
  list.querySelector("[data-testid=cost-weight-bytes]").dataset.value = facts.weight_bytes_per_pass;
  return [
    list,
    el("p", {
      class: "hint",
      text:
        `Parameters: every weight once (the tied embedding once). Multiply-adds per token: the weight matrices one ` +
        `token goes through, the output layer included (${fmtSi(facts.output_multiply_adds)} of them), the ` +
        `embedding lookup not; attention adds ${fmtSi(facts.attention_multiply_adds_per_position)} per position of ` +
        `the context. A pass reads the weights once, as stored (packed), whatever its batch, plus each request's ` +
        `K/V. Bandwidth and rate were measured at server start (${plural(machine.num_threads, "thread")}, ` +
        `${machine.device}): a sum over 256 MiB and a float32 matrix product; the engine's integer kernels may ` +
        `compute faster than the float32 product.`,
    }),
  ];
}

/* ---------------------------------------------------------------- roofline */

function decadeBelow(value) {
  return 10 ** Math.floor(Math.log10(value));
}

function decadeAbove(value) {
  return 10 ** Math.ceil(Math.log10(value));
}

function logAxis(lo, hi, from, to) {
  const a = Math.log10(lo);
  const b = Math.log10(hi);
  return (value) => from + ((Math.log10(value) - a) / (b - a)) * (to - from);
}

/** Axis lines, one tick and label per decade, and the axis titles. */
function rooflineAxes(box, x, y, xRange, yRange) {
  const shapes = [
    svgEl("line", { x1: box.left, y1: box.bottom, x2: box.right, y2: box.bottom, class: "axis" }),
    svgEl("line", { x1: box.left, y1: box.top, x2: box.left, y2: box.bottom, class: "axis" }),
  ];
  for (let v = xRange[0]; v <= xRange[1] * 1.001; v *= 10) {
    shapes.push(svgEl("text", { x: x(v), y: box.bottom + 14, class: "tick", "text-anchor": "middle", text: fmtSi(v) }));
  }
  for (let v = yRange[0]; v <= yRange[1] * 1.001; v *= 10) {
    shapes.push(svgEl("text", { x: box.left - 4, y: y(v) + 4, class: "tick", "text-anchor": "end", text: fmtSi(v) }));
  }
  shapes.push(
    svgEl("text", {
      x: (box.left + box.right) / 2,
      y: box.bottom + 30,
      class: "axis-title",
      "text-anchor": "middle",
      text: "arithmetic intensity (FLOP per byte read)",
    }),
    svgEl("text", { x: box.left + 6, y: box.top - 6, class: "axis-title", text: "achieved FLOP/s" }),
  );
  return shapes;
}

function rooflinePoint(point, x, y) {
  const attrs = { cx: x(point.intensity), cy: y(point.rate), r: 4, class: `point ${point.kind}` };
  return svgEl("circle", { ...attrs, "data-testid": "roofline-point", "data-pass": point.pass }, [
    svgEl("title", {
      text:
        `forward pass ${point.pass} (${point.kind}): ${plural(point.requests, "request")}, ` +
        `${plural(point.tokens, "token")}, ${fmtSi(point.flops, "FLOP")} over ${fmtBytes(point.bytes)} ` +
        `= ${point.intensity.toFixed(1)} FLOP/byte, in ${fmtMs(point.seconds)}: ${fmtSi(point.rate, "FLOP/s")}`,
    }),
  ]);
}

function roofline(points, machine) {
  const box = { left: 56, right: 548, top: 20, bottom: 236 };
  const ridge = machine.ridge_intensity;
  const xRange = [
    decadeBelow(Math.min(ridge / 10, ...points.map((p) => p.intensity))),
    decadeAbove(Math.max(ridge * 10, ...points.map((p) => p.intensity))),
  ];
  const yRange = [
    decadeBelow(Math.min(machine.read_bytes_per_second * xRange[0], ...points.map((p) => p.rate))),
    decadeAbove(Math.max(machine.flops_per_second * 1.5, ...points.map((p) => p.rate))),
  ];
  const x = logAxis(xRange[0], xRange[1], box.left, box.right);
  const y = logAxis(yRange[0], yRange[1], box.bottom, box.top);
  const bandwidth = machine.read_bytes_per_second;
  const shapes = rooflineAxes(box, x, y, xRange, yRange);
  shapes.push(
    svgEl("polyline", {
      points: `${x(xRange[0])},${y(bandwidth * xRange[0])} ${x(ridge)},${y(machine.flops_per_second)}`,
      class: "ceiling memory",
      "data-testid": "roofline-bandwidth",
    }),
    svgEl("polyline", {
      points: `${x(ridge)},${y(machine.flops_per_second)} ${x(xRange[1])},${y(machine.flops_per_second)}`,
      class: "ceiling compute",
      "data-testid": "roofline-compute",
    }),
    svgEl("text", {
      x: x(xRange[0]) + 6,
      y: y(bandwidth * xRange[0] * 3) - 6,
      class: "ceiling-label",
      text: "memory bandwidth × intensity",
    }),
    svgEl("text", {
      x: box.right - 4,
      y: y(machine.flops_per_second) - 6,
      class: "ceiling-label",
      "text-anchor": "end",
      text: "float32 arithmetic",
    }),
  );
  for (const point of points) shapes.push(rooflinePoint(point, x, y));
  return svgEl(
    "svg",
    {
      viewBox: "0 0 560 272",
      class: "cost-plot",
      role: "img",
      "data-testid": "roofline",
      "aria-label":
        `roofline: ${plural(points.length, "forward pass", "forward passes")} by arithmetic intensity and achieved ` +
        `rate, under a memory ceiling of ${fmtSi(bandwidth, "B/s")} and a compute ceiling of ` +
        `${fmtSi(machine.flops_per_second, "FLOP/s")} (ridge at ${ridge.toFixed(1)} FLOP/byte)`,
    },
    shapes,
  );
}

/* ---------------------------------------------------------------- batch size */

/**
 * One chart of the batch plot: `value` of each point against its batch size, linear axes. The y range covers the
 * decode passes; a prefill above it is drawn on the top edge, hollow, with its value in its title.
 */
function batchChart(points, value, box, x, label, format) {
  const decode = points.filter((p) => p.kind === "decode");
  const scaled = (decode.length ? decode : points).map(value);
  const high = scaled.length ? Math.max(...scaled) * 1.15 : 1;
  const y = (v) => box.bottom - (Math.min(v, high) / high) * (box.bottom - box.top);
  const shapes = [
    svgEl("line", { x1: box.left, y1: box.bottom, x2: box.right, y2: box.bottom, class: "axis" }),
    svgEl("line", { x1: box.left, y1: box.top, x2: box.left, y2: box.bottom, class: "axis" }),
    svgEl("text", { x: box.left - 4, y: box.top + 4, class: "tick", "text-anchor": "end", text: format(high) }),
    svgEl("text", { x: box.left - 4, y: box.bottom, class: "tick", "text-anchor": "end", text: "0" }),
    svgEl("text", { x: box.left + 4, y: box.top - 4, class: "axis-title", text: label }),
  ];
  const byBatch = new Map();
  for (const p of decode) byBatch.set(p.requests, (byBatch.get(p.requests) || []).concat(value(p)));
  const medians = [...byBatch.keys()].sort((a, b) => a - b).map((k) => `${x(k)},${y(median(byBatch.get(k)))}`);
  if (medians.length > 1) shapes.push(svgEl("polyline", { points: medians.join(" "), class: "median-line" }));
  return { shapes, y, high };
}

function batchPlot(points) {
  const width = 560;
  const maxBatch = Math.max(1, ...points.map((p) => p.requests));
  const left = 64;
  const right = width - 12;
  const x = (k) => left + ((k - 0.5) / maxBatch) * (right - left);
  const timeBox = { left, right, top: 20, bottom: 120 };
  const rateBox = { left, right, top: 150, bottom: 250 };
  const time = batchChart(points, (p) => p.seconds, timeBox, x, "time per pass", fmtMs);
  const rate = batchChart(points, (p) => p.tokensPerSecond, rateBox, x, "tokens per second", (v) => fmtSi(v));
  const shapes = [...time.shapes, ...rate.shapes];
  for (let k = 1; k <= maxBatch; k += Math.ceil(maxBatch / 16)) {
    shapes.push(svgEl("text", { x: x(k), y: rateBox.bottom + 14, class: "tick", "text-anchor": "middle", text: k }));
  }
  shapes.push(
    svgEl("text", {
      x: (left + right) / 2,
      y: rateBox.bottom + 30,
      class: "axis-title",
      "text-anchor": "middle",
      text: "batch size (requests in the pass)",
    }),
  );
  for (const p of points) shapes.push(batchPoint(p, x, time, rate));
  return svgEl(
    "svg",
    {
      viewBox: `0 0 ${width} 286`,
      class: "cost-plot",
      role: "img",
      "data-testid": "batch-plot",
      "aria-label":
        `time per pass and tokens per second against batch size, ` +
        `${plural(points.length, "forward pass", "forward passes")}; the line joins the decode passes' medians`,
    },
    shapes,
  );
}

/** One pass in the batch plot: a group of its two markers, its time above and its tokens/s below. */
function batchPoint(p, x, time, rate) {
  const marker = (chart, v) => {
    const kind = `point ${p.kind}${v > chart.high ? " clipped" : ""}`;
    return svgEl("circle", { cx: x(p.requests), cy: chart.y(v), r: 3.5, class: kind });
  };
  const attrs = { class: `batch-point ${p.kind}`, "data-testid": "batch-point", "data-pass": p.pass };
  return svgEl("g", { ...attrs, "data-requests": p.requests }, [
    svgEl("title", {
      text:
        `forward pass ${p.pass} (${p.kind}): ${plural(p.requests, "request")}, ${plural(p.tokens, "token")} ` +
        `in ${fmtMs(p.seconds)}, ${fmtSi(p.tokensPerSecond)} tokens/s`,
    }),
    marker(time, p.seconds),
    marker(rate, p.tokensPerSecond),
  ]);
}

/* ---------------------------------------------------------------- tables */

function passTable(points) {
  const recent = points.slice(-COST_TABLE_ROWS).reverse();
  const head = ["pass", "kind", "requests", "tokens", "multiply-adds", "bytes read", "time", "read rate", "FLOP/s"];
  return el("div", { class: "table-scroll" }, [
    el("table", { class: "cost-table", "data-testid": "cost-pass-table" }, [
      el("caption", {
        text: `The last ${plural(recent.length, "pass", "passes")}: what each read, beside the time it took`,
      }),
      el("thead", {}, el("tr", {}, head.map((h) => el("th", { scope: "col", text: h })))),
      el(
        "tbody",
        {},
        recent.map((p) =>
          el("tr", { "data-testid": "cost-pass-row", "data-pass": p.pass }, [
            el("td", { class: "num", text: p.pass }),
            el("td", { text: p.kind }),
            el("td", { class: "num", text: p.requests }),
            el("td", { class: "num", text: p.tokens }),
            el("td", { class: "num", text: fmtSi(p.flops / 2) }),
            el("td", { class: "num", "data-testid": "cost-pass-bytes", "data-value": p.bytes }, fmtBytes(p.bytes)),
            el("td", { class: "num", text: fmtMs(p.seconds) }),
            el("td", { class: "num", text: fmtSi(p.bytes / p.seconds, "B/s") }),
            el("td", { class: "num", text: fmtSi(p.rate) }),
          ]),
        ),
      ),
    ]),
  ]);
}

/** Summary of one load run: the requests' throughput together, and per request the latency and queue time. */
function runSummary(run) {
  const tokens = run.results.reduce((sum, r) => sum + r.tokens, 0);
  return {
    tokensPerSecond: run.seconds ? tokens / run.seconds : null,
    perToken: median(run.results.map((r) => r.metrics && r.metrics.time_per_output_token)),
    queue: median(run.results.map((r) => r.metrics && r.metrics.queue_time)),
    firstToken: median(run.results.map((r) => r.metrics && r.metrics.time_to_first_token)),
  };
}

function loadTable(runs) {
  const head = ["K", "tokens/s, all requests", "per-token latency", "queue time", "time to first token"];
  return el("div", { class: "table-scroll" }, [
    el("table", { class: "cost-table", "data-testid": "load-table" }, [
      el("caption", { text: "Load runs (medians over each run's requests)" }),
      el("thead", {}, el("tr", {}, head.map((h) => el("th", { scope: "col", text: h })))),
      el(
        "tbody",
        {},
        runs.map((run) => {
          const s = runSummary(run);
          const state = run.running ? "running" : "done";
          return el("tr", { "data-testid": "load-run", "data-state": state, "data-requests": run.k }, [
            el("td", { class: "num", text: run.k }),
            el("td", { class: "num", text: run.running ? "running…" : fmtSi(s.tokensPerSecond || 0) }),
            el("td", { class: "num", text: fmtMs(s.perToken) }),
            el("td", { class: "num", "data-testid": "load-queue-time", text: fmtMs(s.queue) }),
            el("td", { class: "num", text: fmtMs(s.firstToken) }),
          ]);
        }),
      ),
    ]),
    runs.some((run) => run.failed)
      ? el("p", {
          class: "hint",
          text: `${plural(runs.reduce((n, r) => n + r.failed, 0), "request")} of the load failed (the error says why).`,
        })
      : null,
  ]);
}

/* ---------------------------------------------------------------- load */

/** One sentence on the newest run, for the live region (set only when it changes, so it is read once). */
function loadStatus(run) {
  if (!run) return "";
  if (run.running) return `Sending ${plural(run.k, "request")} at once…`;
  const s = runSummary(run);
  return (
    `${plural(run.results.length, "request")} done: ${fmtSi(s.tokensPerSecond || 0)} tokens/s together, ` +
    `${fmtMs(s.perToken)} per token and ${fmtMs(s.queue)} in the queue (medians).`
  );
}

function loadBody() {
  const body = {
    prompt: state.promptIds && state.promptIds.length ? state.promptIds : $("prompt").value,
    max_tokens: LOAD_MAX_TOKENS,
    temperature: 0,
    ignore_eos: true,
  };
  if (state.modelName) body.model = state.modelName;
  return body;
}

async function oneLoadRequest(run, index) {
  try {
    const body = await apiJson("/v1/completions", loadBody());
    labelRequest(body.id, `load ${index + 1} of ${run.k}`);
    run.results.push({ tokens: body.usage ? body.usage.completion_tokens : 0, metrics: body.metrics || null });
  } catch (error) {
    run.failed += 1;
    showError(error);
  }
}

/** Send K concurrent completions and follow the engine's passes while they run. */
async function runLoad() {
  const k = Number($("load-requests").value);
  if (!Number.isInteger(k) || k < 1 || k > MAX_LOAD_REQUESTS) {
    const given = $("load-requests").value;
    showError(inputError("load_requests", `K must be a whole number, 1 to ${MAX_LOAD_REQUESTS}; got “${given}”`));
    $("load-requests").setAttribute("aria-invalid", "true");
    return;
  }
  $("load-requests").removeAttribute("aria-invalid");
  const run = { k, seconds: 0, results: [], failed: 0, running: true };
  costView.runs = costView.runs.concat(run).slice(-LOAD_RUNS_KEPT);
  $("run-load").setAttribute("aria-disabled", "true");
  const poll = setInterval(refreshEngine, 300);
  const started = performance.now();
  scheduleRender();
  await Promise.all([...Array(k).keys()].map((index) => oneLoadRequest(run, index)));
  run.seconds = (performance.now() - started) / 1000;
  clearInterval(poll);
  await refreshPasses();
  run.running = false;
  $("run-load").setAttribute("aria-disabled", "false");
  pollEngineUntilIdle();
}

/* ---------------------------------------------------------------- panel */

/** A key that changes whenever the panel's inputs do. */
function costKey() {
  const passes = costView.passes;
  const runs = costView.runs.map((run) => `${run.k}:${run.running}:${run.results.length}:${run.failed}`);
  const last = passes.length ? passes[passes.length - 1].pass : 0;
  return `${Boolean(costView.facts)}|${costView.error}|${passes.length}|${last}|${runs.join(",")}`;
}

function renderCost() {
  const key = costKey();
  if (key === costView.drawnKey) return;
  costView.drawnKey = key;
  const facts = costView.facts;
  if (!facts) {
    const text = costView.error ? `Cost unavailable: ${costView.error}` : "Measuring the machine…";
    setChildren($("cost-facts"), el("p", { class: "hint", text }));
    return;
  }
  const points = costView.passes.filter((p) => p.bytes_read > 0 && p.seconds > 0).map(passPoint);
  const status = loadStatus(costView.runs[costView.runs.length - 1]);
  if ($("load-status").textContent !== status) $("load-status").textContent = status;
  setChildren($("cost-facts"), ...costFacts(facts));
  setChildren(
    $("cost-roofline"),
    el("h3", { text: "Each pass on the roofline" }),
    roofline(points, facts.machine),
    el("p", { class: "timeline-legend" }, [
      el("span", { class: "key prefill" }),
      " prefill (a prompt chunk in the pass) ",
      el("span", { class: "key decode" }),
      " decode only. Left of the ridge a pass waits on memory, right of it on arithmetic.",
    ]),
  );
  setChildren(
    $("cost-batch"),
    el("p", {
      class: "hint",
      "data-testid": "batch-count",
      text: `${plural(points.length, "forward pass", "forward passes")} since the page opened.`,
    }),
    batchPlot(points),
    costView.runs.length ? loadTable(costView.runs) : null,
    points.length ? passTable(points) : null,
  );
}

async function initCost() {
  $("run-load").addEventListener("click", () => {
    if ($("run-load").getAttribute("aria-disabled") !== "true") runLoad();
  });
  $("load-requests").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && $("run-load").getAttribute("aria-disabled") !== "true") runLoad();
  });
  try {
    costView.facts = await apiJson("/v1/visualizer/cost");
  } catch (error) {
    costView.error = error.message;
  }
  scheduleRender();
}

document.addEventListener("DOMContentLoaded", initCost);
