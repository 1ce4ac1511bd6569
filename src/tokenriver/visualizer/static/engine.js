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
  if (m) {
    parts.push(forwardPasses(m, branch));
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
  const labelled = [...timeline.requestLabels.entries()].find(
    ([, label]) => Array.isArray(label) && label.includes(branch),
  );
  const prefix = labelled ? `${labelled[0]}-` : null;
  const isPrompt = (pass) => pass.rows.some((r) => r.is_prompt && r.request_id.startsWith(prefix));
  const prefill = Math.max(1, prefix ? timeline.passes.filter(isPrompt).length : 0);
  return { prefill, decode: Math.max(0, m.num_forward_passes - prefill) };
}

function forwardPasses(m, branch) {
  const siblings = branch.params.n ? state.branches.filter((b) => b.params.group === branch.params.group) : [branch];
  // An n-sample request's metrics cover all its samples: they are shown as the request's, beside this path's share.
  const generated = m.num_generated_tokens;
  const passes = m.num_forward_passes;
  const split = passSplit(m, branch);
  const decodePasses = split.decode;
  const prefillPasses = split.prefill;
  const computed = m.num_prompt_tokens - m.num_cached_tokens;
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
      ` ${passes === 1 ? "forward pass" : "forward passes"} for ${plural(generated, "generated token")}: ` +
        `${prefillPasses} for the prompt (${plural(computed, "token")} computed`,
      m.num_cached_tokens ? `, ${plural(m.num_cached_tokens, "token")} reused from the prefix cache` : "",
      `; it also yields the first token) + ${plural(decodePasses, "decode pass", "decode passes")}.`,
    ]),
    perPathFacts(m, branch, siblings, passes),
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

/** This path's own figures beside the request's: per sample of an n-sample request, and per pass under speculation. */
function perPathFacts(m, branch, siblings, passes) {
  const facts = [];
  if (siblings.length > 1) {
    const own = siblings.map((b) => generatedCount(b));
    facts.push([
      `this path (sample ${branch.params.choiceIndex + 1} of ${siblings.length})`,
      `${plural(generatedCount(branch), "generated token")}; the request's ${m.num_generated_tokens} = ${own.join(" + ")}, ` +
        `its ${plural(passes, "forward pass", "forward passes")} computed the samples together`,
      "path-share",
    ]);
  }
  if (m.num_draft_tokens) {
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
