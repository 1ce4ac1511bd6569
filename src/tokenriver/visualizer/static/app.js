"use strict";
/*
 * tokenriver visualizer: one page over the server's HTTP API. No build step, no library, nothing fetched
 * but the API of the server that served this file.
 *
 * Data flow. POST /tokenize turns the prompt (or the chat-templated conversation) into token ids. Every
 * generation is a streamed POST /v1/completions whose prompt is those ids and which asks for a per-step
 * trace (`trace: true`): for each generated token, the top candidates with their logits and probabilities
 * before (prob_raw) and after (prob_final) sampling's processing, and which filter removed which.
 *
 * A "branch" is one such request. The root branch starts after the prompt. A child branch starts at step
 * `forkStep` of the path it was forked from, with a token the user picked there: its prompt is the prompt
 * ids + the path's ids before that step + the picked id, and the picked token is its first token. A path
 * is therefore `branch.prefix` (the ancestors' tokens, shared) followed by `branch.tokens` (its own).
 *
 * All state lives in `state`; render functions redraw a panel from it and keep nothing of their own.
 */

const state = {
  modelName: null,
  // Set by the last /tokenize: the prompt as the model sees it.
  promptIds: null,
  promptStrs: null,
  // The prompt ids the current tree was generated from (a different prompt starts a new tree).
  treePromptIds: null,
  branches: [],
  currentId: null,
  selectedStep: null,
  // While true, the selection follows the newest token of the current branch as it streams in.
  isFollowing: true,
  compareIds: new Set(),
  engine: null,
  engineError: null,
  nextBranchNumber: 1,
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
  trace_top: "trace-top", prompt: "prompt", messages: "prompt",
};

function showError(error) {
  document.querySelectorAll("[aria-invalid=true]").forEach((el) => el.removeAttribute("aria-invalid"));
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
  document.querySelectorAll("[aria-invalid=true]").forEach((el) => el.removeAttribute("aria-invalid"));
}

/* ---------------------------------------------------------------- formatting */

function fmtProb(p) {
  if (p === null || p === undefined || Number.isNaN(p)) return "–";
  if (p >= 0.001 || p === 0) return p.toFixed(3);
  return p.toExponential(1);
}

function fmtMs(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const ms = seconds * 1000;
  return ms >= 100 ? `${ms.toFixed(0)} ms` : `${ms.toFixed(1)} ms`;
}

/** Token text with its whitespace made visible (for chips and bars, where "" or " " would vanish). */
function visibleText(text) {
  if (text === "") return "∅";
  return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍");
}

/** Background colour for a probability: red (unlikely) through yellow to green (certain). */
function probColor(p) {
  const hue = Math.round(Math.max(0, Math.min(1, p)) * 130);
  return `hsl(${hue} 75% 78%)`;
}

function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of [].concat(children)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs = {}, children = []) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, String(value));
  }
  for (const child of [].concat(children)) if (child) node.append(child);
  return node;
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

/** The branch whose own tokens contain path step `step` of `branch` (itself or an ancestor). */
function ownerOfStep(branch, step) {
  let owner = branch;
  while (owner.parentId !== null && step < owner.prefix.length) owner = branchById(owner.parentId);
  return owner;
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
  const response = await api("/tokenize", promptRequest());
  const body = await response.json();
  if (serial !== tokenizeSerial) return null;
  state.promptIds = body.tokens;
  state.promptStrs = body.token_strs || body.tokens.map(String);
  $("prompt-count").textContent = `${body.count} tokens (the model's context holds ${body.max_model_len}).`;
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
    class: "prompt-token", "data-testid": "prompt-token", "data-token-id": id, title: `token ${i}: id ${id}`,
  }, [el("span", { class: "tok-text", text: visibleText(state.promptStrs[i]) }), el("span", { class: "tok-id", text: id })])));
}

/* ---------------------------------------------------------------- generation */

function numberInput(id, parse = Number) {
  const raw = $(id).value.trim();
  return raw === "" ? null : parse(raw);
}

function readParams() {
  const stop = $("stop").value.split("\n").filter((s) => s !== "");
  const params = {
    temperature: numberInput("temperature"),
    top_k: numberInput("top-k", (s) => parseInt(s, 10)),
    top_p: numberInput("top-p"),
    min_p: numberInput("min-p"),
    repetition_penalty: numberInput("repetition-penalty"),
    max_tokens: numberInput("max-tokens", (s) => parseInt(s, 10)),
    trace_top: numberInput("trace-top", (s) => parseInt(s, 10)),
  };
  params.seed = numberInput("seed", (s) => parseInt(s, 10));
  if (stop.length) params.stop = stop;
  // An empty field means "the server's default": leave it out rather than send null.
  return Object.fromEntries(Object.entries(params).filter(([, value]) => value !== null && !Number.isNaN(value)));
}

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

async function runBranch(branch) {
  const params = branch.params;
  const promptIds = state.treePromptIds.concat(branch.prefix.map((t) => t.id), branch.tokens.map((t) => t.id));
  const body = {
    prompt: promptIds,
    stream: true,
    stream_options: { include_usage: true },
    trace: true,
    logprobs: 5,
    ...params,
    // A branch's path should be no longer than a fresh generation's.
    max_tokens: Math.max(1, (params.max_tokens ?? 16) - branch.prefix.length - branch.tokens.length),
  };
  if (state.modelName) body.model = state.modelName;
  startEnginePolling();
  try {
    const response = await api("/v1/completions", body, branch.controller.signal);
    for await (const chunk of sseEvents(response)) {
      // The server reports a failure after the stream started as one {"error": ...} event.
      if (chunk.error) throw new ApiError(null, chunk.error);
      for (const choice of chunk.choices || []) {
        const tokens = tokensOfChoice(choice);
        const now = performance.now();
        tokens.forEach(() => branch.tokenTimes.push(now));
        branch.tokens.push(...tokens);
        if (choice.finish_reason) branch.finishReason = choice.finish_reason;
        if (choice.metrics) branch.metrics = choice.metrics;
      }
      if (chunk.metrics) branch.metrics = chunk.metrics;
      if (chunk.usage) branch.usage = chunk.usage;
      if (state.isFollowing && state.currentId === branch.id) state.selectedStep = pathOf(branch).length - 1;
      scheduleRender();
    }
    branch.status = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      branch.status = "stopped";
    } else {
      branch.status = "error";
      branch.error = error.message;
      showError(error);
    }
  } finally {
    updateBusy();
    refreshEngine();
    scheduleRender();
  }
}

function isBusy() {
  return state.branches.some((b) => b.status === "streaming");
}

function updateBusy() {
  $("stop-generation").disabled = !isBusy();
  document.body.classList.toggle("busy", isBusy());
}

async function generate() {
  clearError();
  clearTimeout(tokenizeTimer);
  let ids;
  try {
    ids = await tokenizePrompt();
  } catch (error) {
    showError(error);
    return;
  }
  if (ids === null) return;
  const samePrompt = state.treePromptIds && ids.length === state.treePromptIds.length
    && ids.every((id, i) => id === state.treePromptIds[i]);
  if (!samePrompt) resetTree();
  state.treePromptIds = ids;
  const branch = newBranch(null, 0, [], null, readParams());
  selectBranch(branch.id, null);
  state.isFollowing = true;
  updateBusy();
  scheduleRender();
  await runBranch(branch);
}

/** Generate from `step` of the current path with `candidate` instead of the token the model picked. */
function branchFrom(step, candidate) {
  const current = currentBranch();
  const path = pathOf(current);
  const parentTrace = path[step].trace;
  const owner = ownerOfStep(current, step);
  const existing = state.branches.find((b) => b.parentId === owner.id && b.forkStep === step
    && b.tokens.length && b.tokens[0].id === candidate.token_id);
  if (existing) {
    selectBranch(existing.id, step);
    scheduleRender();
    return;
  }
  clearError();
  const forced = {
    id: candidate.token_id,
    text: candidate.text,
    // The distribution is the one the model had at this step; only the choice is the user's.
    trace: {
      ...parentTrace,
      chosen_token_id: candidate.token_id,
      chosen_rank: candidate.rank,
      chosen_prob_raw: candidate.prob_raw,
      chosen_prob_final: candidate.prob_final,
      method: "forced",
    },
    logprob: Math.log(candidate.prob_raw),
    isForced: true,
  };
  const branch = newBranch(owner, step, path.slice(0, step), forced, readParams());
  selectBranch(branch.id, step);
  state.isFollowing = false;
  updateBusy();
  scheduleRender();
  runBranch(branch);
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
}

function selectBranch(id, step) {
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

async function refreshEngine() {
  try {
    const response = await api("/v1/engine");
    state.engine = await response.json();
    state.engineError = null;
  } catch (error) {
    state.engineError = error.message;
  }
  if (!isBusy() && enginePoll !== null) {
    clearInterval(enginePoll);
    enginePoll = null;
  }
  scheduleRender();
}

function startEnginePolling() {
  if (enginePoll === null) enginePoll = setInterval(refreshEngine, 400);
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
  renderWhy();
  renderTree();
  renderCompare();
  renderEngine();
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
  info.replaceChildren(
    el("span", { class: "badge", text: `path ${branch.id}` }),
    parent ? ` forked from path ${parent.id} at step ${branch.forkStep} with “${visibleText(branch.tokens[0].text)}”` : " from the prompt",
    el("span", { class: "sep", text: " · " }),
    `${path.length} tokens · Σ log p = `,
    el("strong", { "data-testid": "path-logprob", text: cumulativeLogprob(path).toFixed(2) }),
    el("span", { class: "sep", text: " · " }),
    el("span", { class: `status status-${branch.status}`, "data-testid": "path-status", text: statusText(branch) }),
  );
  const selected = state.selectedStep;
  const focusStep = selected ?? path.length - 1;
  withFocusKept(box, () => {
    box.replaceChildren(...path.map((token, step) => {
      const p = token.trace ? token.trace.chosen_prob_raw : (token.logprob !== null ? Math.exp(token.logprob) : null);
      const isOwn = step >= branch.prefix.length;
      const classes = ["token"];
      if (step === selected) classes.push("selected");
      if (token.isForced && isOwn) classes.push("forced");
      if (!isOwn) classes.push("inherited");
      const chip = el("button", {
        type: "button", class: classes.join(" "), "data-testid": "token", "data-step": step,
        "data-token-id": token.id, "data-prob": p ?? "", "data-focus-key": `token-${step}`,
        tabindex: step === focusStep ? 0 : -1, "aria-pressed": step === selected ? "true" : "false",
        "aria-label": `step ${step}: “${token.text}”, probability ${fmtProb(p)}${token.isForced ? ", forced by a branch" : ""}`,
        style: p === null ? "" : `background:${probColor(p)}`, title: `step ${step} · id ${token.id} · p ${fmtProb(p)}`,
        onclick: () => selectStep(step),
      }, token.text.includes("\n") ? visibleText(token.text) : (token.text || "∅"));
      return token.text.includes("\n") ? [chip, el("br")] : [chip];
    }).flat());
  });
  renderTiming(branch);
}

function statusText(branch) {
  if (branch.status === "streaming") return "generating…";
  if (branch.status === "done") return `finished: ${branch.finishReason || "?"}`;
  if (branch.status === "stopped") return "stopped";
  return `error: ${branch.error}`;
}

function renderTiming(branch) {
  const m = branch.metrics;
  const items = [];
  const add = (label, value, testid) => items.push(el("div", { class: "stat" }, [
    el("dt", { text: label }), el("dd", { "data-testid": testid, text: value })]));
  const generated = branch.tokens.length - (branch.tokens[0] && branch.tokens[0].isForced ? 1 : 0);
  if (m) {
    add("prefill (time to first token)", fmtMs(m.time_to_first_token), "ttft");
    add("decode, per token", fmtMs(m.time_per_output_token), "tpot");
    if (m.time_per_output_token) add("decode speed", `${(1 / m.time_per_output_token).toFixed(1)} tokens/s`, "decode-speed");
    add("generated tokens", String(m.num_generated_tokens ?? generated), "num-generated");
    add("prompt tokens (cached)", `${m.num_prompt_tokens ?? "?"} (${m.num_cached_tokens ?? 0})`, "num-prompt");
  } else {
    const times = branch.tokenTimes;
    const ttft = times.length ? (times[0] - branch.startedAt) / 1000 : null;
    const tpot = times.length > 1 ? (times[times.length - 1] - times[0]) / 1000 / (times.length - 1) : null;
    add("prefill (time to first token, measured here)", fmtMs(ttft), "ttft");
    add("decode, per token (measured here)", fmtMs(tpot), "tpot");
    add("generated tokens", String(generated), "num-generated");
  }
  $("timing").replaceChildren(...items);
}

/** softmax(logit / T) over the recorded candidates only (T = 0: all mass on the largest logit). */
function reshape(candidates, temperature) {
  const logits = candidates.map((c) => c.logit_processed ?? c.logit);
  if (temperature <= 0) {
    const best = logits.indexOf(Math.max(...logits));
    return logits.map((_, i) => (i === best ? 1 : 0));
  }
  const scaled = logits.map((l) => l / temperature);
  const max = Math.max(...scaled);
  const exps = scaled.map((s) => Math.exp(s - max));
  const total = exps.reduce((a, b) => a + b, 0);
  return exps.map((e) => e / total);
}

function sliderTemperature() {
  return Number($("temperature").value);
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
        disabled: step === 0, onclick: () => selectStep(step - 1), text: "← previous step" }),
      el("span", { "data-testid": "why-step", text: `step ${step} of ${path.length}` }),
      el("button", { type: "button", class: "small", "data-testid": "next-step", "data-focus-key": "next-step",
        disabled: step >= path.length - 1, onclick: () => selectStep(step + 1), text: "next step →" }),
    ]);
    if (!trace) {
      box.replaceChildren(nav, el("p", { text: `“${token.text}” (id ${token.id}): no trace was recorded for this step.` }));
      return;
    }
    box.replaceChildren(nav, whySummary(token, trace), whyBars(step, trace), whyFootnote(trace));
  });
}

function whySummary(token, trace) {
  const facts = [
    ["chosen", `“${visibleText(token.text)}” (id ${token.id})`, "why-chosen"],
    ["rank", `${trace.chosen_rank}`, "why-rank"],
    ["p raw (model)", fmtProb(trace.chosen_prob_raw), "why-prob-raw"],
    ["p final (sampled from)", fmtProb(trace.chosen_prob_final), "why-prob-final"],
    ["entropy raw → final", `${trace.entropy_raw.toFixed(2)} → ${trace.entropy_final.toFixed(2)} nats`, "why-entropy"],
    ["tokens kept by the filters", `${trace.num_candidates_kept}`, "why-kept"],
    ["how", token.isForced ? "forced: you picked it to branch" : `${trace.method}, T = ${trace.temperature}`, "why-method"],
  ];
  const grammar = trace.extra && trace.extra.grammar;
  if (grammar) {  // structured output: what the grammar stage allowed at this step
    facts.push(["tokens the grammar allowed", `${grammar.num_allowed}`, "why-grammar-allowed"],
      ["probability the grammar removed", fmtProb(grammar.mass_removed), "why-grammar-removed"],
      ["forced by the grammar", grammar.forced ? "yes: the only token it allowed" : "no", "why-grammar-forced"]);
  }
  return el("dl", { class: "stats why-summary" }, facts.map(([label, value, testid]) => el("div", { class: "stat" }, [
    el("dt", { text: label }), el("dd", { "data-testid": testid, text: value })])));
}

function whyBars(step, trace) {
  const temperature = sliderTemperature();
  const candidates = trace.candidates.slice().sort((a, b) => a.rank - b.rank);
  const reshaped = reshape(candidates, temperature);
  const legend = el("div", { class: "bar-legend", "aria-hidden": "true" }, [
    el("span", { class: "key raw" }), "raw: softmax of the model's logits ",
    el("span", { class: "key final" }), "final: what was sampled from ",
    el("span", { class: "key temp" }), `at T = ${temperature.toFixed(2)}, over these ${candidates.length} candidates only`,
  ]);
  const rows = candidates.map((c, i) => {
    const isChosen = c.token_id === trace.chosen_token_id;
    const bar = (kind, p, testid) => el("div", { class: `bar-track ${kind}` }, [
      el("div", { class: `bar ${kind}`, "data-testid": testid, style: `width:${(Math.min(1, p) * 100).toFixed(2)}%` }),
      el("span", { class: "bar-value", text: fmtProb(p) }),
    ]);
    const cells = [
      el("span", { class: "cand-rank", text: `#${c.rank}` }),
      el("span", { class: "cand-text", title: `id ${c.token_id}` }, [
        el("span", { class: "tok-text", text: visibleText(c.text) }), el("span", { class: "tok-id", text: c.token_id })]),
      el("div", { class: "bars" }, [bar("raw", c.prob_raw, "bar-raw"), bar("final", c.prob_final, "bar-final"),
        bar("temp", reshaped[i], "bar-temp")]),
      el("span", { class: "cand-note" }, [
        isChosen ? el("span", { class: "badge chosen-badge", text: trace.method === "forced" ? "forced" : "chosen" }) : null,
        c.removed_by ? el("span", { class: "badge removed", "data-testid": "removed-by", text: `removed by ${c.removed_by}` }) : null,
        !isChosen ? el("span", { class: "branch-hint", text: "branch ↳" }) : null,
      ]),
    ];
    const attrs = {
      class: `candidate${isChosen ? " chosen" : ""}${c.removed_by ? " is-removed" : ""}`,
      "data-testid": "candidate", "data-token-id": c.token_id, "data-rank": c.rank,
      "data-prob-raw": c.prob_raw, "data-prob-final": c.prob_final, "data-prob-temp": reshaped[i],
      "data-chosen": isChosen ? "true" : "false", "data-removed-by": c.removed_by || "",
    };
    if (isChosen) return el("div", { ...attrs, "aria-current": "true" }, cells);
    return el("button", {
      ...attrs, type: "button", "data-focus-key": `cand-${c.token_id}`,
      "aria-label": `branch: continue step ${step} with “${c.text}” (rank ${c.rank}, p ${fmtProb(c.prob_raw)})`,
      onclick: () => branchFrom(step, c),
    }, cells);
  });
  return el("div", { class: "bar-chart", "data-testid": "bars" }, [legend, ...rows]);
}

function whyFootnote(trace) {
  const shown = trace.candidates.reduce((sum, c) => sum + c.prob_raw, 0);
  return el("p", { class: "hint" }, [
    `These ${trace.candidates.length} candidates hold ${(shown * 100).toFixed(1)}% of the raw probability; `,
    `the other ${(Math.max(0, 1 - shown) * 100).toFixed(1)}% is spread over the rest of the vocabulary. `,
    "Select a candidate (click, or Tab then Enter) to branch: generation continues from it.",
  ]);
}

/* ---------------------------------------------------------------- tree */

const ROW = 30;
const CELL = 16;
const PAD = 22;

function renderTree() {
  const box = $("tree");
  const rows = visibleBranches();
  if (!rows.length) {
    box.replaceChildren(el("p", { class: "hint", text: "No paths yet." }));
    return;
  }
  const promptLen = state.treePromptIds ? state.treePromptIds.length : 0;
  const labels = rows.map((branch) => treeLabel(branch));
  const maxLen = Math.max(...rows.map((b) => pathOf(b).length));
  const width = PAD + (maxLen + 1) * CELL;
  const height = rows.length * ROW;
  const laneOf = new Map(rows.map((b, i) => [b.id, i]));
  const shapes = [];
  rows.forEach((branch, lane) => {
    const y = lane * ROW + ROW / 2;
    const start = branch.prefix.length;
    if (branch.parentId === null) {
      shapes.push(svgEl("circle", { cx: 8, cy: y, r: 5, class: "tree-root" }, [
        svgEl("title", { text: `prompt (${promptLen} tokens)` })]));
      shapes.push(svgEl("line", { x1: 13, y1: y, x2: PAD, y2: y, class: "tree-edge" }));
    } else {
      // From the parent's token just before the fork (or its prompt dot) down to this branch's first token.
      const parentY = laneOf.get(branch.parentId) * ROW + ROW / 2;
      const x0 = start === 0 ? 8 : PAD + (start - 1) * CELL + (CELL - 3) / 2;
      const x1 = PAD + start * CELL;
      shapes.push(svgEl("path", {
        d: `M ${x0} ${parentY + 6} C ${x0} ${y}, ${x0} ${y}, ${x1} ${y}`, class: "tree-edge fork" }));
    }
    pathOf(branch).slice(start).forEach((token, j) => {
      const step = start + j;
      const p = token.trace ? token.trace.chosen_prob_raw : (token.logprob !== null ? Math.exp(token.logprob) : 0.5);
      const isSelected = branch.id === state.currentId && step === state.selectedStep;
      const cls = ["tree-cell", token.isForced ? "forced" : "", isSelected ? "selected" : ""].join(" ");
      shapes.push(svgEl("rect", {
        x: PAD + step * CELL, y: y - 8, width: CELL - 3, height: 16, rx: 3, fill: probColor(p), class: cls,
        "data-testid": "tree-cell", "data-branch": branch.id, "data-step": step,
        onclick: () => {
          selectBranch(branch.id, step);
          state.isFollowing = false;
          scheduleRender();
        },
      }, [svgEl("title", { text: `path ${branch.id}, step ${step}: “${token.text}” p ${fmtProb(p)}` })]));
    });
  });
  const svg = svgEl("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "tree-svg",
    role: "img", "aria-label": `token tree with ${state.branches.length} paths` }, shapes);
  withFocusKept(box, () => {
    box.replaceChildren(
      el("div", { class: "tree-labels" }, labels),
      el("div", { class: "tree-lanes" }, [svg]),
    );
  });
}

function treeLabel(branch) {
  const path = pathOf(branch);
  const children = countDescendants(branch);
  const isCurrent = branch.id === state.currentId;
  const toggle = childrenOf(branch).length
    ? el("button", {
      type: "button", class: "small toggle", "data-testid": "tree-toggle", "data-focus-key": `toggle-${branch.id}`,
      "aria-expanded": branch.isCollapsed ? "false" : "true",
      "aria-label": `${branch.isCollapsed ? "expand" : "collapse"} the ${children} branches of path ${branch.id}`,
      text: branch.isCollapsed ? `▸ ${children}` : "▾",
      onclick: () => {
        branch.isCollapsed = !branch.isCollapsed;
        scheduleRender();
      },
    })
    : el("span", { class: "toggle-spacer" });
  const own = branch.tokens.map((t) => t.text).join("");
  return el("div", {
    class: `tree-row${isCurrent ? " current" : ""}`, "data-testid": "tree-row", "data-branch": branch.id,
    style: `padding-left:${depthOf(branch) * 10}px`,
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
    }, [el("strong", { text: `path ${branch.id}` }), " ", el("span", { class: "snippet", text: own.slice(0, 24) || "…" })]),
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

function renderCompare() {
  const box = $("compare");
  const branches = [...state.compareIds].map(branchById).filter(Boolean);
  if (!branches.length) {
    box.hidden = true;
    box.replaceChildren();
    return;
  }
  box.hidden = false;
  const paths = branches.map(pathOf);
  const base = paths[0];
  box.replaceChildren(el("h3", { text: "Compare paths" }), ...branches.map((branch, i) => {
    const path = paths[i];
    let common = 0;
    while (common < path.length && common < base.length && path[common].id === base[common].id) common += 1;
    if (i === 0) common = 0;
    const lp = cumulativeLogprob(path);
    return el("div", { class: "compare-item", "data-testid": "compare-item" }, [
      el("div", { class: "compare-head" }, [
        el("strong", { text: `path ${branch.id}` }),
        ` · ${path.length} tokens · Σ log p = ${lp.toFixed(2)} · mean ${(lp / Math.max(1, path.length)).toFixed(2)} · `,
        statusText(branch),
      ]),
      el("p", { class: "compare-text" }, [
        el("span", { class: "shared", text: path.slice(0, common).map((t) => t.text).join("") }),
        el("span", { text: path.slice(common).map((t) => t.text).join("") }),
      ]),
    ]);
  }));
}

/* ---------------------------------------------------------------- engine view */

function renderEngine() {
  const box = $("engine");
  const branch = currentBranch();
  const engine = state.engine;
  const parts = [el("p", { class: "hint", text: "Prefill computes the whole prompt in one forward pass (or a few "
    + "chunks) and yields the first token; every later token needs one more forward pass (decode). The KV cache "
    + "keeps each token's keys and values in fixed-size blocks so no pass recomputes the past." })];
  const m = branch && branch.metrics;
  if (m) {
    parts.push(forwardPasses(m, branch));
    if (engine) parts.push(kvBlocks(m, engine.block_size));
  } else if (branch) {
    parts.push(el("p", { text: `${pathOf(branch).length} tokens so far; the counts appear when the generation ends.` }));
  }
  if (engine) parts.push(engineSummary(engine));
  else if (state.engineError) parts.push(el("p", { class: "hint", text: `Engine stats unavailable: ${state.engineError}` }));
  box.replaceChildren(...parts);
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
    svgEl("title", { text: `prefill: ${computed} prompt tokens in ${prefillPasses} pass(es), ${fmtMs(ttft)}` })])];
  for (let i = 0; i < decodePasses; i += 1) {
    shapes.push(svgEl("rect", { x: x(ttft + i * tpot) + 0.5, y: 4, width: Math.max(1, x(tpot) - 1), height: 26,
      class: "pass decode", "data-testid": "decode-pass" }));
  }
  return el("div", { class: "passes", "data-testid": "forward-passes" }, [
    el("p", { class: "big-fact" }, [
      el("strong", { "data-testid": "num-forward-passes", text: passes }),
      ` forward passes for ${generated} generated tokens: ${prefillPasses} for the prompt (${computed} tokens computed`,
      m.num_cached_tokens ? `, ${m.num_cached_tokens} reused from the prefix cache` : "",
      `; it also yields the first token) + ${decodePasses} decode passes of one token each.`,
    ]),
    branch.parentId !== null ? el("p", { class: "hint", text: `This branch is its own request: its prompt is the `
      + `${state.treePromptIds.length} prompt tokens + the ${branch.prefix.length} path tokens before the fork + the `
      + "token you picked. Whole KV blocks of that prefix are found in the prefix cache instead of being recomputed." })
      : null,
    svgEl("svg", { viewBox: `0 0 ${width} 34`, class: "timeline", preserveAspectRatio: "none", role: "img",
      "aria-label": `time line: prefill ${fmtMs(ttft)}, then ${decodePasses} decode passes of ${fmtMs(tpot)}` }, shapes),
    el("p", { class: "timeline-legend" }, [el("span", { class: "key prefill" }), ` prefill ${fmtMs(ttft)} `,
      el("span", { class: "key decode" }), ` decode ${fmtMs(tpot)} per token (one bar per forward pass)`]),
  ]);
}

function kvBlocks(m, blockSize) {
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
    shapes.push(svgEl("rect", { x: bx, y: by, width: blockW, height: blockH, rx: 2, class: "kv-block",
      "data-testid": "kv-block" }, [svgEl("title", { text: `block ${b}: tokens ${b * blockSize}–${(b + 1) * blockSize - 1}` })]));
    for (let s = 0; s < blockSize; s += 1) {
      const position = b * blockSize + s;
      const kind = position < cached ? "cached" : position < prompt ? "prompt" : position < total ? "generated" : "empty";
      shapes.push(svgEl("rect", { x: bx + 3 + (s % cols) * slot, y: by + 3 + Math.floor(s / cols) * slot,
        width: slot - 1, height: slot - 1, class: `kv-slot ${kind}` }));
    }
  }
  const lines = Math.max(1, Math.ceil(numBlocks / perLine));
  const width = Math.min(numBlocks, perLine) * (blockW + 4);
  return el("div", { class: "kv", "data-testid": "kv-view" }, [
    el("p", {}, [el("strong", { "data-testid": "kv-blocks", text: numBlocks }),
      ` KV blocks of ${blockSize} slots held this path's ${total} tokens (one slot per token).`]),
    svgEl("svg", { width, height: lines * (blockH + 4), viewBox: `0 0 ${width} ${lines * (blockH + 4)}`,
      class: "kv-svg", role: "img",
      "aria-label": `${numBlocks} KV-cache blocks` }, shapes),
    el("p", { class: "timeline-legend" }, [el("span", { class: "key cached" }), " prefix cache hit ",
      el("span", { class: "key prompt" }), " prompt ", el("span", { class: "key generated" }), " generated ",
      el("span", { class: "key empty" }), " free slot"]),
  ]);
}

function engineSummary(engine) {
  const usage = engine.num_blocks ? engine.num_blocks_used / engine.num_blocks : 0;
  const rows = [
    ["KV blocks in use now", `${engine.num_blocks_used} of ${engine.num_blocks} (${(usage * 100).toFixed(1)}%)`, "engine-blocks-used"],
    ["requests running / waiting", `${engine.num_running} / ${engine.num_waiting}`, "engine-requests"],
    ["prefix-cache hit rate", `${((engine.prefix_cache_hit_rate || 0) * 100).toFixed(1)}%`, "engine-hit-rate"],
    ["forward passes since start", String(engine.num_forward_passes), "engine-forward-passes"],
    ["block size · dtype · max length", `${engine.block_size} · ${engine.dtype} · ${engine.max_model_len}`, "engine-shape"],
  ];
  return el("div", { class: "engine-summary" }, [
    el("div", { class: "usage-track", role: "meter", "aria-valuemin": 0, "aria-valuemax": engine.num_blocks,
      "aria-valuenow": engine.num_blocks_used, "aria-label": "KV blocks in use" }, [
      el("div", { class: "usage-bar", style: `width:${(usage * 100).toFixed(2)}%` })]),
    el("dl", { class: "stats" }, rows.map(([label, value, testid]) => el("div", { class: "stat" }, [
      el("dt", { text: label }), el("dd", { "data-testid": testid, text: value })]))),
  ]);
}

/* ---------------------------------------------------------------- wiring */

function onTokensKeydown(event) {
  const chips = [...$("tokens").querySelectorAll("[data-testid=token]")];
  const index = chips.indexOf(document.activeElement);
  if (index < 0) return;
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
    const response = await api("/v1/models");
    const body = await response.json();
    state.modelName = body.data && body.data.length ? body.data[0].id : null;
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
  $("temperature").addEventListener("input", () => {
    $("temperature-value").textContent = sliderTemperature().toFixed(2);
    renderWhy();
  });
  $("tokens").addEventListener("keydown", onTokensKeydown);
  $("why").addEventListener("focusin", () => {
    state.isFollowing = false;
  });
  $("temperature-value").textContent = sliderTemperature().toFixed(2);
  loadModelName().then(() => Promise.all([tokenizePrompt().catch(showError), refreshEngine()]));
  render();
}

init();
