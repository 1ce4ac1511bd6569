"use strict";
/*
 * Replays, for what-ifs only, and the recorded stages. A step's distribution depends only on the tokens before
 * it, so one token from "prompt + path before the step" under other settings is that step under those settings,
 * computed by the engine's own sampler over the whole vocabulary (the prefix cache makes it cheap). The preview
 * is such a replay and says so; under the step's own settings it equals the recorded step bit for bit. The
 * stage table shows the stages the sampler recorded while generating the step (trace.stages), never a replay.
 * A constrained path's replay sends its constraint and the path's tokens before the step (constraint.js).
 *
 * Also here: export and import of a tree as JSON, replayed request by request and checked token by token.
 */

// Candidates a replay asks for: the API's maximum, so what the page shows is never short of the distribution.
const REPLAY_TOP = 100;

/** One token from the context before `step` of `branch`, under `settings`; returns that step's trace. */
async function replayStep(branch, step, settings) {
  const ids = state.treePromptIds.concat(
    pathOf(branch)
      .slice(0, step)
      .map((t) => t.id),
  );
  const body = {
    prompt: ids,
    max_tokens: 1,
    trace: true,
    trace_top: REPLAY_TOP,
    ...settings,
    ...constraintFields(branch, step),
  };
  if (state.modelName) body.model = state.modelName;
  const out = await apiJson("/v1/completions", body);
  labelRequest(out.id, "replay (preview)");
  return out.choices[0].trace[0];
}

/* ---------------------------------------------------------------- preview */

// The preview of the selected step: its own settings (never the generation settings) and the replayed result.
const preview = {
  key: null,
  settings: null,
  trace: null,
  status: "",
  serial: 0,
  timer: null,
  node: null,
  stagesNode: null,
};

/** The sampling settings a path's step was generated with, as preview inputs start from. */
function stepSettings(branch) {
  const p = branch.params;
  return {
    temperature: p.temperature ?? 1,
    top_k: p.top_k ?? 0,
    top_p: p.top_p ?? 1,
    min_p: p.min_p ?? 0,
    repetition_penalty: p.repetition_penalty ?? 1,
  };
}

/** Preview probabilities by token id, or null while no replay has answered for the selected step. */
function previewProbs() {
  const branch = currentBranch();
  if (!preview.trace || !branch || preview.key !== `${branch.id}:${state.selectedStep}`) return null;
  return finalDistribution(preview.trace);
}

function previewInput(name, label, attrs) {
  const id = `preview-${name.replace("_", "-")}`;
  const input = el("input", {
    id,
    "data-testid": id,
    "data-focus-key": id,
    value: preview.settings[name],
    ...attrs,
    oninput: (event) => {
      const value = Number(event.target.value);
      if (Number.isNaN(value)) return;
      preview.settings[name] = value;
      const shown = document.getElementById(`${id}-value`);
      if (shown) shown.textContent = String(value);
      schedulePreview();
    },
  });
  return el("div", { class: "control" }, [
    el("label", { for: id }, [label, " ", el("output", { id: `${id}-value`, text: String(preview.settings[name]) })]),
    input,
  ]);
}

/**
 * The preview controls. Built once per selected step and reused across renders, so a slider being dragged is
 * not replaced under the pointer while tokens stream in.
 */
function previewPanel(branch, step) {
  const key = `${branch.id}:${step}`;
  if (preview.key === key && preview.node) {
    updatePreviewStatus();
    return preview.node;
  }
  preview.key = key;
  preview.settings = stepSettings(branch);
  preview.trace = null;
  preview.status = "Move a setting to replay this token under it (a new request; the bars above are the recorded step).";
  preview.stagesNode = el("div", { class: "stages", "data-testid": "stages" });
  preview.node = el("fieldset", { class: "preview-box", "data-testid": "preview" }, [
    el("legend", { text: "Preview: replay this token under other settings (does not change the generation settings)" }),
    el("div", { class: "controls preview-controls" }, [
      previewInput("temperature", "temperature", { type: "range", min: 0, max: 2, step: 0.05 }),
      previewInput("top_k", "top-k", { type: "number", min: 0, step: 1 }),
      previewInput("top_p", "top-p", { type: "number", min: 0.01, max: 1, step: 0.01 }),
      previewInput("min_p", "min-p", { type: "number", min: 0, max: 1, step: 0.01 }),
    ]),
    el("p", { class: "hint", "data-testid": "preview-status" }),
    el("div", { class: "actions" }, [
      el("button", {
        type: "button",
        class: "small",
        "data-testid": "preview-now",
        text: "replay now",
        onclick: () => runPreview(),
      }),
      el("button", {
        type: "button",
        class: "small",
        "data-testid": "show-stages",
        text: "show every stage (recorded)",
        onclick: () => showStages(currentBranch(), state.selectedStep, preview.stagesNode),
      }),
    ]),
    preview.stagesNode,
  ]);
  updatePreviewStatus();
  return preview.node;
}

function updatePreviewStatus() {
  const status = preview.node && preview.node.querySelector("[data-testid=preview-status]");
  if (status) status.textContent = preview.status;
}

function schedulePreview() {
  clearTimeout(preview.timer);
  preview.timer = setTimeout(runPreview, 150);
}

async function runPreview() {
  const branch = currentBranch();
  const step = state.selectedStep;
  if (!branch || step === null) return;
  const serial = ++preview.serial;
  const settings = { ...preview.settings };
  preview.status = "replaying…";
  updatePreviewStatus();
  try {
    const trace = await replayStep(branch, step, settings);
    if (serial !== preview.serial) return;
    preview.trace = trace;
    const shown = trace.candidates.reduce((sum, c) => sum + (finalDistribution(trace).get(c.token_id) || 0), 0);
    preview.status =
      `Replay (what-if): the engine computed this token again at T ${settings.temperature}, top-k ${settings.top_k}, ` +
      `top-p ${settings.top_p}, min-p ${settings.min_p}: ${keptText(trace)} kept; the ${plural(trace.candidates.length, "candidate")} ` +
      `it returned hold ${fmtPercent(shown)} of the preview distribution.`;
    $("why").dataset.previewSerial = String(serial);
  } catch (error) {
    preview.status = `Replay failed: ${error.message}`;
  }
  scheduleRender();
}

/* ---------------------------------------------------------------- every stage */

/** A recorded stage's name as the page writes it, with the path's value for that control. */
function stageLabel(name, params) {
  const p = params || {};
  const labels = {
    penalty: "penalties",
    bias: "logit bias",
    min_tokens: "min tokens (end held back)",
    grammar: p.structured_outputs ? `grammar (${constraintText(p.structured_outputs)})` : "grammar",
    temperature: `temperature ${p.temperature ?? 1}`,
    top_k: `top-k ${p.top_k}`,
    top_p: `top-p ${p.top_p}`,
    min_p: `min-p ${p.min_p}`,
  };
  return labels[name] || name;
}

/**
 * The step's stages as the sampler recorded them while generating it (trace.stages), each as
 * {name, probs: Map token id → probability, kept}. A greedy step ends with its argmax, one-hot.
 */
function recordedStages(trace, branch) {
  const stages = (trace.stages || []).map((stage) => ({
    name: stageLabel(stage.name, branch.params),
    probs: new Map(trace.candidates.map((c, i) => [c.token_id, stage.probs[i]])),
    kept: plural(stage.num_kept, "token"),
  }));
  if (trace.method === "greedy")
    stages.push({ name: "temperature 0: argmax (one-hot)", probs: finalDistribution(trace), kept: "1" });
  return stages;
}

function showStages(branch, step, box) {
  if (!branch || step === null) return;
  const trace = pathOf(branch)[step].trace;
  if (!trace || !trace.stages) {
    box.replaceChildren(el("p", { class: "hint", text: "This step was generated without its stages recorded." }));
    return;
  }
  box.replaceChildren(stagesTable(trace, recordedStages(trace, branch)));
}

/**
 * Candidates down, stages across: raw softmax, then after each stage, each column summing to at most 1. The top
 * ten by rank, plus every candidate still possible at the end (a constrained step's allowed tokens).
 */
function stagesTable(trace, stages) {
  const final = finalDistribution(trace);
  const candidates = trace.candidates
    .slice()
    .sort((a, b) => a.rank - b.rank)
    .filter((c, i) => i < 10 || (final.get(c.token_id) ?? 0) > 0);
  const columns = [
    { name: "raw softmax", probs: new Map(trace.candidates.map((c) => [c.token_id, c.prob_raw])), kept: null },
  ].concat(stages.map((s) => ({ name: `after ${s.name}`, probs: s.probs, kept: s.kept })));
  return el("table", { class: "stages-table", "data-testid": "stages-table" }, [
    el("caption", { class: "hint", text: "Recorded while this token was generated: the step itself, not a replay." }),
    el("thead", {}, [
      el("tr", {}, [
        el("th", { text: "token" }),
        el("th", { text: "logit" }),
        ...columns.map((col) =>
          el("th", { "data-testid": "stage-name" }, [
            col.name,
            col.kept ? el("br") : null,
            col.kept ? el("span", { class: "hint", text: `${col.kept} kept` }) : null,
          ]),
        ),
      ]),
    ]),
    el(
      "tbody",
      {},
      candidates.map((c) =>
        el("tr", { class: c.token_id === trace.chosen_token_id ? "picked" : "", "data-token-id": c.token_id }, [
          el("td", { text: visibleText(c.text) }),
          el("td", { class: "num", text: c.logit.toFixed(2) }),
          ...columns.map((col) => {
            const p = col.probs.get(c.token_id) ?? 0;
            return el("td", {
              class: "num",
              "data-testid": "stage-prob",
              "data-prob": p,
              style: `background:${probColor(p)};color:${probInk(p)}`,
              text: fmtProb(p),
            });
          }),
        ]),
      ),
    ),
  ]);
}

/* ---------------------------------------------------------------- export and import */

const EXPORT_FORMAT = "tokenriver-visualizer-tree";

/** Everything needed to run the tree again: the prompt, and per path its settings, seed, fork and tokens. */
function treeExport() {
  return {
    format: EXPORT_FORMAT,
    // 2: a stepped path is one request for the whole path, played back (1: one request per stepped token).
    version: 2,
    model: state.modelName,
    prompt: { ...state.treePromptText, token_ids: state.treePromptIds },
    paths: state.branches
      .filter((b) => b.status !== "streaming")
      .map((b) => ({
        id: b.id,
        parent: b.parentId,
        fork_step: b.prefix.length,
        kind: b.kind || (b.params.n ? "samples" : isForcedStart(b) ? "branch" : "generate"),
        forced_token_id: isForcedStart(b) ? b.tokens[0].id : null,
        settings: { ...b.params },
        token_ids: b.tokens.map((t) => t.id),
        // Each token's recorded step (its stages included), so a reader of the file sees what the page showed.
        traces: b.tokens.map((t) => t.trace),
        finish_reason: b.finishReason,
      })),
  };
}

function exportTree() {
  if (!state.branches.length) {
    showError(inputError(null, "there is no tree to export yet"));
    return;
  }
  const blob = new Blob([JSON.stringify(treeExport(), null, 2)], { type: "application/json" });
  const link = el("a", { href: URL.createObjectURL(blob), download: `tokenriver-tree-${Date.now()}.json` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

async function importTreeFile(file) {
  if (!file) return;
  clearError();
  try {
    const data = JSON.parse(await file.text());
    await importTree(data);
  } catch (error) {
    showError(error instanceof ApiError ? error : inputError(null, `cannot import this file: ${error.message}`));
  } finally {
    $("import-tree").value = "";
  }
}

/** Rebuild a tree from an export by running its requests again in order, then compare every token. */
async function importTree(data) {
  if (!data || data.format !== EXPORT_FORMAT || !Array.isArray(data.paths))
    throw new Error(`not a ${EXPORT_FORMAT} file`);
  if (isBusy()) throw new Error("wait for the running generation to end");
  restorePromptInputs(data.prompt);
  const ids = await tokenizePrompt();
  if (!ids || ids.length !== data.prompt.token_ids.length || ids.some((id, i) => id !== data.prompt.token_ids[i])) {
    throw new Error("this server's tokenizer turns the saved prompt into other token ids (another model?)");
  }
  startTree(ids);
  const made = new Map();
  const groups = new Map();
  for (const saved of data.paths.slice().sort((a, b) => a.id - b.id)) {
    if (saved.kind === "samples") {
      const key = saved.settings.group;
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(saved);
      if (groups.get(key).length < saved.settings.n) continue;
      await replaySamples(groups.get(key), made);
    } else {
      await replayPath(saved, made);
    }
  }
  state.importReport =
    importVerdict(data.paths, made, data.version || 1) +
    (data.model && data.model !== state.modelName
      ? ` The file was made with ${data.model}; this server runs ${state.modelName}.`
      : "");
  scheduleRender();
}

async function replayPath(saved, made) {
  const parent = saved.parent === null ? null : made.get(saved.parent) || null;
  const prefix = parent ? pathOf(parent).slice(0, saved.fork_step) : [];
  let forced = null;
  if (saved.forced_token_id !== null) {
    const parentTrace = parent ? pathOf(parent)[saved.fork_step].trace : null;
    let candidate = parentTrace && parentTrace.candidates.find((c) => c.token_id === saved.forced_token_id);
    if (!candidate) {
      if (!parent) throw new Error(`path ${saved.id} forces a token but has no parent`);
      candidate = await lookUpCandidate(parent, saved.fork_step, saved.forced_token_id);
    }
    forced = forcedToken(parentTrace, candidate);
  }
  const branch = newBranch(parent, saved.fork_step, prefix, forced, { ...saved.settings });
  branch.kind = saved.kind;
  made.set(saved.id, branch);
  selectBranch(branch.id, null);
  if (saved.kind === "step") {
    await replaySteps(branch, saved.token_ids.length);
  } else {
    await runBranch(branch);
  }
}

async function replaySamples(group, made) {
  const first = group[0];
  const parent = first.parent === null ? null : made.get(first.parent) || null;
  const prefix = parent ? pathOf(parent).slice(0, first.fork_step) : [];
  const branches = group.map((saved) => {
    const branch = newBranch(parent, first.fork_step, prefix, null, { ...saved.settings });
    made.set(saved.id, branch);
    return branch;
  });
  await runRequest(branches, completionBody(branches[0], { n: first.settings.n }));
}

/**
 * Why a path replayed differently, or null when it did not: the first step whose token or recorded probability
 * differs, and what differs there. The model's raw probabilities depend only on the context, so a different raw
 * probability for the same context means another model or other numerics; the same raw distribution with another
 * final probability means other sampling settings; the same distribution with another token means another draw.
 */
function replayDifference(saved, branch, version) {
  if (!branch) return "it could not run";
  const tokens = branch.tokens;
  const count = Math.min(tokens.length, saved.token_ids.length);
  for (let i = 0; i < count; i += 1) {
    const before = saved.traces ? saved.traces[i] : null;
    const after = tokens[i].trace;
    const at = `token ${saved.fork_step + i + 1}`;
    if (before && after && before.chosen_token_id === saved.token_ids[i]) {
      const raw = after.candidates.find((c) => c.token_id === saved.token_ids[i]);
      const rawBefore = before.chosen_prob_raw;
      if (!raw || Math.abs(raw.prob_raw - rawBefore) > 1e-6)
        return (
          `at ${at} the model gives the saved token another raw probability (${fmtProb(rawBefore)} then, ` +
          `${raw ? fmtProb(raw.prob_raw) : "not among the candidates"} now): another model or other numerics settings`
        );
      if (tokens[i].id === saved.token_ids[i] && Math.abs(after.chosen_prob_final - before.chosen_prob_final) > 1e-6)
        return `at ${at} the same raw distribution was sampled under other settings (penalties, temperature or filters)`;
    }
    if (tokens[i].id !== saved.token_ids[i]) {
      if (version < 2 && saved.kind === "step")
        return `at ${at} another draw: the page that saved it stepped one request per token, with its own seed each`;
      return `at ${at} the same distribution gave another token: another random draw (seed)`;
    }
  }
  if (tokens.length !== saved.token_ids.length && !saved.finish_reason)
    return "it was saved while it was stopped, before it finished";
  if (tokens.length !== saved.token_ids.length)
    return `it ended after ${plural(tokens.length, "token")} instead of ${saved.token_ids.length} (another stop condition)`;
  return null;
}

function importVerdict(saved, made, version) {
  const differing = saved
    .map((s) => [s, replayDifference(s, made.get(s.id), version)])
    .filter(([, cause]) => cause !== null);
  if (!differing.length)
    return `Imported and replayed ${plural(saved.length, "path")}: every token identical to the export.`;
  return (
    `Imported ${plural(saved.length, "path")}; replayed differently: ` +
    differing.map(([s, cause]) => `path ${s.id} (${cause})`).join("; ") +
    "."
  );
}
