"use strict";
/*
 * The distribution over time, in panel 2: one sparkline per measure along the selected path, one point per step,
 * read from each step's recorded trace: the entropy of the model's raw distribution, the probability of its most
 * likely token, and the tokens the filters kept (top-k, top-p, min-p; a greedy step keeps its argmax only). A step
 * without a trace keeps its point, empty. Click a point to select that step.
 */

const SPARK_W = 240;
const SPARK_H = 28;

// Each measure: its name, how to read it off a trace, and how to place a value between the bottom and the top.
const SPARK_MEASURES = [
  {
    metric: "entropy",
    name: "entropy (raw, nats)",
    value: (trace) => trace.entropy_raw,
    scale: (values) => linearScale(values),
    text: (v) => v.toFixed(2),
  },
  {
    metric: "top1",
    name: "top-1 probability",
    value: (trace) => Math.max(...trace.candidates.map((c) => c.prob_raw)),
    scale: () => (v) => v,
    text: (v) => fmtProb(v),
  },
  {
    metric: "kept",
    name: "tokens kept (log scale)",
    value: (trace) => (trace.method === "greedy" ? 1 : trace.num_candidates_kept),
    scale: (values) => logScale(values),
    text: (v) => String(v),
  },
];

function linearScale(values) {
  const top = Math.max(...values, 1e-9);
  return (v) => v / top;
}

function logScale(values) {
  const top = Math.log(Math.max(...values, 2));
  return (v) => Math.log(Math.max(v, 1)) / top;
}

function renderSparklines() {
  const box = $("sparklines");
  const branch = currentBranch();
  const path = branch ? pathOf(branch) : [];
  if (!path.length) {
    box.replaceChildren();
    return;
  }
  setChildren(box, ...SPARK_MEASURES.map((measure) => sparkline(measure, path)));
}

function sparkline(measure, path) {
  const values = path.map((token) => (token.trace ? measure.value(token.trace) : null));
  const known = values.filter((v) => v !== null);
  const scale = measure.scale(known);
  const dx = path.length > 1 ? (SPARK_W - 8) / (path.length - 1) : 0;
  const x = (step) => 4 + step * dx;
  const y = (v) => SPARK_H - 4 - scale(v) * (SPARK_H - 8);
  const line = values
    .map((v, step) => (v === null ? null : `${x(step).toFixed(1)},${y(v).toFixed(1)}`))
    .filter(Boolean)
    .join(" ");
  const selected = state.selectedStep;
  const shapes = [
    selected !== null && selected < path.length
      ? svgEl("line", { x1: x(selected), x2: x(selected), y1: 0, y2: SPARK_H, class: "spark-selected" })
      : null,
    svgEl("polyline", { points: line, class: "spark-line" }),
    ...values.map((v, step) =>
      svgEl(
        "circle",
        {
          cx: x(step),
          cy: v === null ? SPARK_H / 2 : y(v),
          r: step === selected ? 3 : 1.8,
          class: v === null ? "spark-point empty" : "spark-point",
          "data-testid": "sparkline-point",
          "data-step": step,
          "data-value": v ?? "",
          onclick: () => selectStep(step),
        },
        [svgEl("title", { text: `token ${step + 1}: ${v === null ? "no trace" : measure.text(v)}` })],
      ),
    ),
  ];
  const shownStep = selected !== null && selected < path.length ? selected : path.length - 1;
  const shown = values[shownStep];
  const range = known.length ? `${measure.text(Math.min(...known))} to ${measure.text(Math.max(...known))}` : "none";
  return el("div", { class: "sparkline", "data-testid": "sparkline", "data-metric": measure.metric }, [
    el("span", { class: "spark-name", text: measure.name }),
    svgEl(
      "svg",
      {
        width: SPARK_W,
        height: SPARK_H,
        viewBox: `0 0 ${SPARK_W} ${SPARK_H}`,
        class: "spark-svg",
        role: "img",
        "aria-label": `${measure.name} at each of the path's ${plural(path.length, "step")}: ${range}`,
      },
      shapes.filter(Boolean),
    ),
    el("span", {
      class: "spark-value",
      text: `token ${shownStep + 1}: ${shown === null ? "–" : measure.text(shown)}`,
    }),
  ]);
}
