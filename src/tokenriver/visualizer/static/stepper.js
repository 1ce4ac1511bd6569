"use strict";
/*
 * Slow motion: one token per click, shown phase by phase. Each click is a one-token request (with a seed
 * derived from the path's seed and the token's position, so a stepped path replays identically). The
 * phases are drawn from what the engine reports, never simulated:
 *   1. context → forward pass: tokens in, how many the KV cache already held, the engine's pass counter;
 *   2. logits: the model's raw scores for the top candidates;
 *   3. each sampling stage in the sampler's order, as the sampler recorded it at this step (trace.stages);
 *   4. the random draw: the uniform and where it landed in the cumulative distribution (trace extra.draw);
 *   5. the token appended, to be fed back as the next pass's input.
 */

// Pause between phases: long enough to follow, short enough that a click is not a wait.
const PHASE_MS = 450;

// isManual: phases wait for a click on "next phase" instead of playing on their own.
const stepper = { serial: 0, timers: [], isManual: false };

/** The branch a stepped token goes to: the current step branch when at its end, else a new one. */
function stepTarget(params) {
  const current = currentBranch();
  if (!current) return newStepBranch(null, [], params);
  const path = pathOf(current);
  const end = state.selectedStep === null ? path.length - 1 : state.selectedStep;
  if (current.kind === "step" && end === path.length - 1) return current;
  const prefix = path.slice(0, end + 1);
  const owner = prefix.length < path.length ? ownerOfStep(current, prefix.length) : current;
  return newStepBranch(owner, prefix, params);
}

function newStepBranch(parent, prefix, params) {
  const branch = newBranch(parent, prefix.length, prefix, null, params);
  branch.kind = "step";
  return branch;
}

/** Seed of the token at path position `position`: distinct per position, fixed for a given path seed. */
function stepSeed(params, position) {
  return (params.seed + position) % 2 ** 31;
}

async function stepOnce() {
  if (isBusy()) return;
  clearError();
  let params;
  state.isStarting = true;
  updateBusy();
  try {
    params = readParams();
    if (!(await preparePrompt(stepOnce))) return;
  } catch (error) {
    showError(error);
    return;
  } finally {
    state.isStarting = false;
    updateBusy();
  }
  const current = currentBranch();
  if (
    current &&
    current.kind === "step" &&
    ["stop", "length"].includes(current.finishReason) &&
    state.selectedStep === pathOf(current).length - 1
  ) {
    showError(inputError(null, `this path ${statusText(current)}; select an earlier token to step from there`));
    return;
  }
  const branch = stepTarget(params);
  selectBranch(branch.id, pathOf(branch).length ? pathOf(branch).length - 1 : null);
  branch.status = "streaming";
  updateBusy();
  scheduleRender();
  await stepBranch(branch, true);
}

/**
 * Generate one token onto `branch` with a one-token request. `animate`: show the phases (an import replays
 * stepped paths without them).
 */
async function stepBranch(branch, animate) {
  const position = pathOf(branch).length;
  const body = {
    prompt: promptIdsOf(branch),
    trace: true,
    trace_stages: true,
    logprobs: 5,
    ...apiSampling(branch.params),
    ...constraintFields(branch, position),
    max_tokens: 1,
    seed: stepSeed(branch.params, position),
  };
  if (state.modelName) body.model = state.modelName;
  try {
    const out = await apiJson("/v1/completions", body);
    labelRequest(out.id, [branch]);
    const after = animate ? await apiJson("/v1/engine") : null;
    if (animate) await refreshPasses();
    const choice = out.choices[0];
    const token = tokensOfChoice(choice)[0];
    branch.tokens.push(token);
    if (state.currentId === branch.id) state.selectedStep = position;
    branch.metrics = out.metrics || branch.metrics;
    branch.status = "done";
    [branch.finishReason, branch.stopReason] = stepEnding(branch, choice);
    if (animate) showPhases({ branch, position, token, metrics: out.metrics, after, responseId: out.id });
  } catch (error) {
    failBranch(branch, error);
    showError(error);
  } finally {
    updateBusy();
    pollEngineUntilIdle();
    scheduleRender();
  }
}

/**
 * Whether a stepped path ends with its newest token, as a generation would: [finish reason, stop reason]. A stop
 * string may span stepped tokens, so the path's generated text is searched, not only the last request's.
 */
function stepEnding(branch, choice) {
  const path = pathOf(branch);
  const text = path.map((t) => t.text).join("");
  const stop = (branch.params.stop || []).find((s) => text.includes(s));
  if (stop !== undefined) return ["stop", stop];
  if (choice.finish_reason === "stop") return ["stop", choice.stop_reason ?? null];
  if (isEos(path[path.length - 1].id)) return ["stop", null];
  if (path.length >= (branch.params.max_tokens ?? 16)) return ["length", null];
  return ["step", null];
}

/** Import: a stepped path of `count` tokens, stepped again with the same per-position seeds. */
async function replaySteps(branch, count) {
  for (let i = 0; i < count; i += 1) {
    branch.status = "streaming";
    await stepBranch(branch, false);
    if (branch.status !== "done") return;
  }
}

/* ---------------------------------------------------------------- the phases */

function showPhases(step) {
  stepper.timers.forEach(clearTimeout);
  const serial = ++stepper.serial;
  const phases = buildPhases(step);
  const list = el("ol", { class: "phases", "data-testid": "stepper-phases" });
  const manual = el("input", {
    type: "checkbox",
    id: "phase-by-phase",
    "data-testid": "phase-by-phase",
    checked: stepper.isManual,
    onchange: (event) => {
      stepper.isManual = event.target.checked;
    },
  });
  const nextPhase = el("button", {
    type: "button",
    class: "small",
    "data-testid": "stepper-next-phase",
    text: "next phase ▸",
    hidden: !stepper.isManual,
    onclick: () => revealPhase(list, phases, nextPhase),
  });
  $("stepper").replaceChildren(
    el("p", {
      class: "hint",
      text:
        `Token ${step.position + 1} of path ${step.branch.id}, ${settingsText(step.branch.params)}, ` +
        `seed ${stepSeed(step.branch.params, step.position)} for this token.`,
    }),
    list,
    el("div", { class: "actions" }, [
      nextPhase,
      el("button", {
        type: "button",
        class: "small",
        "data-testid": "stepper-again",
        text: "replay the animation",
        onclick: () => showPhases(step),
      }),
      el("button", {
        type: "button",
        class: "small primary",
        "data-testid": "stepper-next",
        text: "next token ▸",
        onclick: () => stepOnce(),
      }),
      el("label", { class: "check" }, [manual, "phase by phase (wait for a click)"]),
    ]),
  );
  $("stepper-panel").hidden = false;
  if (stepper.isManual) {
    revealPhase(list, phases, nextPhase);
    return;
  }
  // Each phase appears after the one before it; the list is complete after phases.length × PHASE_MS.
  phases.forEach((_, i) => {
    stepper.timers.push(
      setTimeout(() => {
        if (serial === stepper.serial) revealPhase(list, phases, nextPhase);
      }, i * PHASE_MS),
    );
  });
}

/** Show the next hidden phase; the "next phase" button goes away after the last one. */
function revealPhase(list, phases, nextPhase) {
  const shown = list.children.length;
  if (shown >= phases.length) return;
  list.append(phases[shown]);
  list.dataset.shown = String(shown + 1);
  nextPhase.hidden = shown + 1 >= phases.length || !stepper.isManual;
}

function phaseItem(name, title, children) {
  return el("li", { class: "phase", "data-testid": "stepper-phase", "data-phase": name }, [
    el("strong", { text: title }),
    ...children,
  ]);
}

function buildPhases(step) {
  const trace = step.token.trace;
  const phases = [contextPhase(step), logitsPhase(trace)];
  for (const stage of recordedStages(trace, step.branch)) phases.push(stagePhase(trace, stage));
  phases.push(drawPhase(trace, step.token));
  phases.push(
    phaseItem("appended", "5. Appended", [
      el("p", {
        text:
          `“${visibleText(step.token.text)}” (id ${step.token.id}) becomes token ${step.position + 1}. ` +
          (step.branch.finishReason === "step"
            ? "The next forward pass takes it as input and writes its key and value into the KV cache."
            : `The path has ${statusText(step.branch)}: generation stops here.`),
      }),
    ]),
  );
  return phases;
}

function contextPhase(step) {
  const m = step.metrics || {};
  const contextLength = m.num_prompt_tokens ?? promptIdsOf(step.branch).length - 1;
  const cached = m.num_cached_tokens ?? 0;
  const passes = passesOf(step.responseId);
  return phaseItem("forward", "1. Context → forward pass", [
    el("p", {}, [
      `${plural(contextLength, "token")} of context go in; `,
      el("span", { "data-testid": "stepper-cached", text: `${plural(cached, "token")} already in the KV cache` }),
      ` (whole blocks found by the prefix cache), so this pass computes `,
      el("strong", { "data-testid": "stepper-new-slots", text: plural(contextLength - cached, "new KV slot") }),
      ".",
    ]),
    kvStrip(contextLength, cached),
    el("p", { "data-testid": "stepper-pass-counter" }, [
      passPhrase(passes),
      "; the engine's forward-pass counter reads ",
      el("strong", { text: step.after ? step.after.num_forward_passes : "?" }),
      " now.",
    ]),
  ]);
}

/**
 * The context's KV slots in a row: those the prefix cache already held, those this pass writes, and the dashed
 * slot of the token being generated (its keys and values are computed when the next pass takes it as input).
 */
function kvStrip(contextLength, cached) {
  const slot = 9;
  const perRow = 64;
  const total = contextLength + 1;
  const rows = Math.ceil(total / perRow);
  const shapes = Array.from({ length: total }, (_, i) =>
    svgEl("rect", {
      x: (i % perRow) * slot,
      y: Math.floor(i / perRow) * slot,
      width: slot - 2,
      height: slot - 2,
      class: `kv-slot ${i < cached ? "cached" : i < contextLength ? "prompt" : "next"}`,
      "data-testid": i < cached ? "kv-strip-cached" : i < contextLength ? "kv-strip-new" : "kv-strip-next",
    }),
  );
  const width = Math.min(total, perRow) * slot;
  return el("div", { class: "kv-strip" }, [
    svgEl(
      "svg",
      {
        width,
        height: rows * slot,
        viewBox: `0 0 ${width} ${rows * slot}`,
        role: "img",
        "aria-label": `${plural(cached, "cached slot")}, ${plural(contextLength - cached, "new slot")}, then the new token's slot`,
      },
      shapes,
    ),
    el("p", { class: "timeline-legend" }, [
      el("span", { class: "key cached" }),
      " already cached ",
      el("span", { class: "key prompt" }),
      " written by this pass ",
      el("span", { class: "key next" }),
      " the new token: written by the next pass",
    ]),
  ]);
}

function passPhrase(passes) {
  if (!passes.length) return "The engine ran it";
  if (passes.length === 1) return `The engine ran it in forward pass ${passes[0]}`;
  return `The engine ran it in forward passes ${passes.join(", ")} (the context was cut into chunks)`;
}

/** The logged forward passes that carried the request `responseId` (GET /v1/visualizer/passes). */
function passesOf(responseId) {
  return timeline.passes
    .filter((p) => p.rows.some((r) => r.request_id.startsWith(`${responseId}-`)))
    .map((p) => p.pass);
}

function logitsPhase(trace) {
  const top = trace.candidates
    .slice()
    .sort((a, b) => a.rank - b.rank)
    .slice(0, 8);
  const hi = top[0].logit;
  const lo = Math.min(...top.map((c) => c.logit)) - 1;
  return phaseItem("logits", "2. Logits: one score per vocabulary token", [
    el(
      "div",
      { class: "mini-bars" },
      top.map((c) =>
        el("div", { class: "mini-bar-row" }, [
          el("span", { class: "tok-text", text: visibleText(c.text) }),
          el("div", { class: "bar-track" }, [
            el("div", { class: "bar logit", style: `width:${(((c.logit - lo) / (hi - lo)) * 100).toFixed(1)}%` }),
          ]),
          el("span", { class: "num", text: `${c.logit.toFixed(2)} → p ${fmtProb(c.prob_raw)}` }),
        ]),
      ),
    ),
    el("p", { class: "hint", text: "softmax turns logits into the raw probabilities (p)." }),
  ]);
}

function stagePhase(trace, stage) {
  const top = trace.candidates
    .slice()
    .sort((a, b) => a.rank - b.rank)
    .slice(0, 8);
  return phaseItem("stage", `3. Sampling stage: ${stage.name}`, [
    el(
      "div",
      { class: "mini-bars" },
      top.map((c) => {
        const p = stage.probs.get(c.token_id) ?? 0;
        return el("div", { class: `mini-bar-row${p === 0 ? " removed" : ""}` }, [
          el("span", { class: "tok-text", text: visibleText(c.text) }),
          el("div", { class: "bar-track" }, [
            el("div", { class: "bar final", style: `width:${(p * 100).toFixed(1)}%` }),
          ]),
          el("span", { class: "num", "data-testid": "stage-phase-prob", "data-prob": p, text: p === 0 ? "removed" : fmtProb(p) }),
        ]);
      }),
    ),
    el("p", { class: "hint", text: `${stage.kept} kept after this stage.` }),
  ]);
}

/** The uniform on a 0–1 bar, over the chosen token's span of the cumulative distribution. */
function drawPhase(trace, token) {
  const draw = trace.extra && trace.extra.draw;
  if (!draw) {
    return phaseItem("draw", "4. No random draw", [
      el("p", {
        text: `Greedy decoding takes the argmax: “${visibleText(token.text)}”, every time.`,
      }),
    ]);
  }
  const width = 600;
  const x = (v) => v * width;
  const svg = svgEl(
    "svg",
    {
      viewBox: `0 0 ${width} 40`,
      class: "cdf",
      preserveAspectRatio: "none",
      role: "img",
      "aria-label": `u = ${draw.uniform.toFixed(4)} in the span ${draw.cdf_start.toFixed(4)} to ${draw.cdf_end.toFixed(4)}`,
    },
    [
      svgEl("rect", { x: 0, y: 10, width, height: 20, class: "cdf-track" }),
      svgEl("rect", {
        x: x(draw.cdf_start),
        y: 10,
        width: Math.max(2, x(draw.cdf_end - draw.cdf_start)),
        height: 20,
        class: "cdf-span",
        "data-testid": "cdf-span",
      }),
      svgEl("line", {
        x1: x(draw.uniform),
        x2: x(draw.uniform),
        y1: 2,
        y2: 38,
        class: "cdf-u",
        "data-testid": "cdf-u",
      }),
    ],
  );
  return phaseItem("draw", "4. The random draw", [
    el("p", {
      "data-testid": "stepper-draw",
      "data-uniform": draw.uniform,
      "data-cdf-start": draw.cdf_start,
      "data-cdf-end": draw.cdf_end,
      text:
        `u = ${draw.uniform.toFixed(4)}. Laid end to end in token-id order, the final probabilities fill 0 to 1; ` +
        `u lands in “${visibleText(token.text)}”'s span [${draw.cdf_start.toFixed(4)}, ${draw.cdf_end.toFixed(4)}).`,
    }),
    svg,
  ]);
}

document.addEventListener("DOMContentLoaded", () => {
  $("step-once").addEventListener("click", stepOnce);
});
