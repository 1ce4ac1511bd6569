"use strict";
/*
 * tokenriver visualizer: one page over the server's HTTP API. No build step, no library, nothing fetched
 * but the API of the server that served this file. format.js (helpers) loads first, stepper.js (slow motion) last.
 *
 * Data flow. POST /tokenize turns the prompt (or the chat-templated conversation) into token ids. Every
 * generation is a streamed POST /v1/completions whose prompt is those ids and which asks for a per-step
 * trace (`trace: true`): for each generated token, the top candidates with their logits and probabilities
 * before (prob_raw) and after (prob_final) sampling's processing, which stage removed which, and for a sampled
 * token the uniform it drew (extra.draw).
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
      const data = block.split(/\r?\n/)
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
  temperature: "temperature", top_k: "top-k", top_p: "top-p", min_p: "min-p",
  repetition_penalty: "repetition-penalty", seed: "seed", max_tokens: "max-tokens", stop: "stop",
  trace_top: "trace-top", prompt: "prompt", messages: "prompt", n: "samples",
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
    childrenOf(branch).sort((a, b) => a.forkStep - b.forkStep || a.id - b.id).forEach(visit);
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
  if (params.repetition_penalty !== undefined && params.repetition_penalty !== 1) parts.push(`rep ${params.repetition_penalty}`);
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
  $("prompt-count").textContent = `${plural(body.count, "token")} (the model's context holds ${plural(body.max_model_len, "token")}).`;
  renderPromptTokens();
  return body.tokens;
}

function scheduleTokenize() {
  clearTimeout(tokenizeTimer);
  tokenizeTimer = setTimeout(() => tokenizePrompt().catch(showError), 250);
}

function renderPromptTokens() {
  const box = $("prompt-tokens");
  box.replaceChildren(...state.promptIds.map((id, i) => el("span", {
    class: "prompt-token", "data-testid": "prompt-token", "data-token-id": id, title: `token ${i + 1}: id ${id}`,
  }, [el("span", { class: "tok-text", text: visibleText(state.promptStrs[i]) }), el("span", { class: "tok-id", text: id })])));
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
    throw inputError("max_tokens", `max tokens must be a whole number of at least 1 (got ${$("max-tokens").value || "nothing"})`);
  }
  const stop = $("stop").value.split("\n").filter((s) => s !== "");
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
    logprobs: 5,
    ...apiSampling(branch.params),
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
    if (choice.finish_reason) branch.finishReason = choice.finish_reason;
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
  branches.forEach((b) => { b.controller = controller; });
  startEnginePolling();
  try {
    const response = await api("/v1/completions", body, controller.signal);
    for await (const chunk of sseEvents(response)) {
      if (chunk.id) labelRequest(chunk.id, branches);
      applyChunk(chunk, (index) => branches[index] || null);
      scheduleRender();
    }
    branches.forEach((b) => { b.status = "done"; });
  } catch (error) {
    if (error.name === "AbortError") {
      branches.forEach((b) => { b.status = "stopped"; });
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
  $("generate").disabled = busy;
  $("step-once").disabled = busy;
  document.body.classList.toggle("busy", busy);
}

function samePrompt(ids) {
  return state.treePromptIds !== null && ids.length === state.treePromptIds.length
    && ids.every((id, i) => id === state.treePromptIds[i]);
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
  state.treePromptText = { prompt: $("prompt").value, system: $("system-prompt").value, chat: $("chat-template").checked };
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
  $("confirm-new-tree-text").textContent = `The prompt changed. Generating from it starts a new tree and discards `
    + `the current ${plural(state.branches.length, "path")}.`;
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
    trace: trace ? {
      ...trace,
      chosen_token_id: candidate.token_id,
      chosen_rank: candidate.rank,
      chosen_prob_raw: candidate.prob_raw,
      chosen_prob_final: candidate.prob_final,
      method: "forced",
      extra: {},
    } : null,
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
  const existing = state.branches.find((b) => b.parentId === owner.id && b.forkStep === step
    && b.tokens.length && b.tokens[0].id === candidate.token_id);
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
  const branches = Array.from({ length: n }, (_, i) => newBranch(owner, prefix.length, prefix, null,
    { ...params, n, choiceIndex: i, group }));
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

/** Rebuild a panel, then give focus back to the element with the same data-focus-key, if it had it. */
function withFocusKept(container, build) {
  const active = document.activeElement;
  const key = active && container.contains(active) ? active.dataset.focusKey : null;
  build();
  if (key) {
    const again = container.querySelector(`[data-focus-key="${CSS.escape(key)}"]`);
    if (again) again.focus();
  }
}

function render() {
  renderPath();
  renderPopover();
  renderWhy();
  renderTree();
  renderCompare();
  renderEngine();
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
  const origin = !parent ? " from the prompt"
    : isForcedStart(branch) ? ` forked from path ${parent.id} at step ${branch.forkStep + 1} with “${visibleText(branch.tokens[0].text)}”`
      : ` ${branch.kind === "step" ? "stepped" : "sampled"} from path ${parent.id} after token ${branch.forkStep}`;
  info.replaceChildren(
    el("span", { class: "badge", text: `path ${branch.id}` }), origin,
    el("span", { class: "sep", text: " · " }),
    `${plural(path.length, "token")} · Σ log p = `,
    el("strong", { "data-testid": "path-logprob", text: cumulativeLogprob(path).toFixed(2) }),
    el("span", { class: "sep", text: " · " }),
    el("span", { class: `status status-${branch.status}`, "data-testid": "path-status", text: statusText(branch) }),
  );
  const selected = state.selectedStep;
  const focusStep = selected ?? path.length - 1;
  withFocusKept(box, () => {
    box.replaceChildren(...path.map((token, step) => tokenChip(branch, token, step, selected, focusStep)).flat());
  });
  renderTiming(branch);
}

function tokenChip(branch, token, step, selected, focusStep) {
  const p = tokenProb(token);
  const isOwn = step >= branch.prefix.length;
  const speculative = token.trace && token.trace.extra && token.trace.extra.speculative;
  const classes = ["token"];
  if (step === selected) classes.push("selected");
  if (token.isForced && isOwn) classes.push("forced");
  if (!isOwn) classes.push("inherited");
  // A bonus token (after every draft was accepted) was never drafted: it gets no draft mark.
  if (speculative && speculative.draft_token_id !== null) classes.push(speculative.accepted ? "draft-accepted" : "draft-replaced");
  const chip = el("button", {
    type: "button", class: classes.join(" "), "data-testid": "token", "data-step": step,
    "data-token-id": token.id, "data-prob": p ?? "", "data-focus-key": `token-${step}`,
    tabindex: step === focusStep ? 0 : -1, "aria-pressed": step === selected ? "true" : "false",
    "aria-label": `token ${step + 1}: “${token.text}”, probability ${fmtProb(p)}${token.isForced ? ", forced by a branch" : ""}`,
    style: p === null ? "" : `background:${probColor(p)};color:${probInk(p)}`,
    title: `token ${step + 1} · id ${token.id} · p ${fmtProb(p)}`,
    onclick: () => {
      state.popoverStep = state.popoverStep === step ? null : step;
      selectStep(step);
    },
  }, token.text.includes("\n") ? visibleText(token.text) : (token.text || "∅"));
  return token.text.includes("\n") ? [chip, el("br")] : [chip];
}

function statusText(branch) {
  if (branch.status === "streaming") return "generating…";
  if (branch.status === "done") return `finished: ${branch.finishReason || "?"}`;
  if (branch.status === "stopped") return "stopped";
  return `error: ${branch.error}`;
}

function generatedCount(branch) {
  return branch.tokens.filter((t) => !t.isForced).length;
}

function renderTiming(branch) {
  const m = branch.metrics;
  const facts = [];
  if (m) {
    facts.push(["prefill (time to first token)", fmtMs(m.time_to_first_token), "ttft"]);
    facts.push(["decode, per token", fmtMs(m.time_per_output_token), "tpot"]);
    facts.push(["generated", plural(m.num_generated_tokens ?? generatedCount(branch), "token"), "num-generated"]);
    facts.push(["prompt (of it cached)", `${plural(m.num_prompt_tokens ?? 0, "token")} (${m.num_cached_tokens ?? 0})`, "num-prompt"]);
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

/* ---------------------------------------------------------------- popover */

/** The top candidates of the clicked token, in a small box right under it (no trip down to the "why" panel). */
function renderPopover() {
  const box = $("popover");
  const branch = currentBranch();
  const path = branch ? pathOf(branch) : [];
  const step = state.popoverStep;
  const chip = step === null ? null : $("tokens").querySelector(`[data-step="${step}"]`);
  const trace = step !== null && path[step] ? path[step].trace : null;
  if (!chip || !trace) {
    box.hidden = true;
    return;
  }
  const final = finalDistribution(trace);
  const rows = trace.candidates.slice().sort((a, b) => a.rank - b.rank).slice(0, 5).map((c) => el("li", {
    class: c.token_id === trace.chosen_token_id ? "chosen" : "", "data-testid": "popover-candidate",
  }, [el("span", { class: "tok-text", text: visibleText(c.text) }),
    el("span", { class: "num", text: `${fmtPercent(c.prob_raw)} raw · ${fmtPercent(final.get(c.token_id) ?? 0)} final` })]));
  box.replaceChildren(
    el("p", { class: "popover-head", text: `token ${step + 1}: top ${plural(rows.length, "candidate")}` }),
    el("ol", {}, rows),
    el("button", { type: "button", class: "small", text: "close", "aria-label": "close the candidates box",
      onclick: () => { state.popoverStep = null; scheduleRender(); } }),
  );
  // Shown before measuring: a hidden element has no offsetParent to position against.
  box.hidden = false;
  const chipBox = chip.getBoundingClientRect();
  const parentBox = box.offsetParent ? box.offsetParent.getBoundingClientRect() : { left: 0, top: 0 };
  const maxLeft = box.offsetParent ? box.offsetParent.clientWidth - box.offsetWidth : chipBox.left;
  box.style.left = `${Math.max(0, Math.min(maxLeft, chipBox.left - parentBox.left))}px`;
  box.style.top = `${chipBox.bottom - parentBox.top + 4}px`;
}

/* ---------------------------------------------------------------- why this token */

/**
 * The distribution the token was actually drawn from, by token id. A greedy step takes the argmax: whatever
 * softmax the trace reports, the choice was one-hot, so it is shown as one-hot.
 */
function finalDistribution(trace) {
  const map = new Map();
  const greedy = trace.method === "greedy";
  for (const c of trace.candidates) {
    map.set(c.token_id, greedy ? (c.token_id === trace.chosen_token_id ? 1 : 0) : c.prob_final);
  }
  return map;
}

function keptText(trace) {
  if (trace.method === "greedy") return "1 (greedy takes the argmax)";
  return plural(trace.num_candidates_kept, "token");
}

function renderWhy() {
  const box = $("why");
  const branch = currentBranch();
  const path = branch ? pathOf(branch) : [];
  const step = state.selectedStep;
  if (!branch || step === null || step >= path.length) {
    box.replaceChildren(el("p", { class: "hint", text: "Generate, then select a token to see the distribution it was drawn from." }));
    return;
  }
  const token = path[step];
  const trace = token.trace;
  withFocusKept(box, () => {
    const nav = el("div", { class: "step-nav" }, [
      el("button", { type: "button", class: "small", "data-testid": "prev-step", "data-focus-key": "prev-step",
        disabled: step === 0, onclick: () => selectStep(step - 1), text: "← previous token" }),
      el("span", { "data-testid": "why-step", "data-step": step, text: `token ${step + 1} of ${path.length}` }),
      el("button", { type: "button", class: "small", "data-testid": "next-step", "data-focus-key": "next-step",
        disabled: step >= path.length - 1, onclick: () => selectStep(step + 1), text: "next token →" }),
      el("button", { type: "button", class: "small", "data-testid": "samples-from-here", "data-focus-key": "samples",
        disabled: isBusy(), onclick: () => samplesFrom(step),
        text: `${numberInput("samples") ?? "N"} samples from here`,
        title: "continue after this token N times at once: the requests share this prefix's KV blocks" }),
    ]);
    if (!trace) {
      box.replaceChildren(nav, el("p", { text: `“${token.text}” (id ${token.id}): no trace was recorded for this token.` }));
      return;
    }
    setChildren(box, nav, whySummary(token, trace, branch), speculativeNote(trace), drawNote(trace),
      whyBars(step, trace), whyFootnote(trace), forceTokenForm(step), previewPanel(branch, step));
  });
}

function whySummary(token, trace, branch) {
  const params = branch.params;
  const how = token.isForced ? "forced: you picked it to branch"
    : trace.method === "greedy" ? "greedy (T = 0): the argmax, no random draw"
      : `sampled at T = ${trace.temperature}`;
  return factList([
    ["chosen", `“${visibleText(token.text)}” (id ${token.id})`, "why-chosen"],
    ["rank", `${trace.chosen_rank}`, "why-rank"],
    ["p raw (model)", fmtProb(trace.chosen_prob_raw), "why-prob-raw"],
    ["p final (drawn from)", fmtProb(finalDistribution(trace).get(trace.chosen_token_id)), "why-prob-final"],
    ["entropy raw → final", `${trace.entropy_raw.toFixed(2)} → ${trace.method === "greedy" ? "0.00" : trace.entropy_final.toFixed(2)} nats`, "why-entropy"],
    ["tokens kept by the filters", keptText(trace), "why-kept"],
    ["how", how, "why-method"],
    ["path settings", settingsText(params), "why-settings"],
  ], "stats why-summary");
}

function speculativeNote(trace) {
  const spec = trace.extra && trace.extra.speculative;
  if (!spec) return null;
  const drafted = spec.draft_token_ids.length;
  const verdict = spec.draft_token_id === null ? "a bonus token: every draft before it was accepted, so the verifying pass adds one more"
    : spec.accepted ? `the draft proposed it and the target model accepted it (${spec.num_accepted} of ${plural(drafted, "draft")} accepted in this pass)`
      : `the draft proposed id ${spec.draft_token_id}; the target rejected it and put this token in its place`;
  return el("p", { class: "spec-note", "data-testid": "why-speculative" }, [
    el("strong", { text: "Speculative decoding: " }), verdict, ". ",
    el("span", { class: "hint", text: trace.method === "greedy"
      ? "Rule (greedy): a draft is accepted while it equals the target's argmax; the first mismatch is replaced by the argmax."
      : "Rule (sampled): a draft x is accepted with probability min(1, p_target(x) / p_draft(x)); a rejected one is replaced by a draw from the leftover distribution." }),
  ]);
}

/** Where the sampled token's uniform landed in the cumulative distribution (token-id order, as the sampler walks it). */
function drawNote(trace) {
  const draw = trace.extra && trace.extra.draw;
  if (!draw) return null;
  return el("p", { class: "hint", "data-testid": "why-draw" }, [
    `Random draw: u = ${draw.uniform.toFixed(4)} landed in this token's span [${draw.cdf_start.toFixed(4)}, `
      + `${draw.cdf_end.toFixed(4)}) of the cumulative final distribution (tokens in id order).`]);
}

function whyBars(step, trace) {
  const final = finalDistribution(trace);
  const candidates = trace.candidates.slice().sort((a, b) => a.rank - b.rank);
  const legend = el("div", { class: "bar-legend", "aria-hidden": "true" }, [
    el("span", { class: "key raw" }), "raw: softmax of the model's logits ",
    el("span", { class: "key final" }), trace.method === "greedy" ? "final: one-hot on the argmax " : "final: what was drawn from ",
  ]);
  const header = el("div", { class: "candidate header", "aria-hidden": "true" }, [
    el("span", { text: "rank" }), el("span", { text: "token" }), el("span", { text: "logit" }),
    el("span", { text: "probabilities" }), el("span", { text: "" })]);
  const rows = candidates.map((c) => candidateRow(step, trace, c, final.get(c.token_id) ?? 0));
  return el("div", { class: "bar-chart", "data-testid": "bars" }, [legend, header, ...rows]);
}

function barPair(kind, p, testid) {
  return el("div", { class: `bar-line ${kind}` }, [
    el("div", { class: "bar-track" }, [
      el("div", { class: `bar ${kind}`, "data-testid": testid, style: `width:${(Math.min(1, p) * 100).toFixed(2)}%` })]),
    el("span", { class: "bar-value", text: fmtProb(p) }),
  ]);
}

function candidateRow(step, trace, c, pFinal) {
  const isChosen = c.token_id === trace.chosen_token_id;
  const preview = previewProbs();
  const cells = [
    el("span", { class: "cand-rank", text: `#${c.rank}` }),
    el("span", { class: "cand-text", title: `id ${c.token_id}` }, [
      el("span", { class: "tok-text", text: visibleText(c.text) }), el("span", { class: "tok-id", text: c.token_id })]),
    el("span", { class: "cand-logit", "data-testid": "cand-logit", text: c.logit.toFixed(2) }),
    el("div", { class: "bars" }, [barPair("raw", c.prob_raw, "bar-raw"), barPair("final", pFinal, "bar-final"),
      preview ? barPair("preview", preview.get(c.token_id) ?? 0, "bar-preview") : null]),
    el("span", { class: "cand-note" }, [
      isChosen ? el("span", { class: "badge chosen-badge", text: trace.method === "forced" ? "forced" : "chosen" }) : null,
      c.removed_by ? el("span", { class: "badge removed", "data-testid": "removed-by", text: `removed by ${c.removed_by}` }) : null,
      !isChosen ? el("span", { class: "branch-hint", text: "branch ↳" }) : null,
    ]),
  ];
  const attrs = {
    class: `candidate${isChosen ? " chosen" : ""}${c.removed_by ? " is-removed" : ""}`,
    "data-testid": "candidate", "data-token-id": c.token_id, "data-rank": c.rank,
    "data-prob-raw": c.prob_raw, "data-prob-final": pFinal, "data-logit": c.logit,
    "data-prob-preview": preview ? (preview.get(c.token_id) ?? 0) : "",
    "data-chosen": isChosen ? "true" : "false", "data-removed-by": c.removed_by || "",
  };
  if (isChosen) return el("div", { ...attrs, "aria-current": "true" }, cells);
  return el("button", {
    ...attrs, type: "button", "data-focus-key": `cand-${c.token_id}`,
    "aria-label": `branch: continue token ${step + 1} with “${c.text}” (rank ${c.rank}, p ${fmtProb(c.prob_raw)})`,
    onclick: () => branchFrom(step, c),
  }, cells);
}

function whyFootnote(trace) {
  const shown = trace.candidates.reduce((sum, c) => sum + c.prob_raw, 0);
  return el("p", { class: "hint", "data-testid": "why-remaining" }, [
    `These ${plural(trace.candidates.length, "candidate")} hold ${fmtPercent(shown)} of the raw probability; `,
    `the remaining ${fmtPercent(Math.max(0, 1 - shown))} is spread over the rest of the vocabulary. `,
    "Select a candidate (click, or Tab then Enter) to branch: generation continues from it.",
  ]);
}

/** Force any token id at this step (an end-of-sequence token, say, which rarely ranks among the top few). */
function forceTokenForm(step) {
  const input = el("input", { type: "number", min: 0, step: 1, id: "force-token-id", "data-testid": "force-token-id",
    "data-focus-key": "force-token-id", "aria-label": "token id to force at this step" });
  return el("form", { class: "force-form", onsubmit: (event) => {
    event.preventDefault();
    forceTokenId(step, parseInt(input.value, 10));
  } }, [
    el("label", { for: "force-token-id", text: "Force another token id here:" }), input,
    el("button", { type: "submit", class: "small", "data-testid": "force-token", text: "branch with it" }),
    state.info && state.info.eos_token_ids.length
      ? el("span", { class: "hint", text: ` end of sequence = id ${state.info.eos_token_ids.join(", ")}` }) : null,
  ]);
}

async function forceTokenId(step, tokenId) {
  if (!Number.isInteger(tokenId) || tokenId < 0) {
    showError(inputError(null, "a token id is a whole number ≥ 0"));
    return;
  }
  const trace = pathOf(currentBranch())[step].trace;
  let candidate = trace && trace.candidates.find((c) => c.token_id === tokenId);
  if (!candidate) {
    try {
      const body = await apiJson("/detokenize", { tokens: [tokenId] });
      candidate = { token_id: tokenId, text: body.prompt, rank: null, prob_raw: 0, prob_final: 0 };
    } catch (error) {
      showError(error);
      return;
    }
  }
  branchFrom(step, candidate);
}

/* ---------------------------------------------------------------- tree */

const ROW = 34;
const CELL = 16;
const PAD = 22;

function cacheHint() {
  if (!state.info || !state.treePromptIds) return "";
  const size = state.info.block_size;
  const whole = Math.floor(state.treePromptIds.length / size);
  if (whole === 0) {
    return `This prompt (${plural(state.treePromptIds.length, "token")}) is shorter than one KV block of `
      + `${plural(size, "token")}: the prefix cache reuses only whole blocks, so a branch recomputes it.`;
  }
  return `A branch finds the prompt's first ${plural(whole, "whole block")} (${plural(whole * size, "token")}) in the `
    + "prefix cache and recomputes only the tokens after them.";
}

function renderTree() {
  const box = $("tree");
  $("cache-hint").textContent = cacheHint();
  const rows = visibleBranches();
  if (!rows.length) {
    box.replaceChildren(el("p", { class: "hint", text: "No paths yet." }));
    return;
  }
  const maxLen = Math.max(...rows.map((b) => pathOf(b).length));
  const width = PAD + (maxLen + 1) * CELL;
  const laneOf = new Map(rows.map((b, i) => [b.id, i]));
  const shapes = rows.flatMap((branch, lane) => treeLane(branch, lane, laneOf));
  const svg = svgEl("svg", { width, height: rows.length * ROW, viewBox: `0 0 ${width} ${rows.length * ROW}`,
    class: "tree-svg", role: "group", "aria-label": `token tree with ${plural(state.branches.length, "path")}`,
    onkeydown: onTreeKeydown }, shapes);
  withFocusKept(box, () => {
    setChildren(box,
      el("div", { class: "tree-labels" }, rows.map(treeLabel)),
      el("div", { class: "tree-lanes" }, [svg]),
      state.importReport ? el("p", { class: "hint import-report", "data-testid": "import-report", text: state.importReport }) : null,
    );
  });
}

function treeLane(branch, lane, laneOf) {
  const y = lane * ROW + ROW / 2;
  const start = branch.prefix.length;
  const shapes = [];
  if (branch.parentId === null) {
    shapes.push(svgEl("circle", { cx: 8, cy: y, r: 5, class: "tree-root" }, [
      svgEl("title", { text: `prompt (${plural(state.treePromptIds ? state.treePromptIds.length : 0, "token")})` })]));
    shapes.push(svgEl("line", { x1: 13, y1: y, x2: PAD, y2: y, class: "tree-edge" }));
  } else {
    // From the parent's token just before the fork (or its prompt dot) down to this branch's first token.
    const parentY = laneOf.get(branch.parentId) * ROW + ROW / 2;
    const x0 = start === 0 ? 8 : PAD + (start - 1) * CELL + (CELL - 3) / 2;
    const x1 = PAD + start * CELL;
    shapes.push(svgEl("path", { d: `M ${x0} ${parentY + 6} C ${x0} ${y}, ${x0} ${y}, ${x1} ${y}`, class: "tree-edge fork" }));
  }
  const focusCell = treeFocusCell();
  pathOf(branch).slice(start).forEach((token, j) => {
    const step = start + j;
    const p = tokenProb(token) ?? 0.5;
    const isSelected = branch.id === state.currentId && step === state.selectedStep;
    const isFocusCell = focusCell.branch === branch.id && focusCell.step === step;
    const cls = ["tree-cell", token.isForced ? "forced" : "", isSelected ? "selected" : ""].join(" ");
    shapes.push(svgEl("rect", {
      x: PAD + step * CELL, y: y - 8, width: CELL - 3, height: 16, rx: 3, fill: probColor(p), class: cls,
      tabindex: isFocusCell ? 0 : -1, role: "button", "aria-pressed": isSelected ? "true" : "false",
      "aria-label": `path ${branch.id}, token ${step + 1}: “${token.text}”, p ${fmtProb(p)}`,
      "data-testid": "tree-cell", "data-branch": branch.id, "data-step": step, "data-focus-key": `cell-${branch.id}-${step}`,
      onclick: () => selectCell(branch.id, step),
    }, [svgEl("title", { text: `path ${branch.id}, token ${step + 1}: “${visibleText(token.text)}” p ${fmtProb(p)}` })]));
  });
  return shapes;
}

/** The one tree cell in the tab order (roving tabindex): the selected one, else the first of the first path. */
function treeFocusCell() {
  const branch = currentBranch();
  if (branch && state.selectedStep !== null && state.selectedStep >= branch.prefix.length) {
    return { branch: branch.id, step: state.selectedStep };
  }
  const first = visibleBranches()[0];
  return first ? { branch: first.id, step: first.prefix.length } : { branch: null, step: null };
}

function selectCell(branchId, step) {
  selectBranch(branchId, step);
  state.isFollowing = false;
  state.focusAfterRender = `cell-${branchId}-${step}`;
  scheduleRender();
}

/** Arrow keys move between tree cells (↑ ↓ paths, ← → tokens), Enter or Space selects; focus stays in the tree. */
function onTreeKeydown(event) {
  const cell = event.target.closest ? event.target.closest("[data-testid=tree-cell]") : null;
  if (!cell) return;
  const rows = visibleBranches();
  let lane = rows.findIndex((b) => b.id === Number(cell.dataset.branch));
  let step = Number(cell.dataset.step);
  if (event.key === "Enter" || event.key === " ") {
    event.preventDefault();
    selectCell(rows[lane].id, step);
    return;
  }
  const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
  if (!(event.key in moves)) return;
  event.preventDefault();
  lane = Math.max(0, Math.min(rows.length - 1, lane + moves[event.key][0]));
  const target = rows[lane];
  step = Math.max(target.prefix.length, Math.min(pathOf(target).length - 1, step + moves[event.key][1]));
  const next = $("tree").querySelector(`[data-focus-key="cell-${target.id}-${step}"]`);
  if (!next) return;
  cell.setAttribute("tabindex", "-1");
  next.setAttribute("tabindex", "0");
  next.focus();
}

function treeLabel(branch) {
  const path = pathOf(branch);
  const children = countDescendants(branch);
  const isCurrent = branch.id === state.currentId;
  const toggle = childrenOf(branch).length
    ? el("button", {
      type: "button", class: "small toggle", "data-testid": "tree-toggle", "data-focus-key": `toggle-${branch.id}`,
      "aria-expanded": branch.isCollapsed ? "false" : "true",
      "aria-label": `${branch.isCollapsed ? "expand" : "collapse"} the ${plural(children, "branch", "branches")} of path ${branch.id}`,
      text: branch.isCollapsed ? `▸ ${children}` : "▾",
      onclick: () => {
        branch.isCollapsed = !branch.isCollapsed;
        scheduleRender();
      },
    })
    : el("span", { class: "toggle-spacer" });
  const own = visibleText(branch.tokens.map((t) => t.text).join(""));
  return el("div", {
    class: `tree-row${isCurrent ? " current" : ""}`, "data-testid": "tree-row", "data-branch": branch.id,
    "data-parent": branch.parentId ?? "", "data-status": branch.status,
    style: `padding-left:${Math.min(depthOf(branch), 6) * 8}px`,
  }, [
    toggle,
    el("button", {
      type: "button", class: "tree-select", "data-testid": "tree-select", "data-focus-key": `select-${branch.id}`,
      "aria-current": isCurrent ? "true" : null, title: own,
      onclick: () => {
        selectBranch(branch.id, state.selectedStep !== null ? Math.min(state.selectedStep, path.length - 1) : null);
        state.isFollowing = false;
        scheduleRender();
      },
    }, [
      el("span", { class: "tree-title" }, [el("strong", { text: `path ${branch.id}` }), " ",
        el("span", { class: "snippet", "data-testid": "tree-snippet", text: own.slice(0, 28) || "…" })]),
      el("span", { class: "tree-settings", "data-testid": "tree-settings", text: settingsText(branch.params) }),
    ]),
    el("span", { class: "logprob", "data-testid": "tree-logprob", title: "Σ log p_raw of the path",
      text: cumulativeLogprob(path).toFixed(1) }),
    el("label", { class: "compare-check", title: "compare this path" }, [
      el("input", {
        type: "checkbox", "data-testid": "compare-check", "data-focus-key": `compare-${branch.id}`,
        "aria-label": `compare path ${branch.id}`, checked: state.compareIds.has(branch.id),
        onchange: (event) => {
          if (event.target.checked) state.compareIds.add(branch.id);
          else state.compareIds.delete(branch.id);
          scheduleRender();
        },
      }),
    ]),
  ]);
}

/* ---------------------------------------------------------------- compare */

function firstDivergence(a, b) {
  let i = 0;
  while (i < a.length && i < b.length && a[i].id === b[i].id) i += 1;
  return i;
}

function renderCompare() {
  const box = $("compare");
  const branches = [...state.compareIds].map(branchById).filter(Boolean).slice(0, 2);
  if (branches.length < 2) {
    box.hidden = branches.length === 0;
    box.replaceChildren(branches.length ? el("p", { class: "hint", text: "Tick a second path to compare it with this one." }) : "");
    return;
  }
  box.hidden = false;
  const [a, b] = branches.map(pathOf);
  const split = firstDivergence(a, b);
  setChildren(box,
    el("h3", { text: `Compare path ${branches[0].id} and path ${branches[1].id}` }),
    el("p", { "data-testid": "compare-divergence", "data-step": split,
      text: split >= Math.min(a.length, b.length) ? `No divergence: one path continues the other for ${plural(split, "token")}.`
        : `They share ${plural(split, "token")} and first differ at token ${split + 1}.` }),
    compareAligned(branches, [a, b], split),
    split < Math.min(a.length, b.length) ? compareMargin(a[split], b[split], branches) : null,
  );
}

/** The two paths token by token in two rows, the shared part dimmed and the first divergent token marked. */
function compareAligned(branches, paths, split) {
  return el("div", { class: "compare-grid" }, paths.map((path, i) => el("div", { class: "compare-item", "data-testid": "compare-item" }, [
    el("span", { class: "compare-head" }, [el("strong", { text: `path ${branches[i].id}` }),
      ` · Σ log p = ${cumulativeLogprob(path).toFixed(2)} · ${settingsText(branches[i].params)}`]),
    el("p", { class: "compare-text" }, path.map((t, step) => el("span", {
      class: step < split ? "shared" : step === split ? "diverge" : "",
      "data-testid": step === split ? "compare-diverge-token" : null, text: visibleText(t.text) }))),
  ])));
}

/** At the divergent token both paths saw the same context: the two choices' probabilities and their margin. */
function compareMargin(tokenA, tokenB, branches) {
  const pa = tokenProb(tokenA);
  const pb = tokenProb(tokenB);
  const trace = tokenA.trace || tokenB.trace;
  const rows = trace ? trace.candidates.slice().sort((x, y) => x.rank - y.rank).slice(0, 8).map((c) => el("tr", {
    class: c.token_id === tokenA.id || c.token_id === tokenB.id ? "picked" : "" }, [
    el("td", { text: visibleText(c.text) }), el("td", { text: fmtProb(c.prob_raw) }),
    el("td", { text: c.token_id === tokenA.id ? `path ${branches[0].id}` : c.token_id === tokenB.id ? `path ${branches[1].id}` : "" }),
  ])) : [];
  return el("div", { class: "compare-margin", "data-testid": "compare-margin" }, [
    el("p", { text: `At the divergent token: path ${branches[0].id} took “${visibleText(tokenA.text)}” (p raw ${fmtProb(pa)}), `
      + `path ${branches[1].id} took “${visibleText(tokenB.text)}” (p raw ${fmtProb(pb)}); margin `
      + `${pa !== null && pb !== null ? (pa - pb).toFixed(3) : "–"} in probability, `
      + `${pa && pb ? Math.log(pa / pb).toFixed(2) : "–"} in log p.` }),
    rows.length ? el("table", { class: "compare-table" }, [
      el("thead", {}, [el("tr", {}, [el("th", { text: "candidate" }), el("th", { text: "p raw" }), el("th", { text: "taken by" })])]),
      el("tbody", {}, rows)]) : null,
  ]);
}

/* ---------------------------------------------------------------- engine view */

function renderEngine() {
  const box = $("engine");
  const branch = currentBranch();
  const engine = state.engine;
  const parts = [el("p", { class: "hint", text: "Prefill computes the whole prompt in one forward pass (or a few "
    + "chunks) and yields the first token; every later token needs one more forward pass (decode). The KV cache "
    + "keeps each token's keys and values in fixed-size blocks so no pass recomputes the past." })];
  parts.push(passTimeline());
  const m = branch && branch.metrics;
  if (m) {
    parts.push(forwardPasses(m, branch));
    if (engine) parts.push(kvBlocks(m, engine.block_size, branch));
  } else if (branch && branch.status === "streaming") {
    parts.push(el("p", { "data-testid": "engine-pending", text: `${plural(pathOf(branch).length, "token")} so far; the request's counts arrive with its last token.` }));
  } else if (branch && branch.status !== "streaming") {
    parts.push(el("p", { "data-testid": "engine-pending", text: `${statusText(branch)} after ${plural(pathOf(branch).length, "token")}. `
      + "A request that did not finish sends no final counts; the engine numbers below are live." }));
  }
  if (engine) parts.push(engineSummary(engine));
  else if (state.engineError) parts.push(el("p", { class: "hint", text: `Engine stats unavailable: ${state.engineError}` }));
  setChildren(box, ...parts);
}

function forwardPasses(m, branch) {
  const generated = m.num_generated_tokens;
  const passes = m.num_forward_passes;
  const decodePasses = Math.max(0, generated - 1);
  const prefillPasses = Math.max(1, passes - decodePasses);
  const computed = m.num_prompt_tokens - m.num_cached_tokens;
  const ttft = m.time_to_first_token || 0;
  const tpot = m.time_per_output_token || 0;
  const total = ttft + tpot * decodePasses || 1;
  const width = 600;
  const x = (seconds) => (seconds / total) * width;
  const shapes = [svgEl("rect", { x: 0, y: 4, width: Math.max(2, x(ttft)), height: 26, class: "pass prefill" }, [
    svgEl("title", { text: `prefill: ${plural(computed, "prompt token")} in ${plural(prefillPasses, "pass", "passes")}, ${fmtMs(ttft)}` })])];
  for (let i = 0; i < decodePasses; i += 1) {
    shapes.push(svgEl("rect", { x: x(ttft + i * tpot) + 0.5, y: 4, width: Math.max(1, x(tpot) - 1), height: 26,
      class: "pass decode", "data-testid": "decode-pass" }));
  }
  return el("div", { class: "passes", "data-testid": "forward-passes" }, [
    el("p", { class: "big-fact" }, [
      el("strong", { "data-testid": "num-forward-passes", text: passes }),
      ` ${passes === 1 ? "forward pass" : "forward passes"} for ${plural(generated, "generated token")}: `
        + `${prefillPasses} for the prompt (${plural(computed, "token")} computed`,
      m.num_cached_tokens ? `, ${plural(m.num_cached_tokens, "token")} reused from the prefix cache` : "",
      `; it also yields the first token) + ${plural(decodePasses, "decode pass", "decode passes")} of one token each.`,
    ]),
    svgEl("svg", { viewBox: `0 0 ${width} 34`, class: "timeline", preserveAspectRatio: "none", role: "img",
      "aria-label": `time line: prefill ${fmtMs(ttft)}, then ${plural(decodePasses, "decode pass", "decode passes")} of ${fmtMs(tpot)}` }, shapes),
    el("p", { class: "timeline-legend" }, [el("span", { class: "key prefill" }), ` prefill ${fmtMs(ttft)} `,
      el("span", { class: "key decode" }), ` decode ${fmtMs(tpot)} per token (one bar per forward pass)`]),
  ]);
}

function kvBlocks(m, blockSize, branch) {
  const numBlocks = m.kv_blocks;
  const cached = m.num_cached_tokens || 0;
  const prompt = m.num_prompt_tokens;
  const total = prompt + m.num_generated_tokens;
  const cols = Math.ceil(Math.sqrt(blockSize));
  const rowsPerBlock = Math.ceil(blockSize / cols);
  const slot = 9;
  const blockW = cols * slot + 6;
  const blockH = rowsPerBlock * slot + 6;
  const perLine = 10;
  const shapes = [];
  for (let b = 0; b < numBlocks; b += 1) {
    const bx = (b % perLine) * (blockW + 4);
    const by = Math.floor(b / perLine) * (blockH + 4);
    const isHit = (b + 1) * blockSize <= cached;
    shapes.push(svgEl("rect", { x: bx, y: by, width: blockW, height: blockH, rx: 2, class: `kv-block${isHit ? " hit" : ""}`,
      "data-testid": "kv-block", "data-hit": isHit ? "true" : "false" }, [
      svgEl("title", { text: `block ${b + 1}: tokens ${b * blockSize + 1}–${(b + 1) * blockSize}${isHit ? ", a prefix-cache hit" : ""}` })]));
    for (let s = 0; s < blockSize; s += 1) {
      const position = b * blockSize + s;
      const kind = position < cached ? "cached" : position < prompt ? "prompt" : position < total ? "generated" : "empty";
      shapes.push(svgEl("rect", { x: bx + 3 + (s % cols) * slot, y: by + 3 + Math.floor(s / cols) * slot,
        width: slot - 1, height: slot - 1, class: `kv-slot ${kind}` }));
    }
  }
  const lines = Math.max(1, Math.ceil(numBlocks / perLine));
  const width = Math.max(1, Math.min(numBlocks, perLine) * (blockW + 4));
  const bytesPerToken = state.info ? state.info.kv_bytes_per_token : null;
  const hits = Math.floor(cached / blockSize);
  return el("div", { class: "kv", "data-testid": "kv-view" }, [
    el("p", {}, [el("strong", { "data-testid": "kv-blocks", text: numBlocks }),
      ` ${numBlocks === 1 ? "KV block" : "KV blocks"} of ${plural(blockSize, "slot")} held this path's ${plural(total, "token")} (one slot per token); `,
      el("span", { "data-testid": "kv-hits", text: `${hits} of them ${hits === 1 ? "was a prefix-cache hit" : "were prefix-cache hits"}` }), "."]),
    bytesPerToken ? el("p", { "data-testid": "kv-bytes" }, [
      `KV memory: ${fmtBytes(bytesPerToken)} per token (keys and values of every layer); this path's ${plural(total, "token")} take `,
      el("strong", { text: fmtBytes(bytesPerToken * total) }), `, its ${numBlocks === 1 ? "block reserves" : "blocks reserve"} ${fmtBytes(bytesPerToken * blockSize * numBlocks)}.`,
    ]) : null,
    svgEl("svg", { width, height: lines * (blockH + 4), viewBox: `0 0 ${width} ${lines * (blockH + 4)}`,
      class: "kv-svg", role: "img", "aria-label": `${plural(numBlocks, "KV-cache block")}` }, shapes),
    el("p", { class: "timeline-legend" }, [el("span", { class: "key cached" }), " prefix cache hit ",
      el("span", { class: "key prompt" }), " prompt ", el("span", { class: "key generated" }), " generated ",
      el("span", { class: "key empty" }), " free slot"]),
  ]);
}

function engineSummary(engine) {
  const usage = engine.num_blocks ? engine.num_blocks_used / engine.num_blocks : 0;
  const facts = [
    ["KV blocks in use now", `${engine.num_blocks_used} of ${plural(engine.num_blocks, "block")} (${fmtPercent(usage)})`, "engine-blocks-used"],
    ["requests running / waiting", `${engine.num_running} / ${engine.num_waiting}`, "engine-requests"],
    ["prefix-cache hit rate", fmtPercent(engine.prefix_cache_hit_rate || 0), "engine-hit-rate"],
    ["forward passes since start", String(engine.num_forward_passes), "engine-forward-passes"],
    ["KV block size · dtype · context", `${plural(engine.block_size, "token")} per block · ${engine.dtype} weights · ${plural(engine.max_model_len, "token")} max`, "engine-shape"],
  ];
  if (state.info) facts.push(["KV memory per token", fmtBytes(state.info.kv_bytes_per_token), "engine-kv-bytes"]);
  if (engine.speculative_draft) {
    facts.push(["speculative decoding", `${engine.speculative_draft}, ${plural(engine.num_speculative_tokens, "draft token")} per pass; `
      + `${engine.num_accepted_draft_tokens} of ${engine.num_draft_tokens} accepted`, "engine-speculative"]);
  }
  return el("div", { class: "engine-summary" }, [
    el("div", { class: "usage-track", role: "meter", "aria-valuemin": 0, "aria-valuemax": engine.num_blocks,
      "aria-valuenow": engine.num_blocks_used, "aria-label": "KV blocks in use" }, [
      el("div", { class: "usage-bar", style: `width:${(usage * 100).toFixed(2)}%` })]),
    factList(facts),
  ]);
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
  const moves = { ArrowRight: index + 1, ArrowDown: index + 1, ArrowLeft: index - 1, ArrowUp: index - 1,
    Home: 0, End: chips.length - 1 };
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
  loadModelName().then(initTimeline).then(() => Promise.all([tokenizePrompt().catch(showError), refreshEngine()]));
  render();
}

document.addEventListener("DOMContentLoaded", init);
