"use strict";
/*
 * tokenriver visualizer: one page over the server's HTTP API. No build step, no library, nothing fetched
 * but the API of the server that served this file. Plain scripts sharing one global scope, loaded in order:
 * format.js (helpers), app.js (state, requests, the token row), constraint.js (the output constraint),
 * why.js (panel 3), tree.js (panel 4), engine.js (panel 6), replay.js (exact replays, export/import),
 * timeline.js (batching), stepper.js (slow motion), inside.js (inside the forward pass), sparklines.js (the
 * distribution over time), beams.js (beam search), cost.js (the cost of a token: roofline, batching under load),
 * tour.js (the guided tour: stops that arm the page's own controls and point at the panel proving each claim).
 *
 * Data flow. POST /tokenize turns the prompt (or the chat-templated conversation) into token ids. Every
 * generation is a streamed POST /v1/completions whose prompt is those ids and which asks for a per-step
 * trace (`trace: true`, `trace_stages: true`): for each generated token, the top candidates with their logits and
 * probabilities before (prob_raw) and after (prob_final) sampling's processing, their distribution after each
 * stage as the sampler computed it at that step (stages), which stage removed which, and for a sampled token
 * the uniform it drew (extra.draw). Everything the page says about a step is read from that record; replays
 * (new requests for the same context) are only for what-ifs under other settings, and are labelled so.
 *
 * A "branch" is one such request (or one choice of an n-sample request). The root branch starts after the
 * prompt. A child branch starts at step `forkStep` of its parent: its prompt is the prompt ids + the parent
 * path's ids before that step (+ the token the user forced there, which is its first token). A path is
 * therefore `branch.prefix` (the ancestors' tokens, shared) followed by `branch.tokens` (its own).
 *
 * All state lives in `state`; render functions redraw a panel from it and keep nothing of their own.
 */

const state = {
  modelName: null,
  // GET /v1/visualizer/info: eos_token_ids, block_size, kv_bytes_per_token.
  info: null,
  // Set by the last /tokenize: the prompt as the model sees it, and the request that produced it.
  promptIds: null,
  promptStrs: null,
  promptRequest: null,
  // The prompt the current tree was generated from (a different prompt starts a new tree, after asking).
  treePromptIds: null,
  treePromptRequest: null,
  treePromptText: null,
  branches: [],
  currentId: null,
  selectedStep: null,
  // While true, the selection follows the newest token of the current branch as it streams in.
  isFollowing: true,
  // True between a Generate click and its request starting: a second click must not start a second root.
  isStarting: false,
  compareIds: new Set(),
  engine: null,
  engineError: null,
  nextBranchNumber: 1,
  // The step whose candidates the small popover next to the token row shows (null = closed).
  popoverStep: null,
  // A data-focus-key to focus after the next render (focus must follow the user's action, never fall to body).
  focusAfterRender: null,
  // Result of the last import's replay check, shown in the tree panel.
  importReport: null,
};

const $ = (id) => document.getElementById(id);

/* ---------------------------------------------------------------- API */

class ApiError extends Error {
  /** The server's OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}. */
  constructor(status, error) {
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.type = error.type || null;
    this.param = error.param || null;
    this.code = error.code || null;
  }
}

function apiHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

async function errorFromResponse(response) {
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    body = null;
  }
  const error = body && body.error ? body.error : { message: `${response.status} ${response.statusText}` };
  return new ApiError(response.status, error);
}

async function api(path, body, signal) {
  let response;
  try {
    response = await fetch(path, {
      method: body === undefined ? "GET" : "POST",
      headers: apiHeaders(),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(0, { message: `cannot reach the server (${error.message}); is \`tokenriver serve\` running?` });
  }
  if (!response.ok) throw await errorFromResponse(response);
  return response;
}

async function apiJson(path, body) {
  return (await api(path, body)).json();
}

/** Yield each JSON event of a server-sent-event stream until `data: [DONE]`. */
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const separator = /\r?\n\r?\n/;
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let match;
    while ((match = separator.exec(buffer)) !== null) {
      const block = buffer.slice(0, match.index);
      buffer = buffer.slice(match.index + match[0].length);
      const data = block
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

/* ---------------------------------------------------------------- errors */

const PARAM_INPUTS = {
  temperature: "temperature",
  top_k: "top-k",
  top_p: "top-p",
  min_p: "min-p",
  repetition_penalty: "repetition-penalty",
  seed: "seed",
  max_tokens: "max-tokens",
  stop: "stop",
  trace_top: "trace-top",
  prompt: "prompt",
  messages: "prompt",
  n: "samples",
  structured_outputs: "constraint-text",
  "structured_outputs.json": "constraint-text",
  "structured_outputs.regex": "constraint-text",
  "structured_outputs.choice": "constraint-text",
  "structured_outputs.json_object": "constraint-kind",
  structured_output_prefix_ids: "constraint-kind",
};

function showError(error) {
  document.querySelectorAll("[aria-invalid=true]").forEach((node) => node.removeAttribute("aria-invalid"));
  const status = error.status ? `HTTP ${error.status}` : error.status === null ? "Error during generation" : "Error";
  $("error-title").textContent = error.type ? `${status} · ${error.type}` : status;
  $("error-message").textContent = error.message;
  const details = [];
  if (error.param) details.push(`param: ${error.param}`);
  if (error.code) details.push(`code: ${error.code}`);
  $("error-detail").textContent = details.join(" · ");
  $("error").hidden = false;
  const input = error.param && $(PARAM_INPUTS[error.param] || "");
  if (input) input.setAttribute("aria-invalid", "true");
}

function clearError() {
  $("error").hidden = true;
  document.querySelectorAll("[aria-invalid=true]").forEach((node) => node.removeAttribute("aria-invalid"));
}

/** A mistake the page catches itself, shown exactly like the server's 400s (same box, same field marking). */
function inputError(param, message) {
  return new ApiError(400, { message, type: "invalid_request_error", param });
}

/* ---------------------------------------------------------------- model of the tree */

function branchById(id) {
  return state.branches.find((b) => b.id === id) || null;
}

function currentBranch() {
  return branchById(state.currentId);
}

function pathOf(branch) {
  return branch.prefix.concat(branch.tokens);
}

/** Sum of log p_raw of the path's tokens: how likely the model found the whole path. */
function cumulativeLogprob(path) {
  return path.reduce((sum, token) => sum + (token.logprob ?? 0), 0);
}

function childrenOf(branch) {
  return state.branches.filter((b) => b.parentId === (branch ? branch.id : null));
}

function depthOf(branch) {
  let depth = 0;
  for (let b = branch; b.parentId !== null; b = branchById(b.parentId)) depth += 1;
  return depth;
}

/**
 * The branch an alternative at path step `step` of `branch` belongs under. A step before the branch's own
 * tokens belongs to an ancestor; so does the branch's first token, because picking another token there
 * (forced or sampled) is choosing differently at the *parent's* step: the new path is a sibling, not a child.
 */
function ownerOfStep(branch, step) {
  let owner = branch;
  while (owner.parentId !== null && step <= owner.prefix.length) {
    owner = branchById(owner.parentId);
  }
  return owner;
}

function isForcedStart(branch) {
  return branch.tokens.length > 0 && branch.tokens[0].isForced;
}

/** Depth-first order, children right under their parent sorted by where they fork; collapsed subtrees hidden. */
function visibleBranches() {
  const rows = [];
  const visit = (branch) => {
    rows.push(branch);
    if (branch.isCollapsed) return;
    childrenOf(branch)
      .sort((a, b) => a.forkStep - b.forkStep || a.id - b.id)
      .forEach(visit);
  };
  childrenOf(null).forEach(visit);
  return rows;
}

function countDescendants(branch) {
  return childrenOf(branch).reduce((n, child) => n + 1 + countDescendants(child), 0);
}

function chosenText(trace) {
  const chosen = trace.candidates.find((c) => c.token_id === trace.chosen_token_id);
  return chosen ? chosen.text : null;
}

function isEos(tokenId) {
  return Boolean(state.info && state.info.eos_token_ids.includes(tokenId));
}

/** Settings of a path in a few characters, for the tree: only what differs from the defaults, plus T and seed. */
function settingsText(params) {
  const parts = [`T ${params.temperature ?? 1}`];
  parts.push(`seed ${params.seed}`);
  if (params.top_k) parts.push(`top-k ${params.top_k}`);
  if (params.top_p !== undefined && params.top_p < 1) parts.push(`top-p ${params.top_p}`);
  if (params.min_p) parts.push(`min-p ${params.min_p}`);
  if (params.repetition_penalty !== undefined && params.repetition_penalty !== 1)
    parts.push(`rep ${params.repetition_penalty}`);
  if (params.structured_outputs) parts.push(constraintText(params.structured_outputs));
  if (params.n) parts.push(`sample ${params.choiceIndex + 1} of ${params.n}`);
  return parts.join(" · ");
}

/* ---------------------------------------------------------------- prompt → tokens */

let tokenizeSerial = 0;
let tokenizeTimer = null;

function promptRequest() {
  const text = $("prompt").value;
  if (!$("chat-template").checked) return { prompt: text };
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push({ role: "user", content: text });
  return { messages, add_generation_prompt: true };
}

/** Tokenize the prompt as the model will see it; returns the ids (a newer call makes older ones stale). */
async function tokenizePrompt() {
  const serial = ++tokenizeSerial;
  const request = promptRequest();
  const body = await apiJson("/tokenize", request);
  if (serial !== tokenizeSerial) return null;
  state.promptIds = body.tokens;
  state.promptStrs = body.token_strs || body.tokens.map(String);
  state.promptRequest = request;
  $("prompt-count").textContent =
    `${plural(body.count, "token")} (the model's context holds ${plural(body.max_model_len, "token")}).`;
  renderPromptTokens();
  return body.tokens;
}

function scheduleTokenize() {
  clearTimeout(tokenizeTimer);
  tokenizeTimer = setTimeout(() => tokenizePrompt().catch(showError), 250);
}

function renderPromptTokens() {
  const box = $("prompt-tokens");
  box.replaceChildren(
    ...state.promptIds.map((id, i) =>
      el(
        "span",
        {
          class: "prompt-token",
          "data-testid": "prompt-token",
          "data-token-id": id,
          title: `token ${i + 1}: id ${id}`,
        },
        [
          el("span", { class: "tok-text", text: visibleText(state.promptStrs[i]) }),
          el("span", { class: "tok-id", text: id }),
        ],
      ),
    ),
  );
}

/* ---------------------------------------------------------------- settings */

function numberInput(id, parse = Number) {
  const raw = $(id).value.trim();
  return raw === "" ? null : parse(raw);
}

/** The generation settings; throws an input error for a value the page can reject before the server sees it. */
function readParams() {
  const maxTokens = numberInput("max-tokens");
  if (maxTokens === null || !Number.isInteger(maxTokens) || maxTokens < 1) {
    throw inputError(
      "max_tokens",
      `max tokens must be a whole number of at least 1 (got ${$("max-tokens").value || "nothing"})`,
    );
  }
  const stop = $("stop")
    .value.split("\n")
    .filter((s) => s !== "");
  const params = {
    temperature: numberInput("temperature"),
    top_k: numberInput("top-k", (s) => parseInt(s, 10)),
    top_p: numberInput("top-p"),
    min_p: numberInput("min-p"),
    repetition_penalty: numberInput("repetition-penalty"),
    max_tokens: maxTokens,
    trace_top: numberInput("trace-top", (s) => parseInt(s, 10)),
    // An empty seed field means "random": the page draws the seed itself and records it, so every path can
    // be replayed exactly (export/import) and the tree can say which seed each path used.
    seed: numberInput("seed", (s) => parseInt(s, 10)) ?? Math.floor(Math.random() * 2 ** 31),
  };
  if (stop.length) params.stop = stop;
  const constraint = readConstraint();
  if (constraint) params.structured_outputs = constraint;
  // An empty field means "the server's default": leave it out rather than send null.
  return Object.fromEntries(Object.entries(params).filter(([, value]) => value !== null && !Number.isNaN(value)));
}

/** The sampling fields of a branch's params as the API takes them (the page's own bookkeeping left out). */
function apiSampling(params) {
  const { choiceIndex, group, ...fields } = params;
  return fields;
}

/* ---------------------------------------------------------------- generation */

function newBranch(parent, forkStep, prefix, forced, params) {
  const branch = {
    id: state.nextBranchNumber++,
    parentId: parent ? parent.id : null,
    forkStep,
    prefix,
    tokens: forced ? [forced] : [],
    status: "streaming",
    finishReason: null,
    // The API's stop_reason: the stop string matched, the stop token id, or null (end of sequence).
    stopReason: null,
    metrics: null,
    usage: null,
    params,
    isCollapsed: false,
    controller: new AbortController(),
    startedAt: performance.now(),
    tokenTimes: [],
  };
  state.branches.push(branch);
  return branch;
}

/** Turn one stream chunk's choice into tokens: ids from `token_ids`, text and "why" from `trace`. */
function tokensOfChoice(choice) {
  const traces = choice.trace || [];
  const ids = choice.token_ids || traces.map((t) => t.chosen_token_id);
  const logprobs = choice.logprobs || null;
  return ids.map((id, j) => {
    const trace = traces[j] || null;
    const lpText = logprobs && logprobs.tokens ? logprobs.tokens[j] : null;
    const lp = logprobs && logprobs.token_logprobs ? logprobs.token_logprobs[j] : null;
    return {
      id,
      text: (trace && chosenText(trace)) ?? lpText ?? "",
      trace,
      logprob: trace ? Math.log(trace.chosen_prob_raw) : lp,
      isForced: false,
    };
  });
}

function promptIdsOf(branch) {
  return state.treePromptIds.concat(pathOf(branch).map((t) => t.id));
}

/** Tokens this branch may still generate: a path is never longer than a fresh generation's max tokens. */
function remainingTokens(branch) {
  return (branch.params.max_tokens ?? 16) - pathOf(branch).length;
}

/**
 * A branch that needs no request: forced onto an end-of-sequence token (the engine would stop there, so the
 * page stops too rather than let the model write past the end), or already at max tokens.
 */
function finishWithoutRequest(branch) {
  const last = branch.tokens[branch.tokens.length - 1];
  if (last && last.isForced && isEos(last.id)) return "stop";
  if (remainingTokens(branch) <= 0) return "length";
  return null;
}

function completionBody(branch, extra = {}) {
  const body = {
    prompt: promptIdsOf(branch),
    stream: true,
    stream_options: { include_usage: true },
    trace: true,
    trace_stages: true,
    logprobs: 5,
    ...apiSampling(branch.params),
    ...constraintFields(branch, pathOf(branch).length),
    max_tokens: remainingTokens(branch),
    ...extra,
  };
  if (state.modelName) body.model = state.modelName;
  return body;
}

/** Apply one stream chunk to the branches it feeds (`byIndex` maps a choice index to its branch). */
function applyChunk(chunk, byIndex) {
  // The server reports a failure after the stream started as one {"error": ...} event.
  if (chunk.error) throw new ApiError(null, chunk.error);
  const now = performance.now();
  for (const choice of chunk.choices || []) {
    const branch = byIndex(choice.index || 0);
    if (!branch) continue;
    const tokens = tokensOfChoice(choice);
    tokens.forEach(() => branch.tokenTimes.push(now));
    branch.tokens.push(...tokens);
    if (choice.finish_reason) {
      branch.finishReason = choice.finish_reason;
      branch.stopReason = choice.stop_reason ?? null;
    }
    if (choice.metrics) branch.metrics = choice.metrics;
    if (state.isFollowing && state.currentId === branch.id) state.selectedStep = pathOf(branch).length - 1;
  }
  // Request-level metrics belong to the one choice the chunk carries (an n-sample stream sends one per choice).
  const choices = chunk.choices || [];
  const owner = byIndex(choices.length === 1 ? choices[0].index || 0 : 0);
  if (chunk.metrics && owner) owner.metrics = chunk.metrics;
  if (chunk.usage && owner) owner.usage = chunk.usage;
}

/** Run one request feeding `branches` (one branch, or the n choices of one node); returns when it ends. */
async function runRequest(branches, body) {
  const controller = new AbortController();
  branches.forEach((b) => {
    b.controller = controller;
  });
  startEnginePolling();
  try {
    const response = await api("/v1/completions", body, controller.signal);
    for await (const chunk of sseEvents(response)) {
      if (chunk.id) labelRequest(chunk.id, branches);
      applyChunk(chunk, (index) => branches[index] || null);
      scheduleRender();
    }
    branches.forEach((b) => {
      b.status = "done";
    });
  } catch (error) {
    if (error.name === "AbortError") {
      branches.forEach((b) => {
        b.status = "stopped";
      });
    } else {
      branches.forEach((b) => failBranch(b, error));
      showError(error);
    }
  } finally {
    updateBusy();
    pollEngineUntilIdle();
    scheduleRender();
  }
}

/** A failed request leaves no empty row: a branch that got no token of its own is removed. */
function failBranch(branch, error) {
  branch.status = "error";
  branch.error = error.message;
  const generated = branch.tokens.filter((t) => !t.isForced).length;
  if (generated > 0) return;
  state.branches = state.branches.filter((b) => b !== branch);
  state.compareIds.delete(branch.id);
  if (state.currentId === branch.id) {
    const parent = branch.parentId === null ? null : branchById(branch.parentId);
    selectBranch(parent ? parent.id : null, parent ? Math.min(branch.forkStep, pathOf(parent).length - 1) : null);
  }
}

async function runBranch(branch) {
  const reason = finishWithoutRequest(branch);
  if (reason) {
    branch.status = "done";
    branch.finishReason = reason;
    updateBusy();
    scheduleRender();
    return;
  }
  await runRequest([branch], completionBody(branch));
}

function isBusy() {
  return state.isStarting || state.branches.some((b) => b.status === "streaming");
}

function updateBusy() {
  const busy = isBusy();
  $("stop-generation").disabled = !state.branches.some((b) => b.status === "streaming");
  // aria-disabled rather than disabled: a disabled button drops the keyboard focus of whoever pressed it.
  $("generate").setAttribute("aria-disabled", String(busy));
  $("step-once").setAttribute("aria-disabled", String(busy));
  document.body.classList.toggle("busy", busy);
}

function samePrompt(ids) {
  return (
    state.treePromptIds !== null &&
    ids.length === state.treePromptIds.length &&
    ids.every((id, i) => id === state.treePromptIds[i])
  );
}

/**
 * Tokenize, and settle which tree the next request belongs to. Returns false when the user must first say
 * what happens to a tree built from another prompt (it is never thrown away silently).
 */
async function preparePrompt(onConfirmed) {
  const ids = await tokenizePrompt();
  if (ids === null) return false;
  if (!samePrompt(ids) && state.branches.length) {
    askNewTree(onConfirmed);
    return false;
  }
  if (!samePrompt(ids)) startTree(ids);
  return true;
}

function startTree(ids) {
  resetTree();
  state.treePromptIds = ids;
  state.treePromptRequest = state.promptRequest;
  state.treePromptText = {
    prompt: $("prompt").value,
    system: $("system-prompt").value,
    chat: $("chat-template").checked,
  };
}

async function generate() {
  if (isBusy()) return;
  clearError();
  clearTimeout(tokenizeTimer);
  let params;
  state.isStarting = true;
  updateBusy();
  try {
    params = readParams();
    if (!(await preparePrompt(generate))) return;
  } catch (error) {
    showError(error);
    return;
  } finally {
    state.isStarting = false;
    updateBusy();
  }
  const branch = newBranch(null, 0, [], null, params);
  selectBranch(branch.id, null);
  state.isFollowing = true;
  updateBusy();
  scheduleRender();
  await runBranch(branch);
}

/* ---------------------------------------------------------------- the new-tree question */

let pendingNewTree = null;

function askNewTree(onConfirmed) {
  pendingNewTree = onConfirmed;
  $("confirm-new-tree-text").textContent =
    `The prompt changed. Generating from it starts a new tree and discards ` +
    `the current ${plural(state.branches.length, "path")}.`;
  $("confirm-new-tree").hidden = false;
  $("confirm-discard").focus();
}

function answerNewTree(answer) {
  $("confirm-new-tree").hidden = true;
  const next = pendingNewTree;
  pendingNewTree = null;
  if (answer === "export") exportTree();
  if (answer === "keep") {
    restorePromptInputs(state.treePromptText);
    return;
  }
  startTree(state.promptIds);
  scheduleRender();
  if (next) next();
}

function restorePromptInputs(text) {
  if (!text) return;
  $("prompt").value = text.prompt;
  $("system-prompt").value = text.system;
  $("chat-template").checked = text.chat;
  $("system-row").hidden = !text.chat;
  scheduleTokenize();
}

/* ---------------------------------------------------------------- branching */

function forcedToken(trace, candidate) {
  return {
    id: candidate.token_id,
    text: candidate.text,
    // The distribution is the one the model had at this step; only the choice is the user's.
    trace: trace
      ? {
          ...trace,
          // A token looked up outside the recorded candidates joins them, with its real rank and raw probability.
          candidates: trace.candidates.some((c) => c.token_id === candidate.token_id)
            ? trace.candidates
            : trace.candidates.concat([candidate]),
          chosen_token_id: candidate.token_id,
          chosen_rank: candidate.rank,
          chosen_prob_raw: candidate.prob_raw,
          chosen_prob_final: candidate.prob_final,
          method: "forced",
          extra: {},
        }
      : null,
    logprob: candidate.prob_raw > 0 ? Math.log(candidate.prob_raw) : null,
    isForced: true,
  };
}

/** Generate from `step` of the current path with `candidate` instead of the token the model picked. */
function branchFrom(step, candidate) {
  if (isBusy()) return;
  let params;
  try {
    params = readParams();
  } catch (error) {
    showError(error);
    return;
  }
  const current = currentBranch();
  const path = pathOf(current);
  const owner = ownerOfStep(current, step);
  const ownerPath = pathOf(owner);
  state.focusAfterRender = `token-${step}`;
  state.isFollowing = false;
  // The parent's own token at this step: going "back" to it is selecting the parent, not a duplicate path.
  if (ownerPath[step] && ownerPath[step].id === candidate.token_id) {
    selectBranch(owner.id, step);
    scheduleRender();
    return;
  }
  const existing = state.branches.find(
    (b) => b.parentId === owner.id && b.forkStep === step && b.tokens.length && b.tokens[0].id === candidate.token_id,
  );
  if (existing) {
    selectBranch(existing.id, step);
    scheduleRender();
    return;
  }
  clearError();
  const branch = newBranch(owner, step, path.slice(0, step), forcedToken(path[step].trace, candidate), params);
  selectBranch(branch.id, step);
  updateBusy();
  scheduleRender();
  runBranch(branch);
}

/** "N samples from here": one request with n choices continuing after `step`, each choice a sibling path. */
async function samplesFrom(step) {
  if (isBusy()) return;
  let params;
  try {
    params = readParams();
  } catch (error) {
    showError(error);
    return;
  }
  const n = numberInput("samples", (s) => parseInt(s, 10));
  if (!Number.isInteger(n) || n < 2 || n > 8) {
    showError(inputError("n", "samples must be a whole number from 2 to 8"));
    return;
  }
  const current = currentBranch();
  const prefix = current ? pathOf(current).slice(0, step + 1) : [];
  const owner = current ? ownerOfStep(current, step + 1) : null;
  const group = state.nextBranchNumber;
  const branches = Array.from({ length: n }, (_, i) =>
    newBranch(owner, prefix.length, prefix, null, { ...params, n, choiceIndex: i, group }),
  );
  selectBranch(branches[0].id, null);
  state.isFollowing = true;
  updateBusy();
  scheduleRender();
  await runRequest(branches, completionBody(branches[0], { n }));
}

function stopAll() {
  state.branches.filter((b) => b.status === "streaming").forEach((b) => b.controller.abort());
}

function resetTree() {
  stopAll();
  state.branches = [];
  state.currentId = null;
  state.selectedStep = null;
  state.compareIds.clear();
  state.treePromptIds = null;
  state.popoverStep = null;
  state.importReport = null;
}

function selectBranch(id, step) {
  if (id !== state.currentId) state.popoverStep = null;
  state.currentId = id;
  state.selectedStep = step;
}

function selectStep(step) {
  state.selectedStep = step;
  state.isFollowing = false;
  scheduleRender();
}

/* ---------------------------------------------------------------- engine stats */

let enginePoll = null;
let idlePollsLeft = 0;

async function refreshEngine() {
  try {
    state.engine = await apiJson("/v1/engine");
    state.engineError = null;
    await refreshPasses();
  } catch (error) {
    state.engineError = error.message;
  }
  const idle = state.engine && state.engine.num_running === 0 && state.engine.num_waiting === 0;
  if (!isBusy() && (idle || --idlePollsLeft <= 0) && enginePoll !== null) {
    clearInterval(enginePoll);
    enginePoll = null;
  }
  scheduleRender();
}

function startEnginePolling() {
  if (enginePoll === null) enginePoll = setInterval(refreshEngine, 300);
}

/**
 * After a request ends (Stop included), keep polling until the engine reports nothing running: the server
 * frees an aborted request's blocks a moment after the connection closes, so one read right away is stale.
 */
function pollEngineUntilIdle() {
  idlePollsLeft = 30;
  startEnginePolling();
  refreshEngine();
}

/* ---------------------------------------------------------------- rendering */

let renderQueued = false;

function scheduleRender() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    render();
  });
}

/**
 * Rebuild a panel, then give focus back to the element with the same data-focus-key, if it had it, and what the
 * user had typed to its text and number inputs: a rebuild for data that arrived meanwhile (a step's inspection)
 * must not wipe a token id typed but not yet sent.
 */
function withFocusKept(container, build) {
  const active = document.activeElement;
  const key = active && container.contains(active) ? active.dataset.focusKey : null;
  const typed = [...container.querySelectorAll("input[data-focus-key]")]
    .filter((input) => (input.type === "text" || input.type === "number") && input.value !== "")
    .map((input) => [input.dataset.focusKey, input.value]);
  build();
  for (const [typedKey, value] of typed) {
    const again = container.querySelector(`input[data-focus-key="${CSS.escape(typedKey)}"]`);
    if (again && again.value === "") again.value = value;
  }
  if (key) {
    const again = container.querySelector(`[data-focus-key="${CSS.escape(key)}"]`);
    if (again) again.focus();
  }
}

function render() {
  renderPath();
  renderSparklines();
  renderPopover();
  renderWhy();
  renderInside();
  renderTree();
  renderCompare();
  renderBeams();
  renderEngine();
  renderCost();
  applyPendingFocus();
  updateBusy();
}

function applyPendingFocus() {
  if (!state.focusAfterRender) return;
  const target = document.querySelector(`[data-focus-key="${CSS.escape(state.focusAfterRender)}"]`);
  state.focusAfterRender = null;
  if (target) target.focus();
}

function tokenProb(token) {
  if (token.trace) return token.trace.chosen_prob_raw;
  return token.logprob !== null && token.logprob !== undefined ? Math.exp(token.logprob) : null;
}

function renderPath() {
  const branch = currentBranch();
  const box = $("tokens");
  const info = $("path-info");
  if (!branch) {
    box.replaceChildren();
    info.replaceChildren();
    $("timing").replaceChildren();
    return;
  }
  const path = pathOf(branch);
  const parent = branch.parentId === null ? null : branchById(branch.parentId);
  const origin = !parent
    ? " from the prompt"
    : isForcedStart(branch)
      ? ` forked from path ${parent.id} at step ${branch.forkStep + 1} with “${visibleText(branch.tokens[0].text)}”`
      : ` ${branch.kind === "step" ? "stepped" : "sampled"} from path ${parent.id} after token ${branch.forkStep}`;
  setChildren(
    info,
    el("span", { class: "badge", text: `path ${branch.id}` }),
    origin,
    el("span", { class: "sep", text: " · " }),
    `${plural(path.length, "token")} · Σ log p = `,
    el("strong", { "data-testid": "path-logprob", text: cumulativeLogprob(path).toFixed(2) }),
    el("span", { class: "sep", text: " · " }),
    el("span", {
      class: `status status-${branch.status}`,
      "data-testid": "path-status",
      "data-stop-kind": stopKind(branch) || "",
      text: statusText(branch),
    }),
    path.some((t) => t.trace && t.trace.extra && t.trace.extra.speculative)
      ? el("span", {
          class: "spec-legend",
          "data-testid": "spec-legend",
          text: " · drafts: ✓ solid underline = accepted, ✗ dotted underline = rejected and replaced",
        })
      : null,
  );
  const selected = state.selectedStep;
  const focusStep = selected ?? path.length - 1;
  const trimmed = trimmedSteps(branch);
  withFocusKept(box, () => {
    box.replaceChildren(
      ...path.map((token, step) => tokenChip(branch, token, step, selected, focusStep, trimmed.has(step))).flat(),
    );
  });
  renderTiming(branch);
  announcePath(branch, path);
}

/** The selected path's text for screen readers, once it is complete (not a word at a time while it streams). */
function announcePath(branch, path) {
  const text = branch.status === "streaming" ? "generating…" : `${path.map((t) => t.text).join("")} (${statusText(branch)})`;
  if ($("path-text").textContent !== text) $("path-text").textContent = text;
}

function tokenChip(branch, token, step, selected, focusStep, isTrimmed) {
  const p = tokenProb(token);
  const isOwn = step >= branch.prefix.length;
  const speculative = token.trace && token.trace.extra && token.trace.extra.speculative;
  const classes = ["token"];
  if (step === selected) classes.push("selected");
  if (token.isForced && isOwn) classes.push("forced");
  if (!isOwn) classes.push("inherited");
  if (isTrimmed) classes.push("trimmed");
  // A bonus token (after every draft was accepted) was never drafted: it gets no draft mark.
  if (speculative && speculative.draft_token_id !== null)
    classes.push(speculative.accepted ? "draft-accepted" : "draft-replaced");
  const chip = el(
    "button",
    {
      type: "button",
      class: classes.join(" "),
      "data-testid": "token",
      "data-step": step,
      "data-token-id": token.id,
      "data-prob": p ?? "",
      "data-focus-key": `token-${step}`,
      tabindex: step === focusStep ? 0 : -1,
      "aria-pressed": step === selected ? "true" : "false",
      "aria-label":
        `token ${step + 1}: “${token.text}”, probability ${fmtProb(p)}` +
        `${token.isForced ? ", forced by a branch" : ""}${isTrimmed ? ", part of the stop string, trimmed from the text" : ""}`,
      style: p === null ? "" : `background:${probColor(p)};color:${probInk(p)}`,
      title: `token ${step + 1} · id ${token.id} · p ${fmtProb(p)}${isTrimmed ? " · stop string: trimmed from the text" : ""}`,
      onclick: () => {
        state.popoverStep = state.popoverStep === step ? null : step;
        selectStep(step);
      },
    },
    token.text.includes("\n") ? visibleText(token.text) : token.text || "∅",
  );
  return token.text.includes("\n") ? [chip, el("br")] : [chip];
}

/** Why a finished path ended: "length", "eos", "stop-string", "stop-token", or its finish reason as is. */
function stopKind(branch) {
  if (branch.status !== "done") return null;
  if (branch.finishReason !== "stop") return branch.finishReason;
  if (typeof branch.stopReason === "string") return "stop-string";
  if (typeof branch.stopReason === "number") return "stop-token";
  return "eos";
}

const STOP_TEXTS = {
  length: () => "finished: length (max tokens reached)",
  eos: () => "finished: stop (end-of-sequence token)",
  "stop-string": (b) => `finished: stop (stop string “${visibleText(b.stopReason)}”, trimmed from the text)`,
  "stop-token": (b) => `finished: stop (stop token id ${b.stopReason})`,
  step: (b) =>
    `slow motion: ${b.playback ? `${b.playback.next} of ${plural(b.playback.tokens.length, "token")}` : "stepped"} shown`,
};

/**
 * The path's steps that hold its matched stop string (the API trims it from the text; the tokens stay): the
 * shortest run of last tokens whose text contains it.
 */
function trimmedSteps(branch) {
  if (stopKind(branch) !== "stop-string") return new Set();
  const path = pathOf(branch);
  let text = "";
  for (let step = path.length - 1; step >= branch.prefix.length; step -= 1) {
    text = path[step].text + text;
    if (text.includes(branch.stopReason)) return new Set(path.map((_, i) => i).filter((i) => i >= step));
  }
  return new Set();
}

function statusText(branch) {
  if (branch.status === "streaming") return "generating…";
  if (branch.status === "done") {
    const describe = STOP_TEXTS[stopKind(branch)];
    return describe ? describe(branch) : `finished: ${branch.finishReason || "?"}`;
  }
  if (branch.status === "stopped") return "stopped";
  return `error: ${branch.error}`;
}

/**
 * Prefill time per prompt token the request computed (not the cached ones). Time to first token covers the prompt's
 * passes and the first token's sampling: one large matrix product over all prompt tokens.
 */
function prefillPerToken(m) {
  const computed = (m.num_prompt_tokens ?? 0) - (m.num_cached_tokens ?? 0);
  if (!m.time_to_first_token || computed < 1) return null;
  return m.time_to_first_token / computed;
}

function perTokenRatio(prefill, decode) {
  return prefill <= decode
    ? `${(decode / prefill).toFixed(1)}× cheaper per token`
    : `${(prefill / decode).toFixed(1)}× dearer per token`;
}

/** Whether the branch's request ran the engine's first forward pass: its timings include the warm-up. */
function isFirstRequest(branch) {
  const rows = passRowsOf(branch);
  return rows.length > 0 && rows[0].pass === 1;
}

function generatedCount(branch) {
  return branch.tokens.filter((t) => !t.isForced).length;
}

function renderTiming(branch) {
  const m = branch.metrics;
  const facts = [];
  if (m) {
    const isWarmup = isFirstRequest(branch);
    facts.push([
      "prefill (time to first token)",
      `${fmtMs(m.time_to_first_token)}${isWarmup ? " (warm-up)" : ""}`,
      "ttft",
    ]);
    facts.push(["decode, per token", fmtMs(m.time_per_output_token), "tpot"]);
    const perPrompt = prefillPerToken(m);
    if (perPrompt !== null) {
      facts.push([
        "per token: prompt (prefill) vs generated (decode)",
        `${fmtMs(perPrompt)} per prompt token computed vs ${fmtMs(m.time_per_output_token)} per decode token` +
          (m.time_per_output_token ? `: prefill is ${perTokenRatio(perPrompt, m.time_per_output_token)}` : ""),
        "prefill-vs-decode",
      ]);
    }
    if (isWarmup) {
      facts.push([
        "warm-up",
        "this was the engine's first request since the server started: its prefill includes one-time setup; " +
          "generate again for a typical figure",
        "warmup",
      ]);
    }
    facts.push(["generated", plural(m.num_generated_tokens ?? generatedCount(branch), "token"), "num-generated"]);
    facts.push([
      "prompt (of it cached)",
      `${plural(m.num_prompt_tokens ?? 0, "token")} (${m.num_cached_tokens ?? 0})`,
      "num-prompt",
    ]);
  } else {
    const times = branch.tokenTimes;
    const ttft = times.length ? (times[0] - branch.startedAt) / 1000 : null;
    const tpot = times.length > 1 ? (times[times.length - 1] - times[0]) / 1000 / (times.length - 1) : null;
    facts.push(["prefill (time to first token, measured here)", fmtMs(ttft), "ttft"]);
    facts.push(["decode, per token (measured here)", fmtMs(tpot), "tpot"]);
    facts.push(["generated", plural(generatedCount(branch), "token"), "num-generated"]);
  }
  $("timing").replaceChildren(...factList(facts).childNodes);
}

/* ---------------------------------------------------------------- wiring */

function onTokensKeydown(event) {
  const chips = [...$("tokens").querySelectorAll("[data-testid=token]")];
  const index = chips.indexOf(document.activeElement);
  if (index < 0) return;
  if (event.key === "Escape") {
    state.popoverStep = null;
    scheduleRender();
    return;
  }
  const moves = {
    ArrowRight: index + 1,
    ArrowDown: index + 1,
    ArrowLeft: index - 1,
    ArrowUp: index - 1,
    Home: 0,
    End: chips.length - 1,
  };
  if (!(event.key in moves)) return;
  event.preventDefault();
  const target = chips[Math.max(0, Math.min(chips.length - 1, moves[event.key]))];
  chips.forEach((chip) => chip.setAttribute("tabindex", chip === target ? "0" : "-1"));
  target.focus();
}

async function loadModelName() {
  try {
    const body = await apiJson("/v1/models");
    state.modelName = body.data && body.data.length ? body.data[0].id : null;
    state.info = await apiJson("/v1/visualizer/info");
    $("model-name").textContent = state.modelName || "unknown";
    $("server-status").textContent = "ready";
    $("server-status").className = "status status-done";
  } catch (error) {
    $("server-status").textContent = "offline";
    $("server-status").className = "status status-error";
    showError(error);
  }
}

function init() {
  $("controls").addEventListener("submit", (event) => {
    event.preventDefault();
    generate();
  });
  $("stop-generation").addEventListener("click", stopAll);
  $("clear-tree").addEventListener("click", () => {
    resetTree();
    scheduleRender();
  });
  $("error-close").addEventListener("click", clearError);
  $("confirm-discard").addEventListener("click", () => answerNewTree("discard"));
  $("confirm-export").addEventListener("click", () => answerNewTree("export"));
  $("confirm-keep").addEventListener("click", () => answerNewTree("keep"));
  $("export-tree").addEventListener("click", exportTree);
  $("import-tree").addEventListener("change", (event) => importTreeFile(event.target.files[0]));
  $("api-key").addEventListener("change", () => {
    clearError();
    loadModelName().then(() => tokenizePrompt().catch(showError));
  });
  $("prompt").addEventListener("input", scheduleTokenize);
  $("system-prompt").addEventListener("input", scheduleTokenize);
  $("chat-template").addEventListener("change", () => {
    $("system-row").hidden = !$("chat-template").checked;
    scheduleTokenize();
  });
  $("samples").addEventListener("input", scheduleRender);
  $("tokens").addEventListener("keydown", onTokensKeydown);
  // The candidates box closes on a click anywhere but a token or the box itself, like any popover.
  document.addEventListener("click", (event) => {
    if (state.popoverStep === null || event.target.closest("#popover, [data-testid=token]")) return;
    state.popoverStep = null;
    scheduleRender();
  });
  $("why").addEventListener("focusin", () => {
    state.isFollowing = false;
  });
  loadModelName()
    .then(initTimeline)
    .then(() => Promise.all([tokenizePrompt().catch(showError), refreshEngine()]));
  render();
}

document.addEventListener("DOMContentLoaded", init);
