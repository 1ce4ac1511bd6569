"use strict";
/*
 * Panel 6: the engine view. The selected request's forward passes and KV blocks (with prefix-cache hits and
 * bytes), the batching timeline from timeline.js, and the engine's live counters from GET /v1/engine.
 */

/* ---------------------------------------------------------------- engine view */

function renderEngine() {
  const box = $("engine");
  const branch = currentBranch();
  const engine = state.engine;
  const parts = [
    el("p", {
      class: "hint",
      text:
        "Prefill computes the whole prompt in one forward pass (or a few " +
        "chunks) and yields the first token; every later token needs one more forward pass (decode). The KV cache " +
        "keeps each token's keys and values in fixed-size blocks so no pass recomputes the past.",
    }),
  ];
  parts.push(passTimeline());
  const m = branch && branch.metrics;
  if (branch && hasPendingTokens(branch)) {
    parts.push(
      el("p", {
        "data-testid": "engine-pending",
        text:
          `Slow motion: ${branch.playback.next} of the request's ${plural(branch.playback.tokens.length, "token")} ` +
          "shown; its counts show with its last token.",
      }),
    );
  } else if (m) {
    parts.push(forwardPasses(m, branch));
    parts.push(kvComparison(m, branch));
    if (engine) parts.push(kvBlocks(m, engine.block_size, branch));
  } else if (branch && branch.status === "streaming") {
    parts.push(
      el("p", {
        "data-testid": "engine-pending",
        text: `${plural(pathOf(branch).length, "token")} so far; the request's counts arrive with its last token.`,
      }),
    );
  } else if (branch && branch.status !== "streaming") {
    parts.push(
      el("p", {
        "data-testid": "engine-pending",
        text:
          `${statusText(branch)} after ${plural(pathOf(branch).length, "token")}. ` +
          "A request that did not finish sends no final counts; the engine numbers below are live.",
      }),
    );
  }
  if (engine) parts.push(engineSummary(engine));
  else if (state.engineError)
    parts.push(el("p", { class: "hint", text: `Engine stats unavailable: ${state.engineError}` }));
  setChildren(box, ...parts);
}

/**
 * The request's passes split into prompt passes and decode passes. The prompt's passes come from the pass log
 * when it still holds them (a long prompt is cut into chunks); the rest of the request's passes decoded, each
 * yielding one token, or several under speculative decoding.
 */
function passSplit(m, branch) {
  const prefill = Math.max(1, passRowsOf(branch).filter((r) => r.row.is_prompt).length);
  return { prefill, decode: Math.max(0, m.num_forward_passes - prefill) };
}

/**
 * One sample's own passes, from the pass log rows of its engine request (`<id>-0#<i>`): the samples of an
 * n-sample request are separate engine requests that share forward passes, so each has its own count.
 */
function samplePasses(branch) {
  const rows = passRowsOf(branch);
  const prompt = rows.filter((r) => r.row.is_prompt);
  return {
    passes: rows.map((r) => r.pass),
    prefill: prompt.length,
    decode: rows.length - prompt.length,
    promptTokens: prompt.reduce((sum, r) => sum + r.row.num_tokens, 0),
  };
}

function forwardPasses(m, branch) {
  const siblings = branch.params.n ? state.branches.filter((b) => b.params.group === branch.params.group) : [branch];
  // An n-sample request's metrics cover all its samples: they are shown as the request's, beside this path's share.
  const own = siblings.length > 1 ? samplePasses(branch) : null;
  const isOwn = Boolean(own && own.passes.length);
  // A sample's figures are its own (its passes from the pass log); the request's stand beside them.
  const generated = isOwn ? generatedCount(branch) : m.num_generated_tokens;
  const passes = isOwn ? own.passes.length : m.num_forward_passes;
  const split = isOwn ? own : passSplit(m, branch);
  const decodePasses = split.decode;
  const prefillPasses = split.prefill;
  const computed = isOwn ? own.promptTokens : m.num_prompt_tokens - m.num_cached_tokens;
  const ttft = m.time_to_first_token || 0;
  const tpot = m.time_per_output_token || 0;
  const total = ttft + tpot * decodePasses || 1;
  const width = 600;
  const x = (seconds) => (seconds / total) * width;
  const shapes = [
    svgEl("rect", { x: 0, y: 4, width: Math.max(2, x(ttft)), height: 26, class: "pass prefill" }, [
      svgEl("title", {
        text: `prefill: ${plural(computed, "prompt token")} in ${plural(prefillPasses, "pass", "passes")}, ${fmtMs(ttft)}`,
      }),
    ]),
  ];
  for (let i = 0; i < decodePasses; i += 1) {
    shapes.push(
      svgEl("rect", {
        x: x(ttft + i * tpot) + 0.5,
        y: 4,
        width: Math.max(1, x(tpot) - 1),
        height: 26,
        class: "pass decode",
        "data-testid": "decode-pass",
      }),
    );
  }
  return el("div", { class: "passes", "data-testid": "forward-passes" }, [
    el("p", { class: "big-fact" }, [
      el("strong", { "data-testid": "num-forward-passes", text: passes }),
      ` ${passes === 1 ? "forward pass" : "forward passes"} for ${isOwn ? "this path's " : ""}${plural(generated, "generated token")}: ` +
        `${prefillPasses} for the prompt (${plural(computed, "token")} computed`,
      !isOwn && m.num_cached_tokens ? `, ${plural(m.num_cached_tokens, "token")} reused from the prefix cache` : "",
      `; it also yields the first token) + ${plural(decodePasses, "decode pass", "decode passes")}.`,
    ]),
    perPathFacts(m, branch, siblings),
    svgEl(
      "svg",
      {
        viewBox: `0 0 ${width} 34`,
        class: "timeline",
        preserveAspectRatio: "none",
        role: "img",
        "aria-label": `time line: prefill ${fmtMs(ttft)}, then ${plural(decodePasses, "decode pass", "decode passes")} of ${fmtMs(tpot)}`,
      },
      shapes,
    ),
    el("p", { class: "timeline-legend" }, [
      el("span", { class: "key prefill" }),
      ` prefill ${fmtMs(ttft)} `,
      el("span", { class: "key decode" }),
      ` decode ${fmtMs(tpot)} per token (one bar per forward pass)`,
    ]),
  ]);
}

/**
 * With and without the KV cache, for this path's request: what each of its passes computed (the pass log), against
 * what an engine without a KV cache (EngineConfig.use_kv_cache=False) recomputes at the same step: the whole
 * context, prompt + the k tokens generated so far. Arithmetic from the pass log, not a second run; the time
 * without the cache is this request's own prefill rate times the slots recomputed.
 */
function kvComparison(m, branch) {
  const rows = passRowsOf(branch);
  const generated = generatedCount(branch);
  if (!rows.length || generated < 1) return null;
  const context = m.num_prompt_tokens;
  const promptSlots = rows.filter((r) => r.row.is_prompt).reduce((sum, r) => sum + r.row.num_tokens, 0);
  const decodeRows = rows.filter((r) => !r.row.is_prompt);
  // Step k (0-based): with the cache, the prompt's pass computes the uncached prompt, later passes their logged
  // rows; without it, every step recomputes the context it starts from.
  const steps = Array.from({ length: generated }, (_, k) => ({
    withCache: k === 0 ? promptSlots : decodeRows[k - 1] ? decodeRows[k - 1].row.num_tokens : 1,
    without: context + k,
  }));
  const totalWith = steps.reduce((sum, s) => sum + s.withCache, 0);
  const totalWithout = steps.reduce((sum, s) => sum + s.without, 0);
  const perToken = prefillPerToken(m);
  const last = steps[steps.length - 1];
  const height = 70;
  const barW = Math.max(3, Math.min(14, Math.floor(560 / generated / 2)));
  const width = generated * (2 * barW + 2);
  const y = (slots) => (slots / last.without) * (height - 4);
  const shapes = steps.flatMap((s, k) => [
    svgEl("rect", {
      x: k * (2 * barW + 2),
      y: height - y(s.without),
      width: barW,
      height: y(s.without),
      class: "kv-bar without",
      "data-testid": "kv-compare-step",
      "data-step": k,
      "data-with": s.withCache,
      "data-without": s.without,
    }),
    svgEl("rect", {
      x: k * (2 * barW + 2) + barW,
      y: height - Math.max(1, y(s.withCache)),
      width: barW,
      height: Math.max(1, y(s.withCache)),
      class: "kv-bar with",
    }),
  ]);
  return el("div", { class: "kv-compare", "data-testid": "kv-compare" }, [
    el("h3", { text: "With and without the KV cache, for this path" }),
    el("p", {}, [
      "With the cache this request computed ",
      el("strong", {
        "data-testid": "kv-compare-with",
        "data-slots": totalWith,
        text: plural(totalWith, "KV slot"),
      }),
      ` for ${plural(generated, "token")}: the prompt once (${plural(promptSlots, "slot")}), then one new slot per pass. ` +
        "Without it, every step recomputes the whole context: ",
      el("strong", {
        "data-testid": "kv-compare-without",
        "data-slots": totalWithout,
        text: plural(totalWithout, "slot"),
      }),
      ` (${context} + ${context + 1} + … + ${last.without}), growing with every token: O(n²) work for n tokens ` +
        "against O(n).",
    ]),
    perToken !== null && m.time_per_output_token
      ? el("p", { "data-testid": "kv-compare-time" }, [
          `Time per step: ${fmtMs(m.time_per_output_token)} measured with the cache; without it step k would take about ` +
            `${fmtMs(perToken * context)} to ${fmtMs(perToken * last.without)} at this request's prefill rate of ` +
            `${fmtMs(perToken)} per token (an estimate, not measured).`,
        ])
      : null,
    svgEl(
      "svg",
      {
        width,
        height,
        viewBox: `0 0 ${width} ${height}`,
        class: "kv-compare-svg",
        role: "img",
        "aria-label": `per step: ${context} to ${last.without} slots recomputed without the cache, 1 new slot with it`,
      },
      shapes,
    ),
    el("p", { class: "timeline-legend" }, [
      el("span", { class: "key without" }),
      " slots recomputed at each step without a KV cache ",
      el("span", { class: "key with" }),
      " new slots computed with it (the pass log)",
      el("br"),
      el("span", {
        class: "hint",
        text: "Arithmetic from the engine's pass log: the server runs with its KV cache; no request ran without it.",
      }),
    ]),
  ]);
}

/** This path's own figures beside the request's: per sample of an n-sample request, and per pass under speculation. */
function perPathFacts(m, branch, siblings) {
  const facts = [];
  if (siblings.length > 1) {
    const tokens = siblings.map((b) => generatedCount(b));
    const counts = siblings.map((b) => samplePasses(b).passes);
    const shared = new Set(counts.flat());
    facts.push([
      `this path (sample ${branch.params.choiceIndex + 1} of ${siblings.length})`,
      `${plural(generatedCount(branch), "generated token")} in ${plural(counts[branch.params.choiceIndex].length, "forward pass", "forward passes")}; ` +
        `the request's ${m.num_generated_tokens} tokens = ${tokens.join(" + ")}; its ` +
        `${plural(m.num_forward_passes, "forward pass", "forward passes")} carried the samples together ` +
        `(${counts.map((c) => c.length).join(", ")} passes each, ${shared.size} distinct)`,
      "path-share",
    ]);
  }
  if (m.num_draft_tokens) {
    const passes = m.num_forward_passes;
    const decode = Math.max(1, passes - 1);
    facts.push([
      "speculative decoding",
      `${(m.num_generated_tokens / passes).toFixed(2)} tokens per pass; ` +
        `${(m.num_accepted_draft_tokens / decode).toFixed(2)} drafts accepted per decode pass ` +
        `(${m.num_accepted_draft_tokens} of ${plural(m.num_draft_tokens, "draft")})`,
      "spec-per-pass",
    ]);
  }
  return facts.length ? factList(facts) : null;
}

function kvBlocks(m, blockSize, branch) {
  // An n-sample request's counts cover every sample: this path holds the prompt's blocks and its own tokens.
  const isShare = Boolean(branch.params.n);
  const cached = m.num_cached_tokens || 0;
  const prompt = m.num_prompt_tokens;
  const total = prompt + (isShare ? generatedCount(branch) : m.num_generated_tokens);
  const numBlocks = isShare ? Math.ceil(total / blockSize) : m.kv_blocks;
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
    shapes.push(
      svgEl(
        "rect",
        {
          x: bx,
          y: by,
          width: blockW,
          height: blockH,
          rx: 2,
          class: `kv-block${isHit ? " hit" : ""}`,
          "data-testid": "kv-block",
          "data-hit": isHit ? "true" : "false",
        },
        [
          svgEl("title", {
            text: `block ${b + 1}: tokens ${b * blockSize + 1}–${(b + 1) * blockSize}${isHit ? ", a prefix-cache hit" : ""}`,
          }),
        ],
      ),
    );
    for (let s = 0; s < blockSize; s += 1) {
      const position = b * blockSize + s;
      const kind =
        position < cached ? "cached" : position < prompt ? "prompt" : position < total ? "generated" : "empty";
      shapes.push(
        svgEl("rect", {
          x: bx + 3 + (s % cols) * slot,
          y: by + 3 + Math.floor(s / cols) * slot,
          width: slot - 1,
          height: slot - 1,
          class: `kv-slot ${kind}`,
        }),
      );
    }
  }
  const lines = Math.max(1, Math.ceil(numBlocks / perLine));
  const width = Math.max(1, Math.min(numBlocks, perLine) * (blockW + 4));
  const bytesPerToken = state.info ? state.info.kv_bytes_per_token : null;
  const hits = Math.floor(cached / blockSize);
  return el("div", { class: "kv", "data-testid": "kv-view" }, [
    el("p", {}, [
      el("strong", { "data-testid": "kv-blocks", text: numBlocks }),
      ` ${numBlocks === 1 ? "KV block" : "KV blocks"} of ${plural(blockSize, "slot")} held this path's ${plural(total, "token")} (one slot per token); `,
      el("span", {
        "data-testid": "kv-hits",
        text: `${hits} of them ${hits === 1 ? "was a prefix-cache hit" : "were prefix-cache hits"}`,
      }),
      ".",
    ]),
    bytesPerToken
      ? el("p", { "data-testid": "kv-bytes" }, [
          `KV memory: ${fmtBytes(bytesPerToken)} per token (keys and values of every layer); this path's ${plural(total, "token")} take `,
          el("strong", { text: fmtBytes(bytesPerToken * total) }),
          `, its ${numBlocks === 1 ? "block reserves" : "blocks reserve"} ${fmtBytes(bytesPerToken * blockSize * numBlocks)}.`,
        ])
      : null,
    svgEl(
      "svg",
      {
        width,
        height: lines * (blockH + 4),
        viewBox: `0 0 ${width} ${lines * (blockH + 4)}`,
        class: "kv-svg",
        role: "img",
        "aria-label": `${plural(numBlocks, "KV-cache block")}`,
      },
      shapes,
    ),
    el("p", { class: "timeline-legend" }, [
      el("span", { class: "key cached" }),
      " prefix cache hit ",
      el("span", { class: "key prompt" }),
      " prompt ",
      el("span", { class: "key generated" }),
      " generated ",
      el("span", { class: "key empty" }),
      " free slot",
    ]),
  ]);
}

function engineSummary(engine) {
  const usage = engine.num_blocks ? engine.num_blocks_used / engine.num_blocks : 0;
  const facts = [
    [
      "KV blocks in use now",
      `${engine.num_blocks_used} of ${plural(engine.num_blocks, "block")} (${fmtPercent(usage)})`,
      "engine-blocks-used",
    ],
    ["requests running / waiting", `${engine.num_running} / ${engine.num_waiting}`, "engine-requests"],
    ["prefix-cache hit rate", fmtPercent(engine.prefix_cache_hit_rate || 0), "engine-hit-rate"],
    ["forward passes since start", String(engine.num_forward_passes), "engine-forward-passes"],
    [
      "KV block size · KV dtype · context",
      `${plural(engine.block_size, "token")} per block · ${engine.kv_cache_dtype} keys and values · ${plural(engine.max_model_len, "token")} max`,
      "engine-shape",
    ],
  ];
  if (state.info) facts.push(["KV memory per token", fmtBytes(state.info.kv_bytes_per_token), "engine-kv-bytes"]);
  if (engine.speculative_draft) {
    facts.push([
      "speculative decoding",
      `${engine.speculative_draft}, ${plural(engine.num_speculative_tokens, "draft token")} per pass; ` +
        `${engine.num_accepted_draft_tokens} of ${engine.num_draft_tokens} accepted`,
      "engine-speculative",
    ]);
  }
  return el("div", { class: "engine-summary" }, [
    el(
      "div",
      {
        class: "usage-track",
        role: "meter",
        "aria-valuemin": 0,
        "aria-valuemax": engine.num_blocks,
        "aria-valuenow": engine.num_blocks_used,
        "aria-label": "KV blocks in use",
      },
      [el("div", { class: "usage-bar", style: `width:${(usage * 100).toFixed(2)}%` })],
    ),
    factList(facts),
  ]);
}
