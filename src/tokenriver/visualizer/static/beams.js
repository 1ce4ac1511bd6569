"use strict";
/*
 * Panel 8: beam search, as the engine ran it. One /v1/completions request with `beam_width` k and tokenriver's
 * `beam_trace` returns, beside the k final beams, every step of the search (decoding/beam.py): the running beams
 * with their cumulative log-probabilities, their best continuations ranked over all beams, and each
 * continuation's fate: kept as a beam of the next step, finished (it ended among the k best), or pruned (it fell
 * out of the top k). The page draws those records; it ranks nothing itself. Beside it, one ordinary sampled
 * request for the same prompt under the generation settings: beam vs sampling on one prompt.
 */

// response, sample: the two responses; request: the two bodies they answered; width: the k asked for.
const beams = { response: null, sample: null, request: null, isRunning: false, width: null };

function beamWidth() {
  const width = numberInput("beam-width", (s) => parseInt(s, 10));
  if (!Number.isInteger(width) || width < 2 || width > 8) {
    throw inputError("beam_width", "beam width must be a whole number from 2 to 8");
  }
  return width;
}

/** The beam-search request and the sampling request it is compared with, for the prompt's token ids. */
function beamBodies(ids, params, width) {
  const { trace_top, structured_outputs, ...sampling } = apiSampling(params);
  const common = { prompt: ids, max_tokens: params.max_tokens, logprobs: 0 };
  if (params.stop) common.stop = params.stop;
  if (state.modelName) common.model = state.modelName;
  return {
    beam: { ...common, beam_width: width, n: width, temperature: 0, beam_trace: true },
    sample: { ...common, ...sampling },
  };
}

async function runBeams() {
  if (beams.isRunning) return;
  clearError();
  let bodies;
  try {
    const params = readParams();
    const width = beamWidth();
    const ids = await tokenizePrompt();
    if (ids === null) return;
    bodies = beamBodies(ids, params, width);
  } catch (error) {
    showError(error);
    return;
  }
  beams.isRunning = true;
  scheduleRender();
  startEnginePolling();
  try {
    const [response, sample] = await Promise.all([
      apiJson("/v1/completions", bodies.beam),
      apiJson("/v1/completions", bodies.sample),
    ]);
    labelRequest(response.id, "beam search");
    labelRequest(sample.id, "sample (beam vs sampling)");
    Object.assign(beams, { response, sample, request: bodies, width: bodies.beam.beam_width });
  } catch (error) {
    showError(error);
  } finally {
    beams.isRunning = false;
    pollEngineUntilIdle();
    scheduleRender();
  }
}

function renderBeams() {
  const box = $("beams");
  const button = $("run-beams");
  button.setAttribute("aria-disabled", String(beams.isRunning));
  button.textContent = beams.isRunning ? "Running beam search…" : "Run beam search";
  const response = beams.response;
  if (!response) {
    box.replaceChildren(
      el("p", {
        class: "hint",
        text: "Beam search keeps the k most likely partial outputs at every step instead of drawing one token.",
      }),
    );
    return;
  }
  const steps = response.beam_steps[0];
  if (box.dataset.responseId === response.id) return;
  box.dataset.responseId = response.id;
  setChildren(
    box,
    finalRanking(response),
    beamVsSample(response, beams.sample),
    beamOverview(steps, beams.width),
    el("h3", { text: `Step by step (${plural(steps.length, "step")})` }),
    el(
      "div",
      { class: "beam-steps", "data-testid": "beam-steps" },
      steps.map((step) => beamStep(step, beams.width)),
    ),
  );
}

/* ---------------------------------------------------------------- the result */

function sumLogprobs(choice) {
  return choice.logprobs.token_logprobs.reduce((sum, lp) => sum + lp, 0);
}

function finalRanking(response) {
  const rows = response.choices.map((choice, rank) =>
    el(
      "tr",
      {
        "data-testid": "beam-final",
        "data-rank": rank + 1,
        "data-token-ids": choice.token_ids.join(","),
        "data-score": choice.beam_score,
        "data-finish-reason": choice.finish_reason,
      },
      [
        el("td", { class: "num", text: `#${rank + 1}` }),
        el("td", { class: "beam-text", text: visibleText(choice.text) }),
        el("td", { class: "num", text: sumLogprobs(choice).toFixed(3) }),
        el("td", { class: "num", text: choice.beam_score.toFixed(3) }),
        el("td", { text: `${choice.finish_reason} after ${plural(choice.token_ids.length, "token")}` }),
      ],
    ),
  );
  return el("table", { class: "compare-table beam-table", "data-testid": "beam-ranking" }, [
    el("caption", {
      class: "hint",
      text:
        `The final ranking: the ${plural(rows.length, "beam")} the search returned, by score = Σ log p / length ` +
        "(transformers' length penalty 1).",
    }),
    el("thead", {}, [
      el(
        "tr",
        {},
        ["rank", "text", "Σ log p", "score", "ended"].map((text) => el("th", { text })),
      ),
    ]),
    el("tbody", {}, rows),
  ]);
}

/** The best beam beside one sample of the same prompt: text, Σ log p under the raw model, and per token. */
function beamVsSample(response, sample) {
  const side = (title, choice, testid) => {
    const total = sumLogprobs(choice);
    const count = choice.logprobs.token_logprobs.length;
    return el("div", { class: "side", "data-testid": testid, "data-logprob": total }, [
      el("h4", { text: title }),
      el("p", { class: "beam-text", text: visibleText(choice.text) }),
      factList([
        ["Σ log p", total.toFixed(3), `${testid}-logprob`],
        ["per token", count ? (total / count).toFixed(3) : "–", `${testid}-per-token`],
        ["tokens", String(count), `${testid}-tokens`],
      ]),
    ]);
  };
  const params = beams.request.sample;
  return el("div", { class: "beam-vs-sample", "data-testid": "beam-vs-sample" }, [
    side(`beam search (k = ${beams.width}), best beam`, response.choices[0], "beam-side"),
    side(`sampling (T ${params.temperature ?? 1}, seed ${params.seed})`, sample.choices[0], "sample-side"),
    el("p", {
      class: "hint wide",
      text:
        "Same prompt, same max tokens. Beam search looks for the most likely whole continuation; sampling draws each " +
        "token, so its path is usually less likely under the model, and more varied.",
    }),
  ]);
}

/* ---------------------------------------------------------------- the steps */

const FATE_TEXT = {
  running: (c) => `kept: beam ${c.next_beam_index + 1} of the next step`,
  finished: () => "finished: it ended among the k best and joined the finished beams",
  pruned: (c, k) => `pruned: rank ${c.rank}, it fell out of the top ${k}`,
};

function beamStep(step, width) {
  const byBeam = step.beams.map((_, j) => step.continuations.filter((c) => c.beam_index === j));
  const numPruned = byBeam.filter((list) => !list.some((c) => c.fate === "running" || c.fate === "finished")).length;
  const summary =
    `step ${step.index + 1}: ${plural(step.beams.length, "beam")} in, ` +
    `${step.continuations.filter((c) => c.fate === "running").length} kept, ` +
    `${step.continuations.filter((c) => c.fate === "finished").length} finished` +
    (numPruned ? `, ${plural(numPruned, "beam")} pruned (no continuation in the top k)` : "") +
    (step.is_last ? " · the search ended here" : "");
  return el("details", { class: "beam-step", "data-testid": "beam-step", "data-step": step.index }, [
    el("summary", { text: summary }),
    el(
      "ol",
      { class: "beam-rows" },
      step.beams.map((beam, j) => beamRow(step, beam, j, byBeam[j], width)),
    ),
  ]);
}

function beamRow(step, beam, j, continuations, width) {
  const survives = continuations.some((c) => c.fate !== "pruned");
  return el(
    "li",
    {
      class: `beam-row${survives ? "" : " pruned"}`,
      "data-testid": "beam-row",
      "data-step": step.index,
      "data-beam": j,
      "data-token-ids": beam.token_ids.join(","),
      "data-cumulative-logprob": beam.cumulative_logprob,
    },
    [
      el("span", { class: "beam-head" }, [
        el("strong", { text: `beam ${j + 1}` }),
        ` “${visibleText(beam.text)}” · Σ log p ${beam.cumulative_logprob.toFixed(3)}`,
        survives ? null : el("span", { class: "badge removed", text: "pruned: no continuation in the top k" }),
      ]),
      el(
        "ul",
        { class: "beam-continuations" },
        continuations.map((c) => continuationRow(step, c, width)),
      ),
    ],
  );
}

function continuationRow(step, c, width) {
  return el(
    "li",
    {
      class: `continuation fate-${c.fate}`,
      "data-testid": "beam-continuation",
      "data-step": step.index,
      "data-beam": c.beam_index,
      "data-token-id": c.token_id,
      "data-rank": c.rank,
      "data-cumulative-logprob": c.cumulative_logprob,
      "data-fate": c.fate,
      "data-next-beam": c.next_beam_index ?? "",
    },
    [
      `+ “`,
      el("span", { class: "tok-text", text: visibleText(c.text) }),
      `” log p ${c.logprob.toFixed(3)} → Σ ${c.cumulative_logprob.toFixed(3)} (rank ${c.rank}): `,
      el("span", { class: `badge fate ${c.fate}`, text: FATE_TEXT[c.fate](c, width) }),
    ],
  );
}

/**
 * The search at a glance: one column per step, one row per beam slot; a line joins each kept beam to the beam it
 * extends, a square marks a continuation that finished there (several from one beam stack up beside its row).
 * The step lists below say the same in words.
 */
function beamOverview(steps, width) {
  const dx = 26;
  const dy = 18;
  const x = (s) => 10 + s * dx;
  const y = (j) => 10 + j * dy;
  const shapes = [];
  steps.forEach((step, s) => {
    step.beams.forEach((_, j) => shapes.push(svgEl("circle", { cx: x(s), cy: y(j), r: 4, class: "beam-node" })));
    const finishedFrom = step.beams.map(() => 0);
    for (const c of step.continuations) {
      if (c.fate === "running") {
        shapes.push(beamLine(x(s), y(c.beam_index), x(s + 1), y(c.next_beam_index), "beam-edge"));
      } else if (c.fate === "finished") {
        const end = y(c.beam_index) + 7 * finishedFrom[c.beam_index]++ - 4;
        shapes.push(beamLine(x(s), y(c.beam_index), x(s + 1) - 6, end + 3, "beam-edge finished"));
        shapes.push(svgEl("rect", { x: x(s + 1) - 6, y: end, width: 6, height: 6, class: "beam-finished" }));
      }
    }
  });
  const w = x(steps.length) + 10;
  const h = y(width - 1) + 7 * (width - 1) + 10;
  return el("div", { class: "timeline-scroll" }, [
    svgEl(
      "svg",
      {
        width: w,
        height: h,
        viewBox: `0 0 ${w} ${h}`,
        class: "beam-overview",
        "data-testid": "beam-overview",
        role: "img",
        "aria-label": `the beams over ${plural(steps.length, "step")}: lines join each kept beam to its parent`,
      },
      shapes,
    ),
  ]);
}

function beamLine(x1, y1, x2, y2, cls) {
  return svgEl("line", { x1, y1, x2, y2, class: cls });
}

document.addEventListener("DOMContentLoaded", () => {
  $("run-beams").addEventListener("click", runBeams);
});
