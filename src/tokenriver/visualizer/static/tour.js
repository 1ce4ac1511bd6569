"use strict";
/*
 * The guided tour: twelve stops that follow the explainers' story, one claim each, in the order of
 * docs/visualizer.md's walkthrough. A stop arms a prompt and settings through the page's own controls and functions
 * (the requests a click would send, on the live engine), outlines the panel that proves its claim, and fills the
 * claim in with the value that panel shows once the engine answered. The tour computes no number of its own: a
 * stop's `proof` reads what the other modules drew from the server's responses, and returns null until it is there.
 *
 * Each stop declares:
 *   id, title   the stop's name (its walkthrough article, in the page and in docs/visualizer.md, is "Stop N: title");
 *   look        what the outlined panel shows: "what am I looking at";
 *   claim       the explainer's sentence the stop demonstrates;
 *   panel       the panel outlined and scrolled into view; `detail`, a part of it scrolled to once the proof is in;
 *   arm         async: sets the controls and runs what the stop needs; returns what `proof` reads, or null if the
 *               engine refused (the page's error box says why);
 *   proof       the claim's value read from the page, or null while the engine has not answered;
 *   say         the value in words, for the dialog and its live region.
 * Moving on while a stop arms waits for its requests to end before arming the next: no request is aborted.
 */

const TOUR_PROMPT = "The three primary colors are";
// A sentence that a connective ("However", …) may follow: where two draws are likely to part.
const FORK_PROMPT = "The first experiment worked well.";
// Text that repeats: what an n-gram draft would copy, on a server started with drafts.
const REPEAT_PROMPT = "one two three four, one two three four, one two three four, one two";
// The generation settings every stop starts from (panel 5's defaults with a shorter path), by input id.
const TOUR_SETTINGS = {
  temperature: "0.8",
  seed: "7",
  "max-tokens": "12",
  samples: "3",
  "top-k": "0",
  "top-p": "1",
  "min-p": "0",
  "repetition-penalty": "1",
  "trace-top": "12",
  stop: "",
};
const FORK_SETTINGS = { samples: "2" };
const PREVIEW_TEMPERATURE = 1.6;
const LOAD_SIZES = [1, 4];
const TOUR_BEAM_WIDTH = 3;
// How long a stop waits for the engine's answer before saying it has none yet.
const PROOF_TIMEOUT_MS = 180_000;
const PROOF_POLL_MS = 200;

const TOUR_STOPS = [
  {
    id: "tokens",
    title: "Text becomes tokens",
    look: "Panel 1: the prompt as the model receives it, one chip per token, its id under it.",
    claim:
      "A language model never reads text: a tokenizer cuts the text into pieces from a fixed vocabulary, and " +
      "the model reads their ids.",
    panel: "section[aria-labelledby=prompt-heading]",
    arm: async () => {
      await armPrompt(TOUR_PROMPT);
      return { prompt: TOUR_PROMPT };
    },
    proof: (ctx) => {
      const chips = [...document.querySelectorAll("#prompt-tokens [data-testid=prompt-token]")];
      if ($("prompt").value !== ctx.prompt || !chips.length) return null;
      return { count: chips.length, ids: chips.map((chip) => Number(chip.dataset.tokenId)) };
    },
    say: (v) =>
      `“${TOUR_PROMPT}” reaches the model as ${plural(v.count, "token id")}: ${v.ids.slice(0, 12).join(", ")}` +
      `${v.count > 12 ? ", …" : ""}. Every number the model computes starts from these.`,
  },
  {
    id: "passes",
    title: "One forward pass per token",
    look: "Panel 6: the request's forward passes, one bar each, as the engine counted them.",
    claim:
      "The model writes one token per forward pass: to write n tokens it runs n times, each pass taking in " +
      "everything before it.",
    panel: "section[aria-labelledby=engine-heading]",
    detail: "[data-testid=forward-passes]",
    arm: async () => pathContext(await armPath(TOUR_PROMPT)),
    proof: (ctx) => {
      const passes = finishedPathNode(ctx, "#engine [data-testid=num-forward-passes]");
      const generated = document.querySelector("[data-testid=num-generated]");
      if (!passes || !generated) return null;
      return { passes: Number(passes.textContent), generated: parseInt(generated.textContent, 10) };
    },
    say: (v) =>
      `${plural(v.generated, "generated token")}, ${plural(v.passes, "forward pass", "forward passes")}: ` +
      (v.passes === v.generated
        ? "the first over the whole prompt (it also gave the first token), then one more pass for each later token."
        : "the prompt took more than one pass (it came in chunks), then one more pass for each later token."),
  },
  {
    id: "inside",
    title: "Inside the forward pass",
    look:
      "Panel 7: the pass that chose the selected token, from the embedding at the bottom through every layer to " +
      "the logits; each layer's row is its logit lens, what the model would say if it stopped there.",
    claim:
      "A forward pass carries the last position through every layer in turn; stopped after any layer the model " +
      "already leans toward some tokens, and after the last it gives the distribution the next token is drawn from.",
    panel: "section[aria-labelledby=inside-heading]",
    arm: async () => selectHesitantStep(await armPath(TOUR_PROMPT)),
    proof: (ctx) => {
      const stack = document.querySelector("[data-testid=inside-stack]");
      const logits = document.querySelector("[data-testid=inside-logits]");
      if (!stack || !logits || Number(stack.dataset.position) !== ctx.position) return null;
      const layers = stack.querySelectorAll("[data-testid=inside-layer]");
      if (!layers.length) return null;
      const lensText = (row) => row.querySelector("[data-testid=lens-token] .tok-text").textContent;
      return {
        step: ctx.step,
        numLayers: layers.length,
        top: Number(logits.dataset.topTokenId),
        recordedTop: Number(logits.dataset.recordedTopTokenId),
        topText: lensText(layers[layers.length - 1]),
        firstText: lensText(layers[0]),
      };
    },
    say: (v) =>
      `Token ${v.step + 1}: after layer 1 the lens says “${v.firstText}”; after all ${v.numLayers} layers it ` +
      `puts “${v.topText}” on top, ${
        v.top === v.recordedTop
          ? "the token the step itself recorded as the most likely"
          : "while the step recorded another (the readable modules round differently from the fast kernels)"
      }.`,
  },
  {
    id: "why",
    title: "Why this token",
    look:
      "Panel 3: the distribution the selected token was drawn from, as the sampler recorded it at that step: " +
      "each candidate's logit, its raw probability and its final one.",
    claim:
      "The model does not output a word: it outputs a score for every token of its vocabulary, and the next token " +
      "is drawn from the probabilities those scores become.",
    panel: "section[aria-labelledby=why-heading]",
    arm: async () => selectHesitantStep(await armPath(TOUR_PROMPT)),
    proof: (ctx) => {
      const step = document.querySelector("#why [data-testid=why-step]");
      const chosen = document.querySelector("#why [data-testid=candidate][data-chosen=true]");
      if (!step || Number(step.dataset.step) !== ctx.step || shownPathId() !== ctx.branchId || !chosen) return null;
      return {
        step: ctx.step,
        tokenId: Number(chosen.dataset.tokenId),
        text: chosen.querySelector(".tok-text").textContent,
        rank: Number(chosen.dataset.rank),
        probRaw: Number(chosen.dataset.probRaw),
        probFinal: Number(chosen.dataset.probFinal),
        numCandidates: document.querySelectorAll("#why [data-testid=candidate]").length,
      };
    },
    say: (v) =>
      `Token ${v.step + 1}, “${v.text}”, was drawn with probability ${fmtProb(v.probFinal)} (raw ` +
      `${fmtProb(v.probRaw)}, rank ${v.rank}): the least sure step of this path. The bars are ` +
      `${plural(v.numCandidates, "candidate")} of the whole vocabulary's distribution.`,
  },
  {
    id: "temperature",
    title: "Temperature",
    look:
      "Panel 3's preview: the same step replayed by the engine at another temperature (a what-if, labelled " +
      "replay), its bars beside the recorded ones.",
    claim:
      "Temperature divides the scores before they become probabilities: below 1 it sharpens the distribution " +
      "toward the likeliest tokens, above 1 it flattens it.",
    panel: "section[aria-labelledby=why-heading]",
    detail: "[data-testid=preview]",
    arm: async (isLive) => {
      const ctx = selectHesitantStep(await armPath(TOUR_PROMPT));
      if (!ctx) return null;
      const branch = branchById(ctx.branchId);
      await until(() => $("preview-temperature") && preview.key === `${branch.id}:${ctx.step}`);
      if (!isLive()) return null;
      ctx.serial = preview.serial;
      const input = $("preview-temperature");
      input.value = String(PREVIEW_TEMPERATURE);
      input.dispatchEvent(new Event("input"));
      return ctx;
    },
    proof: (ctx) => {
      const top = document.querySelector("#why [data-testid=candidate][data-rank='1']");
      if (Number($("why").dataset.previewSerial || 0) <= ctx.serial || !top || top.dataset.probPreview === "") {
        return null;
      }
      return {
        step: ctx.step,
        tokenId: Number(top.dataset.tokenId),
        text: top.querySelector(".tok-text").textContent,
        probRaw: Number(top.dataset.probRaw),
        probFinal: Number(top.dataset.probFinal),
        probPreview: Number(top.dataset.probPreview),
      };
    },
    say: (v) =>
      `At token ${v.step + 1} the likeliest candidate, “${v.text}”, has probability ${fmtProb(v.probRaw)} as the ` +
      `model scored it (T 1); drawn at T ${TOUR_SETTINGS.temperature} it had ${fmtProb(v.probFinal)}; replayed ` +
      `at T ${PREVIEW_TEMPERATURE} the engine gives it ${fmtProb(v.probPreview)}.`,
  },
  {
    id: "fork",
    title: "The fork",
    look:
      "Panel 4: two samples of one request from the same prompt, aligned token by token; the first token where " +
      "they differ is outlined, with both tokens' probabilities at that step.",
    claim:
      "Because every token is drawn, one prompt gives different outputs: where two draws differ, “however” in " +
      "one and “additionally” in the other, the texts fork and each goes its own way.",
    panel: "section[aria-labelledby=tree-heading]",
    detail: "[data-testid=compare]",
    arm: async () => {
      const samples = await armFork();
      return samples && { ids: samples.map((b) => b.id) };
    },
    proof: (ctx) => {
      const split = document.querySelector("[data-testid=compare-divergence]");
      const isDone = ctx.ids.every((id) => treeRowStatus(id) === "done");
      if (!split || !isDone) return null;
      const texts = [...document.querySelectorAll("[data-testid=compare-item] .compare-text")].map(plainText);
      return {
        ids: ctx.ids,
        step: Number(split.dataset.step),
        tokens: [...document.querySelectorAll("[data-testid=compare-diverge-token]")].map((n) => n.textContent),
        texts,
      };
    },
    say: (v) =>
      v.tokens.length === 2
        ? `Two samples, one prompt, one request: they share ${plural(v.step, "token")}, then one drew ` +
          `“${v.tokens[0]}” and the other “${v.tokens[1]}”, and each went its own way: ` +
          `“${v.texts[0]}” and “${v.texts[1]}”.`
        : `These two draws agreed on every token, “${v.texts[0]}”: the fork is further on.`,
  },
  {
    id: "commitment",
    title: "Commitment, and the corner",
    look:
      "Panel 2: a path forced onto an unlikely token at the fork (outlined), and what the model wrote after it; " +
      "Σ log p sums the log-probabilities of the path's tokens.",
    claim:
      "A drawn token is never taken back: it becomes part of the context, and every later token has to follow " +
      "from it, so one unlikely word can paint the path into a corner.",
    panel: "section[aria-labelledby=output-heading]",
    arm: async (isLive) => {
      const samples = await armFork();
      if (!samples || !isLive()) return null;
      const [parent, other] = samples;
      const path = pathOf(parent);
      const split = firstDivergence(path, pathOf(other));
      const step = split < path.length ? split : 0;
      const candidate = unlikelyCandidate(path[step].trace);
      if (!candidate) return null;
      selectBranch(parent.id, step);
      branchFrom(step, candidate);
      // A branch made by hand moves the focus to its token; made by the tour, the focus stays in the dialog.
      state.focusAfterRender = null;
      await waitIdle();
      return { branchId: currentBranch().id, parentId: parent.id, step };
    },
    proof: (ctx) => {
      const forced = finishedPathNode(ctx, `#tokens [data-testid=token].forced[data-step='${ctx.step}']`);
      const parentLogprob = document.querySelector(
        `[data-testid=tree-row][data-branch='${ctx.parentId}'] [data-testid=tree-logprob]`,
      );
      if (!forced || !parentLogprob) return null;
      const after = [...document.querySelectorAll("#tokens [data-testid=token]")].filter(
        (chip) => Number(chip.dataset.step) > ctx.step,
      );
      return {
        step: ctx.step,
        tokenId: Number(forced.dataset.tokenId),
        text: forced.textContent,
        probRaw: Number(forced.dataset.prob),
        continuation: after.map((chip) => chip.textContent).join(""),
        logprob: Number(document.querySelector("[data-testid=path-logprob]").textContent),
        parentLogprob: Number(parentLogprob.textContent),
      };
    },
    say: (v) =>
      `At token ${v.step + 1} this path was forced onto “${v.text}”, a token the model gave probability ` +
      `${fmtProb(v.probRaw)}. It is never taken back: the model wrote on from it, “${v.continuation}”, and the ` +
      `path's Σ log p is ${v.logprob.toFixed(2)} against ${v.parentLogprob.toFixed(1)} for the sample it left.`,
  },
  {
    id: "kv-cache",
    title: "The KV cache and its memory",
    look:
      "Panel 6: the slots the path's request computed with the KV cache against what an engine without it " +
      "recomputes, and the cache blocks that hold the path, with their memory.",
    claim:
      "The keys and values of every past token stay in the KV cache, so each pass computes only the newest token; " +
      "the price is memory, which grows with every token.",
    panel: "section[aria-labelledby=engine-heading]",
    detail: "[data-testid=kv-compare]",
    arm: async () => pathContext(await armPath(TOUR_PROMPT)),
    proof: (ctx) => {
      const blocks = finishedPathNode(ctx, "[data-testid=kv-blocks]");
      const withCache = document.querySelector("[data-testid=kv-compare-with]");
      const without = document.querySelector("[data-testid=kv-compare-without]");
      const bytes = document.querySelector("[data-testid=kv-bytes] strong");
      if (!blocks || !withCache || !without || !bytes) return null;
      return {
        numBlocks: Number(blocks.textContent),
        withSlots: Number(withCache.dataset.slots),
        withoutSlots: Number(without.dataset.slots),
        bytes: bytes.textContent,
      };
    },
    say: (v) =>
      `With the cache this request computed ${plural(v.withSlots, "KV slot")}; without it, recomputing the ` +
      `context at every step, it would have computed ${plural(v.withoutSlots, "slot")}. The path's keys and values ` +
      `take ${v.bytes}, in ${plural(v.numBlocks, "block")}.`,
  },
  {
    id: "batching",
    title: "Batching: latency against throughput",
    look:
      "Panel 9: one request alone, then four at once (Send K requests), their throughput beside each request's " +
      "time per token, and every forward pass against the number of requests it carried.",
    claim:
      "A forward pass reads all the weights once however many requests it carries, so serving many at once " +
      "multiplies throughput while each request waits a little longer for each of its tokens.",
    panel: "[data-testid=cost-panel]",
    detail: "#cost-batch",
    arm: async (isLive) => {
      await armPrompt(TOUR_PROMPT);
      const since = timeline.lastPass;
      for (const k of LOAD_SIZES) {
        if (!isLive()) return null;
        $("load-requests").value = String(k);
        await runLoad();
      }
      return { since };
    },
    proof: (ctx) => {
      const runs = [...document.querySelectorAll("[data-testid=load-run]")].slice(-LOAD_SIZES.length);
      const batches = [...document.querySelectorAll("[data-testid=batch-point]")]
        .filter((point) => Number(point.dataset.pass) > ctx.since)
        .map((point) => Number(point.dataset.requests));
      const isDone = runs.every(
        (row, i) => row.dataset.state === "done" && row.dataset.requests === String(LOAD_SIZES[i]),
      );
      if (runs.length < LOAD_SIZES.length || !isDone || !batches.length) return null;
      const cells = (row) => [...row.querySelectorAll("td")].map((cell) => cell.textContent);
      return {
        runs: runs.map((row) => ({ k: Number(row.dataset.requests), cells: cells(row) })),
        maxBatch: Math.max(...batches),
      };
    },
    say: (v) => {
      const [alone, together] = v.runs;
      return (
        `${plural(alone.k, "request")} alone: ${alone.cells[1]} tokens/s at ${alone.cells[2]} per token. ` +
        `${together.k} at once: ${together.cells[1]} tokens/s together at ${together.cells[2]} per token each; ` +
        `the engine's passes carried up to ${plural(v.maxBatch, "request")}.`
      );
    },
  },
  {
    id: "speculative",
    title: "Speculative decoding",
    look:
      "Panel 6: the request's forward passes against its tokens, and the engine's speculative setting; panel 2 " +
      "marks each drafted token, accepted or replaced.",
    claim:
      "Cheap guesses of the next few tokens can all be checked in one forward pass of the model: the accepted ones " +
      "come without passes of their own, and the output is exactly what the model alone would write.",
    panel: "section[aria-labelledby=engine-heading]",
    detail: "[data-testid=forward-passes]",
    arm: async () => pathContext(await armPath(REPEAT_PROMPT, { temperature: "0", "max-tokens": "16" })),
    proof: (ctx) => {
      const passes = finishedPathNode(ctx, "#engine [data-testid=num-forward-passes]");
      const generated = document.querySelector("[data-testid=num-generated]");
      const summary = document.querySelector("#engine [data-testid=engine-forward-passes]");
      if (!passes || !generated || !summary) return null;
      const drafts = document.querySelector("#engine [data-testid=engine-speculative]");
      return {
        passes: Number(passes.textContent),
        generated: parseInt(generated.textContent, 10),
        drafts: drafts ? drafts.textContent : null,
      };
    },
    say: (v) =>
      v.drafts
        ? `${plural(v.generated, "token")} in ${plural(v.passes, "forward pass", "forward passes")} (${v.drafts}); ` +
          "greedy, so the text is the model's own argmax at every step."
        : `This server runs without drafts: ${plural(v.generated, "token")} took ` +
          `${plural(v.passes, "forward pass", "forward passes")}. Started with \`tokenriver serve ` +
          "--speculative-draft ngram`, the same greedy text comes in fewer passes.",
  },
  {
    id: "beams",
    title: "Beam search against sampling",
    look:
      "Panel 8: a beam search of width 3 on the prompt, its final ranking and every step of the search, beside " +
      "one sample of the same prompt.",
    claim:
      "Beam search keeps the k likeliest partial outputs instead of drawing one token: it finds likelier text, " +
      "sampling more varied text.",
    panel: "section[aria-labelledby=beams-heading]",
    arm: async () => {
      await armPrompt(TOUR_PROMPT, { "max-tokens": "8" });
      const before = $("beams").dataset.responseId || "";
      $("beam-width").value = String(TOUR_BEAM_WIDTH);
      await runBeams();
      return { before };
    },
    proof: (ctx) => {
      const shown = $("beams").dataset.responseId || "";
      const finals = document.querySelectorAll("[data-testid=beam-final]");
      const beam = document.querySelector("[data-testid=beam-side]");
      const sample = document.querySelector("[data-testid=sample-side]");
      if (!shown || shown === ctx.before || !finals.length || !beam || !sample) return null;
      return {
        numBeams: finals.length,
        numRows: document.querySelectorAll("[data-testid=beam-row]").length,
        beamLogprob: Number(beam.dataset.logprob),
        sampleLogprob: Number(sample.dataset.logprob),
      };
    },
    say: (v) =>
      `The search kept ${plural(v.numBeams, "beam")} through ${plural(v.numRows, "beam row")} of its steps; its ` +
      `best beam has Σ log p ${v.beamLogprob.toFixed(2)}, one sample of the same prompt ` +
      `${v.sampleLogprob.toFixed(2)}.`,
  },
  {
    id: "stop",
    title: "Stop conditions",
    look:
      "Panel 2: the path's status says why it ended; a matched stop string's tokens stay in the path, struck " +
      "through.",
    claim:
      "Generation ends when the model draws its end-of-sequence token, when a stop string appears, or when the " +
      "token limit is reached.",
    panel: "section[aria-labelledby=output-heading]",
    arm: async () => pathContext(await armPath(TOUR_PROMPT, { temperature: "0", "max-tokens": "24", stop: "." })),
    proof: (ctx) => {
      const status = finishedPathNode(ctx, "[data-testid=path-status]");
      return status ? { kind: status.dataset.stopKind, text: status.textContent } : null;
    },
    say: (v) =>
      `Greedy, with “.” as a stop string and 24 tokens at most, this path says: ${v.text}. Force the ` +
      "end-of-sequence token in panel 3 to see the third way.",
  },
];

// index: the stop shown (null: no tour); serial: bumped on every move, so a stop still arming knows it was left.
const tour = { index: null, serial: 0, ctx: null, poll: null };

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Resolve once `test()` holds (checked every 50 ms), or after `ms`. */
async function until(test, ms = 10_000) {
  const deadline = performance.now() + ms;
  while (!test() && performance.now() < deadline) await sleep(50);
}

/** Until nothing the page started runs: a generation, a beam search, a load. */
async function waitIdle() {
  while (isBusy() || beams.isRunning || costView.runs.some((run) => run.running)) await sleep(100);
}

/* ---------------------------------------------------------------- arming, with the page's own functions */

/** The prompt and panel 5's settings, typed in as a user would, then tokenized. */
async function armPrompt(text, settings = {}) {
  clearError();
  $("prompt").value = text;
  $("chat-template").checked = false;
  $("system-row").hidden = true;
  $("constraint-kind").value = "none";
  updateConstraintInput();
  for (const [id, value] of Object.entries({ ...TOUR_SETTINGS, ...settings })) $(id).value = value;
  await tokenizePrompt();
}

/** A new tree for the armed prompt unless the current one is its (the tour asked once, when it started). */
function armTree() {
  if (state.promptIds && !samePrompt(state.promptIds)) startTree(state.promptIds);
}

const SAME_SETTINGS = ["temperature", "seed", "max_tokens", "top_k", "top_p", "min_p", "repetition_penalty", "stop"];

/** A finished path from the armed prompt under the armed settings: the tree's own if it has one, else generated. */
async function armPath(text, settings = {}) {
  await armPrompt(text, settings);
  armTree();
  let params;
  try {
    params = readParams();
  } catch (error) {
    showError(error);
    return null;
  }
  const key = (p) => JSON.stringify(SAME_SETTINGS.map((name) => p[name] ?? null));
  const existing = state.branches.find(
    (b) => b.parentId === null && !b.kind && !b.params.n && b.status === "done" && key(b.params) === key(params),
  );
  if (existing) {
    selectBranch(existing.id, null);
    scheduleRender();
    return existing;
  }
  const firstNew = state.nextBranchNumber;
  await generate();
  const branch = currentBranch();
  return branch && branch.id >= firstNew && branch.status === "done" ? branch : null;
}

function pathContext(branch) {
  return branch && { branchId: branch.id };
}

/** Select the path's least sure token (lowest raw probability): where the model hesitated. */
function selectHesitantStep(branch) {
  if (!branch) return null;
  const path = pathOf(branch);
  const probs = path.map((token) => tokenProb(token) ?? 1);
  const step = probs.indexOf(Math.min(...probs));
  selectBranch(branch.id, step);
  selectStep(step);
  return { branchId: branch.id, step, position: state.treePromptIds.length + step - 1 };
}

/** Two samples of one request from FORK_PROMPT, compared: the tree's own if it has them, else run. */
async function armFork() {
  await armPrompt(FORK_PROMPT, FORK_SETTINGS);
  armTree();
  const group = () => {
    const samples = state.branches.filter((b) => b.parentId === null && b.params.n === 2 && b.status === "done");
    return samples.length >= 2 ? samples.slice(0, 2) : null;
  };
  if (!group()) {
    selectBranch(null, null);
    await samplesFrom(0);
  }
  const samples = group();
  if (!samples) return null;
  state.compareIds = new Set(samples.map((b) => b.id));
  selectBranch(samples[0].id, null);
  scheduleRender();
  return samples;
}

/** The least likely recorded candidate at a step that is neither the token drawn nor an end-of-sequence token. */
function unlikelyCandidate(trace) {
  if (!trace) return null;
  const others = trace.candidates.filter(
    (c) => c.token_id !== trace.chosen_token_id && !isEos(c.token_id) && c.prob_raw > 0,
  );
  return others.sort((a, b) => b.rank - a.rank)[0] || null;
}

/* ---------------------------------------------------------------- reading the page */

/** The id of the path panel 2 shows. */
function shownPathId() {
  const badge = document.querySelector("#path-info .badge");
  return badge ? Number(badge.textContent.replace("path ", "")) : null;
}

/** A node of the page, once panel 2 shows the stop's path finished (null before). */
function finishedPathNode(ctx, selector) {
  const status = document.querySelector("[data-testid=path-status]");
  if (shownPathId() !== ctx.branchId || !status || !status.textContent.startsWith("finished")) return null;
  return document.querySelector(selector);
}

/** A text the page shows with its whitespace made visible (format.js visibleText), in plain words again. */
function plainText(node) {
  return node.textContent.replace(/␣/g, " ").replace(/[↵⇥␍]/g, " ").trim();
}

function treeRowStatus(id) {
  const row = document.querySelector(`[data-testid=tree-row][data-branch='${id}']`);
  return row ? row.dataset.status : null;
}

/* ---------------------------------------------------------------- the dialog */

function startTour() {
  if (tour.index !== null) {
    $("tour").focus();
    return;
  }
  if (state.branches.length) {
    askNewTree(() => goTo(0));
    $("confirm-new-tree-text").textContent =
      `The tour runs its own prompts and settings on the engine and starts new trees: it discards the current ` +
      `${plural(state.branches.length, "path")}.`;
    return;
  }
  goTo(0);
}

async function goTo(index) {
  const serial = ++tour.serial;
  const isLive = () => serial === tour.serial;
  const wasOpen = tour.index !== null;
  tour.index = index;
  tour.ctx = null;
  clearInterval(tour.poll);
  const stop = TOUR_STOPS[index];
  showStop(stop, index);
  if (!wasOpen) $("tour").focus();
  await waitIdle();
  if (!isLive()) return;
  let ctx = null;
  try {
    ctx = await stop.arm(isLive);
  } catch (error) {
    showError(error);
  }
  if (!isLive()) return;
  if (!ctx) {
    setProof("failed", "The engine did not answer this stop (the error box says why). Back or Next to go on.");
    return;
  }
  tour.ctx = ctx;
  setProof("waiting", "Waiting for the engine's answer…");
  const deadline = performance.now() + PROOF_TIMEOUT_MS;
  tour.poll = setInterval(() => {
    if (!isLive()) return;
    const value = stop.proof(ctx);
    if (value === null) {
      if (performance.now() > deadline) {
        clearInterval(tour.poll);
        setProof("failed", "No answer from the engine yet. Restart the stop with Back and Next.");
      }
      return;
    }
    clearInterval(tour.poll);
    setProof("ready", stop.say(value), value);
    // A reader who went to the walkthrough meanwhile stays there.
    if ($("walkthrough").contains(document.activeElement)) return;
    // Again now: the panels above it grew while the engine answered.
    const detail = stop.detail && document.querySelector(stop.detail);
    const target = detail || document.querySelector(stop.panel);
    target.scrollIntoView({ block: detail ? "center" : "start", behavior: scrollBehavior() });
  }, PROOF_POLL_MS);
}

function showStop(stop, index) {
  const box = $("tour");
  box.hidden = false;
  box.dataset.stop = stop.id;
  box.dataset.index = index;
  $("tour-start").setAttribute("aria-expanded", "true");
  $("tour-count").textContent = `Stop ${index + 1} of ${TOUR_STOPS.length}`;
  $("tour-title").textContent = stop.title;
  $("tour-look").textContent = stop.look;
  $("tour-claim").textContent = `“${stop.claim}”`;
  setProof("arming", "Arming the engine: the stop sends its requests…");
  const link = $("tour-doc");
  link.href = `#${walkthroughId(index)}`;
  link.textContent = `the explainer's sentence (walkthrough, stop ${index + 1})`;
  $("tour-back").setAttribute("aria-disabled", String(index === 0));
  $("tour-next").textContent = index === TOUR_STOPS.length - 1 ? "Finish" : "Next →";
  document.querySelectorAll(".tour-highlight").forEach((node) => node.classList.remove("tour-highlight"));
  const panel = document.querySelector(stop.panel);
  panel.classList.add("tour-highlight");
  panel.scrollIntoView({ block: "start", behavior: scrollBehavior() });
}

/** The stop's proof, in words (the live region reads it once) and as data for whoever checks it. */
function setProof(phase, text, value) {
  const node = $("tour-proof");
  node.dataset.phase = phase;
  node.dataset.ready = String(phase === "ready");
  node.dataset.value = value === undefined ? "" : JSON.stringify(value);
  node.textContent = text;
}

function scrollBehavior() {
  return window.matchMedia("(prefers-reduced-motion: reduce)").matches ? "auto" : "smooth";
}

function nextStop() {
  if (tour.index === null) return;
  if (tour.index === TOUR_STOPS.length - 1) endTour();
  else goTo(tour.index + 1);
}

function previousStop() {
  if (tour.index !== null && tour.index > 0) goTo(tour.index - 1);
}

/** Leave the tour: the page stays as the last stop armed it; focus goes back to the Start button. */
function endTour() {
  tour.serial += 1;
  tour.index = null;
  tour.ctx = null;
  clearInterval(tour.poll);
  $("tour").hidden = true;
  $("walkthrough").style.paddingBottom = "";
  $("tour-start").setAttribute("aria-expanded", "false");
  document.querySelectorAll(".tour-highlight").forEach((node) => node.classList.remove("tour-highlight"));
  $("tour-start").focus();
}

/* ---------------------------------------------------------------- the walkthrough */

function walkthroughId(index) {
  return `walkthrough-stop-${index + 1}`;
}

/**
 * The walkthrough in the page, one article per stop from TOUR_STOPS: its title, the explainer's sentence it
 * demonstrates and what its panel shows. The server serves the page and not docs/, so this is what the dialog links;
 * docs/visualizer.md holds the same sentences for readers of the repository. Collapsed until a link opens it.
 */
function buildWalkthrough() {
  const articles = TOUR_STOPS.map((stop, index) => {
    const id = walkthroughId(index);
    return el("article", { id, tabindex: "-1", "aria-labelledby": `${id}-title` }, [
      el("h3", { id: `${id}-title`, text: `Stop ${index + 1}: ${stop.title}` }),
      el("blockquote", { class: "tour-claim" }, el("p", { "data-testid": "walkthrough-claim", text: stop.claim })),
      el("p", { class: "hint", text: stop.look }),
    ]);
  });
  const summary = el("summary", { text: "Walkthrough: the explainers' sentences" });
  const section = el(
    "section",
    // Below the layout's grid, with its outer spacing.
    { id: "walkthrough", class: "panel", "aria-label": "Walkthrough", style: "margin: 0 0.7rem 0.7rem" },
    el("details", {}, [summary, ...articles]),
  );
  document.querySelector("main").after(section);
}

/**
 * Follow the dialog's link to an article of the walkthrough: open it, scroll to the article and move the focus there.
 * The walkthrough ends the page, where the dialog floats: it makes room below itself as tall as the dialog, so that
 * the last stops' articles scroll clear of it.
 */
function showWalkthroughArticle(event) {
  event.preventDefault();
  const article = document.getElementById(event.currentTarget.hash.slice(1));
  const section = $("walkthrough");
  section.querySelector("details").open = true;
  section.style.paddingBottom = `${innerHeight - $("tour").getBoundingClientRect().top}px`;
  scrollToArticle(article);
  article.focus({ preventScroll: true });
}

/**
 * Scroll an article of the walkthrough to the top of the window, where the dialog leaves it clear. The panels above
 * the walkthrough may still be filling in as it scrolls (panel 7's inspection arrives after the stop's proof): once
 * the article is on screen the browser's scroll anchoring keeps it in place, but a smooth scroll under way ends where
 * the article was when it began, and a panel that grew above leaves the article that much lower, behind the dialog.
 * So until the scroll ends, the page above changing height puts the article straight back at the top; a reader who
 * leaves the article meanwhile (the dialog's next stop scrolls elsewhere) is not pulled back to it.
 */
function scrollToArticle(article) {
  const main = document.querySelector("main");
  let height = main.offsetHeight;
  const follow = new ResizeObserver(() => {
    if (main.offsetHeight === height) return;
    height = main.offsetHeight;
    article.scrollIntoView({ block: "start" });
  });
  const stop = () => {
    follow.disconnect();
    removeEventListener("scrollend", stop);
    article.removeEventListener("blur", stop);
  };
  follow.observe(main);
  addEventListener("scrollend", stop);
  article.addEventListener("blur", stop);
  article.scrollIntoView({ block: "start", behavior: scrollBehavior() });
}

function onTourKeydown(event) {
  const moves = { Escape: endTour, ArrowRight: nextStop, ArrowLeft: previousStop };
  if (!(event.key in moves)) return;
  event.preventDefault();
  moves[event.key]();
}

document.addEventListener("DOMContentLoaded", () => {
  buildWalkthrough();
  $("tour-doc").addEventListener("click", showWalkthroughArticle);
  $("tour-start").addEventListener("click", startTour);
  $("tour-next").addEventListener("click", nextStop);
  $("tour-back").addEventListener("click", previousStop);
  $("tour-restart").addEventListener("click", () => goTo(0));
  $("tour-skip").addEventListener("click", endTour);
  $("tour").addEventListener("keydown", onTourKeydown);
  // Escape with the focus nowhere in particular (after a click on the page's background) leaves the tour too.
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && tour.index !== null && document.activeElement === document.body) endTour();
  });
});
