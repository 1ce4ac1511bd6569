"use strict";
/*
 * Slow motion: a generated path played back one token per click, each token shown as the forward pass that made
 * it. The first click on a new path runs one ordinary request for the whole path, the same request Generate
 * sends (the path's seed and settings, its max tokens and stop strings), so the engine decodes it as it decodes
 * any request: one prompt pass (or a few chunks), then one decode pass per token with the KV cache kept between
 * passes. Each click then reveals the next token with what the engine recorded for it, never simulated:
 *   1. its forward pass, from the engine's pass log (GET /v1/visualizer/passes): the first token's pass computed
 *      the prompt (less the whole blocks the prefix cache held); every later pass computed one new KV slot;
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
  branch.status = "done";
  branch.finishReason = "step";
  return branch;
}

/** Tokens of a step branch's request not shown yet. */
function hasPendingTokens(branch) {
  return Boolean(branch.playback) && branch.playback.next < branch.playback.tokens.length;
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
  const atEnd = current && state.selectedStep === pathOf(current).length - 1;
  if (current && current.kind === "step" && atEnd && !hasPendingTokens(current) && current.finishReason !== "step") {
    showError(inputError(null, `this path ${statusText(current)}; select an earlier token to step from there`));
    return;
  }
  const branch = stepTarget(params);
  if (!hasPendingTokens(branch)) {
    if (remainingTokens(branch) <= 0) {
      state.branches = state.branches.filter((b) => b !== branch || b.tokens.length);
      showError(inputError("max_tokens", "the path already has max tokens; raise max tokens to step further"));
      scheduleRender();
      return;
    }
    selectBranch(branch.id, pathOf(branch).length ? pathOf(branch).length - 1 : null);
    if (!(await startPlayback(branch))) return;
  }
  revealNext(branch, true);
}

/**
 * Run `branch`'s whole continuation as one request (not streamed) and keep its tokens to reveal one per click,
 * with the engine's pass log for them. Returns false when the request failed.
 */
async function startPlayback(branch) {
  branch.status = "streaming";
  updateBusy();
  scheduleRender();
  const body = completionBody(branch, { stream: false, stream_options: undefined });
  try {
    const out = await apiJson("/v1/completions", body);
    labelRequest(out.id, [branch]);
    await refreshPasses();
    const choice = out.choices[0];
    branch.playback = {
      responseId: out.id,
      tokens: tokensOfChoice(choice),
      next: 0,
      // Tokens of context the request's first pass started from: the prompt and the path before the first token.
      contextLength: promptIdsOf(branch).length,
      finishReason: choice.finish_reason,
      stopReason: choice.stop_reason ?? null,
      metrics: out.metrics,
    };
    branch.status = "done";
    branch.finishReason = "step";
    return true;
  } catch (error) {
    failBranch(branch, error);
    showError(error);
    return false;
  } finally {
    updateBusy();
    pollEngineUntilIdle();
    scheduleRender();
  }
}

/** Show the next recorded token of `branch`'s request; `animate`: play its phases (an import shows none). */
function revealNext(branch, animate) {
  const playback = branch.playback;
  const index = playback.next;
  const token = playback.tokens[index];
  const position = pathOf(branch).length;
  playback.next += 1;
  branch.tokens.push(token);
  if (!hasPendingTokens(branch)) {
    branch.finishReason = playback.finishReason;
    branch.stopReason = playback.stopReason;
    branch.metrics = playback.metrics;
  }
  if (state.currentId === branch.id) {
    state.selectedStep = position;
    state.isFollowing = false;
  }
  if (animate) showPhases({ branch, position, token, index, pass: playbackPass(branch, index) });
  scheduleRender();
}

/**
 * The forward pass that produced token `index` of the branch's request, from the pass log: the prompt's pass (or
 * its chunks) for the first token; after it, one decode row per token, where a verification pass under
 * speculative decoding yields its accepted drafts and one more token. Returns {passes, rows} (empty when the log
 * no longer holds them).
 */
function playbackPass(branch, index) {
  const logged = passRowsOf(branch);
  const prompt = logged.filter((r) => r.row.is_prompt);
  if (index === 0) return { passes: prompt.map((r) => r.pass), rows: prompt.map((r) => r.row) };
  const decode = logged.filter((r) => !r.row.is_prompt);
  let rowIndex = 0;
  for (let i = 1; i < index; i += 1) {
    const trace = branch.playback.tokens[i].trace;
    const spec = trace && trace.extra && trace.extra.speculative;
    const isAcceptedDraft = spec && spec.draft_token_id !== null && spec.accepted;
    if (!isAcceptedDraft) rowIndex += 1;
  }
  const entry = decode[rowIndex];
  return entry ? { passes: [entry.pass], rows: [entry.row] } : { passes: [], rows: [] };
}

/** Import: a stepped path of `count` tokens, run again as one request and revealed without the phases. */
async function replaySteps(branch, count) {
  branch.finishReason = "step";
  if (!(await startPlayback(branch))) return;
  for (let i = 0; i < count && hasPendingTokens(branch); i += 1) revealNext(branch, false);
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
        `Token ${step.position + 1} of path ${step.branch.id} (${settingsText(step.branch.params)}), played back ` +
        `from its request: ${plural(step.branch.playback.tokens.length, "token")} decoded by the engine as ` +
        "Generate would, shown one forward pass per click.",
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
          (hasPendingTokens(step.branch)
            ? "The next forward pass takes it as input and writes its key and value into the KV cache."
            : `The path has ${statusText(step.branch)}: generation stops here.`),
      }),
    ]),
  );
  return phases;
}

/**
 * The token's forward pass. The request's first pass takes the whole context and computes every slot the prefix
 * cache did not hold; each later pass takes one token (the one the pass before it sampled) and computes its one
 * new KV slot: the keys and values of everything before it are read from the cache, not recomputed.
 */
function contextPhase(step) {
  const playback = step.branch.playback;
  const isPrompt = step.index === 0;
  const contextLength = playback.contextLength + step.index;
  const logged = step.pass.rows.reduce((sum, row) => sum + row.num_tokens, 0);
  const newSlots = step.pass.rows.length
    ? logged
    : isPrompt
      ? contextLength - ((playback.metrics && playback.metrics.num_cached_tokens) || 0)
      : 1;
  const cached = contextLength - newSlots;
  const cachedText = isPrompt
    ? `${plural(cached, "token")} already in the KV cache (whole blocks found by the prefix cache)`
    : `${plural(cached, "token")} already in the KV cache (written by this request's earlier passes)`;
  return el(
    "li",
    {
      class: "phase",
      "data-testid": "stepper-phase",
      "data-phase": "forward",
      "data-request-id": `${playback.responseId}-0`,
      "data-passes": step.pass.passes.join(","),
      "data-context": contextLength,
    },
    [
      el("strong", { text: isPrompt ? "1. Context → the prompt's forward pass" : "1. Context → one decode pass" }),
      el("p", {}, [
        `${plural(contextLength, "token")} of context; `,
        el("span", { "data-testid": "stepper-cached", "data-cached": cached, text: cachedText }),
        ", so this pass computes ",
        el("strong", {
          "data-testid": "stepper-new-slots",
          "data-new-slots": newSlots,
          text: plural(newSlots, "new KV slot"),
        }),
        isPrompt
          ? "."
          : ": the one token the previous pass sampled goes in, and attention reads the rest from the cache.",
      ]),
      kvStrip(contextLength, cached),
      el("p", { "data-testid": "stepper-pass-counter" }, [passPhrase(step.pass.passes, step.pass.rows), "."]),
    ],
  );
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

function passPhrase(passes, rows) {
  if (!passes.length) return "The engine's pass log no longer holds this pass";
  const drafts = rows.reduce((sum, row) => sum + row.num_draft_tokens, 0);
  const shared = passes.length === 1 ? sharedWith(passes[0]) : 0;
  const tail =
    (drafts ? `, verifying ${plural(drafts, "draft token")}` : "") +
    (shared ? `; ${plural(shared, "other request")} shared it (batching)` : "");
  if (passes.length === 1) return `The engine's pass log: forward pass ${passes[0]}${tail}`;
  return `The engine's pass log: forward passes ${passes.join(", ")} (the prompt was cut into chunks)`;
}

/** How many other requests a logged pass carried. */
function sharedWith(pass) {
  const logged = timeline.passes.find((p) => p.pass === pass);
  return logged ? logged.rows.length - 1 : 0;
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

/** The uniform on the cumulative distribution and, zoomed in, the chosen token's span among its neighbours'. */
function drawPhase(trace, token) {
  const draw = trace.extra && trace.extra.draw;
  if (!draw) {
    return phaseItem("draw", "4. No random draw", [
      el("p", {
        text: `Greedy decoding takes the argmax: “${visibleText(token.text)}”, every time.`,
      }),
    ]);
  }
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
    draw.neighbors ? cdfAroundDraw(trace, draw) : null,
  ]);
}

document.addEventListener("DOMContentLoaded", () => {
  $("step-once").addEventListener("click", stepOnce);
});
