"use strict";
/*
 * Panel 3 and the popover: why a token was chosen. The recorded trace of the step, its raw logits, the raw and
 * final distributions (one-hot for a greedy step), the grammar stage of a constrained path, the draw, a
 * speculative verdict, and forcing any token id.
 * The preview box and the stage table come from replay.js.
 */

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
  const rows = trace.candidates
    .slice()
    .sort((a, b) => a.rank - b.rank)
    .slice(0, 5)
    .map((c) =>
      el(
        "li",
        {
          class: c.token_id === trace.chosen_token_id ? "chosen" : "",
          "data-testid": "popover-candidate",
        },
        [
          el("span", { class: "tok-text", text: visibleText(c.text) }),
          el("span", {
            class: "num",
            text: `${fmtPercent(c.prob_raw)} raw · ${fmtPercent(final.get(c.token_id) ?? 0)} final`,
          }),
        ],
      ),
    );
  box.replaceChildren(
    el("p", { class: "popover-head", text: `token ${step + 1}: top ${plural(rows.length, "candidate")}` }),
    el("ol", {}, rows),
    el("button", {
      type: "button",
      class: "small",
      text: "close",
      "aria-label": "close the candidates box",
      onclick: () => {
        state.popoverStep = null;
        scheduleRender();
      },
    }),
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
    if (greedy) map.set(c.token_id, c.token_id === trace.chosen_token_id ? 1 : 0);
    else if (c.prob_final !== null) map.set(c.token_id, c.prob_final);
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
    box.replaceChildren(
      el("p", { class: "hint", text: "Generate, then select a token to see the distribution it was drawn from." }),
    );
    return;
  }
  const token = path[step];
  const trace = token.trace;
  withFocusKept(box, () => {
    const nav = el("div", { class: "step-nav" }, [
      el("button", {
        type: "button",
        class: "small",
        "data-testid": "prev-step",
        "data-focus-key": "prev-step",
        disabled: step === 0,
        onclick: () => selectStep(step - 1),
        text: "← previous token",
      }),
      el("span", { "data-testid": "why-step", "data-step": step, text: `token ${step + 1} of ${path.length}` }),
      el("button", {
        type: "button",
        class: "small",
        "data-testid": "next-step",
        "data-focus-key": "next-step",
        disabled: step >= path.length - 1,
        onclick: () => selectStep(step + 1),
        text: "next token →",
      }),
      el("button", {
        type: "button",
        class: "small",
        "data-testid": "samples-from-here",
        "data-focus-key": "samples",
        disabled: isBusy(),
        onclick: () => samplesFrom(step),
        text: `${numberInput("samples") ?? "N"} samples from here`,
        title: "continue after this token N times at once: the requests share this prefix's KV blocks",
      }),
    ]);
    if (!trace) {
      box.replaceChildren(
        nav,
        el("p", { text: `“${token.text}” (id ${token.id}): no trace was recorded for this token.` }),
      );
      return;
    }
    setChildren(
      box,
      nav,
      whySummary(token, trace, branch),
      grammarNote(trace),
      speculativeNote(trace),
      drawNote(trace),
      whyBars(step, trace),
      whyFootnote(trace),
      forceTokenForm(step),
      previewPanel(branch, step),
    );
  });
}

function whySummary(token, trace, branch) {
  const params = branch.params;
  const how = token.isForced
    ? "forced: you picked it to branch"
    : trace.method === "greedy"
      ? "greedy (T = 0): the argmax, no random draw"
      : `sampled at T = ${trace.temperature}`;
  return factList(
    [
      ["chosen", `“${visibleText(token.text)}” (id ${token.id})`, "why-chosen"],
      ["rank", `${trace.chosen_rank}`, "why-rank"],
      ["p raw (model)", fmtProb(trace.chosen_prob_raw), "why-prob-raw"],
      [
        "p final (drawn from)",
        finalDistribution(trace).has(trace.chosen_token_id)
          ? fmtProb(finalDistribution(trace).get(trace.chosen_token_id))
          : "not recorded (outside the step's candidates)",
        "why-prob-final",
      ],
      [
        "entropy raw → final",
        `${trace.entropy_raw.toFixed(2)} → ${trace.method === "greedy" ? "0.00" : trace.entropy_final.toFixed(2)} nats`,
        "why-entropy",
      ],
      ["tokens kept by the filters", keptText(trace), "why-kept"],
      ["how", how, "why-method"],
      ["path settings", settingsText(params), "why-settings"],
    ],
    "stats why-summary",
  );
}

/** What the grammar stage did at this step (trace extra.grammar): the tokens it allowed and the mass it removed. */
function grammarNote(trace) {
  const grammar = trace.extra && trace.extra.grammar;
  if (!grammar) return null;
  const vocabSize = state.info && state.info.vocab_size;
  const numRemovedShown = trace.candidates.filter((c) => c.removed_by === "grammar").length;
  return el(
    "div",
    {
      class: "grammar-note",
      "data-testid": "why-grammar",
      "data-num-allowed": grammar.num_allowed,
      "data-mass-removed": grammar.mass_removed,
      "data-forced": grammar.forced ? "true" : "false",
    },
    [
      el("p", {}, [
        el("strong", { text: "Grammar stage: " }),
        "before temperature, the path's constraint removed every token that cannot continue the text; " +
          "what it allowed was renormalised.",
      ]),
      factList(
        [
          [
            "tokens allowed",
            vocabSize ? `${grammar.num_allowed} of ${plural(vocabSize, "token")}` : plural(grammar.num_allowed, "token"),
            "grammar-allowed",
          ],
          // Summed in float32, a mass of all but nothing can come out a hair above 1.
          ["probability removed", fmtShare(Math.min(1, grammar.mass_removed)), "grammar-mass-removed"],
          [
            "forced",
            grammar.forced ? "yes: the grammar allowed this token only" : "no: the model chose among the allowed",
            "grammar-forced",
          ],
          [
            "candidates removed",
            `${numRemovedShown} of the ${plural(trace.candidates.length, "candidate")} below`,
            "grammar-removed-shown",
          ],
        ],
        "stats grammar-facts",
      ),
      allowedList(trace),
      numRemovedShown
        ? el("p", {
            class: "hint",
            text: "A branch from a candidate the grammar removed leaves the constraint: that path can only end.",
          })
        : null,
    ],
  );
}

/**
 * The tokens the grammar allowed among the candidates, most likely first, each with its probability right after
 * the grammar stage (the recorded stage; without it, the final probability).
 */
function allowedList(trace) {
  const stage = (trace.stages || []).find((s) => s.name === "grammar");
  const final = finalDistribution(trace);
  const allowed = trace.candidates
    .map((c, i) => ({ c, p: stage ? stage.probs[i] : (final.get(c.token_id) ?? 0) }))
    .filter(({ c, p }) => (stage ? p > 0 : c.removed_by !== "grammar"))
    .sort((a, b) => b.p - a.p);
  const mass = allowed.reduce((sum, a) => sum + a.p, 0);
  return el("div", { class: "allowed-tokens" }, [
    el("p", {
      text:
        `Allowed here: ${plural(allowed.length, "token")} of the candidates, holding ${fmtShare(Math.min(1, mass))} ` +
        `of the distribution ${stage ? "after the grammar stage" : "drawn from"}:`,
    }),
    el(
      "ul",
      { class: "allowed-list", "data-testid": "grammar-allowed-tokens" },
      allowed.map(({ c, p }) =>
        el("li", { "data-testid": "grammar-allowed-token", "data-token-id": c.token_id, "data-prob": p }, [
          el("span", { class: "tok-text", text: visibleText(c.text) }),
          ` ${fmtProb(p)}`,
        ]),
      ),
    ),
  ]);
}

// Texts of rejected drafts that were not among their step's candidates, by token id (fetched once each).
const draftTexts = new Map();

/** A draft token's text: from the step's candidates, else from /detokenize (the panel redraws when it comes). */
function draftText(tokenId, trace) {
  const candidate = trace.candidates.find((c) => c.token_id === tokenId);
  if (candidate) return candidate.text;
  if (!draftTexts.has(tokenId)) {
    draftTexts.set(tokenId, `id ${tokenId}`);
    apiJson("/detokenize", { tokens: [tokenId] })
      .then((body) => {
        draftTexts.set(tokenId, body.prompt);
        scheduleRender();
      })
      .catch(() => {});
  }
  return draftTexts.get(tokenId);
}

function speculativeNote(trace) {
  const spec = trace.extra && trace.extra.speculative;
  if (!spec) return null;
  const drafted = spec.draft_token_ids.length;
  const verdict =
    spec.draft_token_id === null
      ? "a bonus token: every draft before it was accepted, so the verifying pass adds one more"
      : spec.accepted
        ? `the draft proposed it and the target model accepted it (${spec.num_accepted} of ${plural(drafted, "draft")} accepted in this pass)`
        : `the draft proposed “${visibleText(draftText(spec.draft_token_id, trace))}”; the target rejected it and put this token in its place`;
  return el("p", { class: "spec-note", "data-testid": "why-speculative" }, [
    el("strong", { text: "Speculative decoding: " }),
    verdict,
    ". ",
    el("span", {
      class: "hint",
      text:
        trace.method === "greedy"
          ? "Rule (greedy): a draft is accepted while it equals the target's argmax; the first mismatch is replaced by the argmax."
          : "Rule (sampled): a draft x is accepted with probability min(1, p_target(x) / p_draft(x)); a rejected one is replaced by a draw from the leftover distribution.",
    }),
  ]);
}

/** Where the sampled token's uniform landed in the cumulative distribution (token-id order, as the sampler walks it). */
function drawNote(trace) {
  const draw = trace.extra && trace.extra.draw;
  if (!draw) return null;
  return el("div", { class: "draw-note" }, [
    el("p", { class: "hint", "data-testid": "why-draw" }, [
      `Random draw: u = ${draw.uniform.toFixed(4)} landed in this token's span [${draw.cdf_start.toFixed(4)}, ` +
        `${draw.cdf_end.toFixed(4)}) of the cumulative final distribution (tokens in id order).`,
    ]),
    draw.neighbors ? cdfAroundDraw(trace, draw) : null,
  ]);
}

/**
 * The whole vocabulary's cumulative distribution as one 0–1 bar with u on it, and under it a zoom around u: the
 * chosen token's span between its neighbours' (the tokens with probability nearest it in id order, as the sampler
 * recorded them). The zoom's scale is the neighbours' spans' own, so a narrow span is still visible.
 */
function cdfAroundDraw(trace, draw) {
  const width = 600;
  const spans = draw.neighbors;
  return el("div", { class: "cdf-zoom", "data-testid": "draw-cdf" }, [
    svgEl(
      "svg",
      {
        viewBox: `0 0 ${width} 62`,
        class: "cdf cdf-two",
        preserveAspectRatio: "none",
        role: "img",
        "aria-label":
          `u = ${draw.uniform.toFixed(4)} on the cumulative distribution from 0 to 1; zoomed in around it, ` +
          spans.map((s) => `“${s.text}” ${s.cdf_start.toFixed(5)} to ${s.cdf_end.toFixed(5)}`).join(", "),
      },
      cdfShapes(trace, draw, width),
    ),
    el(
      "ol",
      { class: "cdf-spans", "aria-label": "the tokens around u, in id order" },
      spans.map((span) =>
        el("li", { class: span.token_id === trace.chosen_token_id ? "chosen" : "" }, [
          el("span", { class: "tok-text", text: visibleText(span.text) }),
          ` [${span.cdf_start.toFixed(5)}, ${span.cdf_end.toFixed(5)})`,
        ]),
      ),
    ),
    el("p", {
      class: "hint",
      text:
        "Top: the whole vocabulary's cumulative distribution (0 to 1) with u. Below: the shaded stretch around u, " +
        "zoomed in: the chosen token's span (teal) between its neighbours' in token-id order.",
    }),
  ]);
}

/** The 0–1 bar with u (top) and the zoomed neighbours' spans with u (bottom), in a `width`-wide view box. */
function cdfShapes(trace, draw, width) {
  const spans = draw.neighbors;
  const lo = Math.min(spans[0].cdf_start, draw.uniform);
  const hi = Math.max(spans[spans.length - 1].cdf_end, draw.uniform);
  const zoom = (v) => ((v - lo) / Math.max(hi - lo, 1e-12)) * width;
  const shapes = [
    svgEl("rect", { x: 0, y: 4, width, height: 14, class: "cdf-track" }),
    svgEl("rect", { x: lo * width, y: 4, width: Math.max(2, (hi - lo) * width), height: 14, class: "cdf-zoomed" }),
    svgEl("line", { x1: draw.uniform * width, x2: draw.uniform * width, y1: 0, y2: 22, class: "cdf-u" }),
  ];
  for (const span of spans) {
    const x = zoom(span.cdf_start);
    const w = Math.max(1, zoom(span.cdf_end) - x);
    const label = `“${visibleText(span.text)}” (id ${span.token_id}): [${span.cdf_start}, ${span.cdf_end})`;
    shapes.push(
      svgEl(
        "rect",
        {
          x,
          y: 34,
          width: w,
          height: 22,
          class: span.token_id === trace.chosen_token_id ? "cdf-span" : "cdf-neighbor",
          "data-testid": "cdf-neighbor",
          "data-token-id": span.token_id,
          "data-cdf-start": span.cdf_start,
          "data-cdf-end": span.cdf_end,
        },
        [svgEl("title", { text: label })],
      ),
    );
    if (w > 30) {
      shapes.push(svgEl("text", { x: x + 3, y: 49, class: "cdf-label", text: visibleText(span.text).slice(0, 10) }));
    }
  }
  const u = zoom(draw.uniform);
  shapes.push(svgEl("line", { x1: u, x2: u, y1: 28, y2: 60, class: "cdf-u" }));
  return shapes;
}

function whyBars(step, trace) {
  const final = finalDistribution(trace);
  const candidates = trace.candidates.slice().sort((a, b) => a.rank - b.rank);
  const legend = el("div", { class: "bar-legend", "aria-hidden": "true" }, [
    el("span", { class: "key raw" }),
    "raw: softmax of the model's logits ",
    el("span", { class: "key final" }),
    trace.method === "greedy" ? "final: one-hot on the argmax " : "final: what was drawn from ",
  ]);
  const header = el("div", { class: "candidate header", "aria-hidden": "true" }, [
    el("span", { text: "rank" }),
    el("span", { text: "token" }),
    el("span", { text: "logit" }),
    el("span", { text: "probabilities" }),
    el("span", { text: "" }),
  ]);
  const rows = candidates.map((c) => candidateRow(step, trace, c, final.get(c.token_id) ?? 0));
  return el("div", { class: "bar-chart", "data-testid": "bars" }, [legend, header, ...rows]);
}

function barPair(kind, p, testid) {
  return el("div", { class: `bar-line ${kind}` }, [
    el("div", { class: "bar-track" }, [
      el("div", { class: `bar ${kind}`, "data-testid": testid, style: `width:${(Math.min(1, p) * 100).toFixed(2)}%` }),
    ]),
    el("span", { class: "bar-value", text: fmtProb(p) }),
  ]);
}

function candidateRow(step, trace, c, pFinal) {
  const isChosen = c.token_id === trace.chosen_token_id;
  const preview = previewProbs();
  const cells = [
    el("span", { class: "cand-rank", text: `#${c.rank}` }),
    el("span", { class: "cand-text", title: `id ${c.token_id}` }, [
      el("span", { class: "tok-text", text: visibleText(c.text) }),
      el("span", { class: "tok-id", text: c.token_id }),
    ]),
    el("span", { class: "cand-logit", "data-testid": "cand-logit", text: c.logit.toFixed(2) }),
    el("div", { class: "bars" }, [
      barPair("raw", c.prob_raw, "bar-raw"),
      barPair("final", pFinal, "bar-final"),
      preview ? barPair("preview", preview.get(c.token_id) ?? 0, "bar-preview") : null,
    ]),
    el("span", { class: "cand-note" }, [
      isChosen
        ? el("span", { class: "badge chosen-badge", text: trace.method === "forced" ? "forced" : "chosen" })
        : null,
      c.removed_by
        ? el("span", {
            class: `badge removed${c.removed_by === "grammar" ? " by-grammar" : ""}`,
            "data-testid": "removed-by",
            text: `removed by ${c.removed_by}`,
          })
        : null,
      !isChosen ? el("span", { class: "branch-hint", text: "branch ↳" }) : null,
    ]),
  ];
  const attrs = {
    class: `candidate${isChosen ? " chosen" : ""}${c.removed_by ? " is-removed" : ""}`,
    "data-testid": "candidate",
    "data-token-id": c.token_id,
    "data-rank": c.rank,
    "data-prob-raw": c.prob_raw,
    "data-prob-final": pFinal,
    "data-logit": c.logit,
    "data-prob-preview": preview ? (preview.get(c.token_id) ?? 0) : "",
    "data-chosen": isChosen ? "true" : "false",
    "data-removed-by": c.removed_by || "",
  };
  if (isChosen) return el("div", { ...attrs, "aria-current": "true" }, cells);
  return el(
    "button",
    {
      ...attrs,
      type: "button",
      "data-focus-key": `cand-${c.token_id}`,
      "aria-label": `branch: continue token ${step + 1} with “${c.text}” (rank ${c.rank}, p ${fmtProb(c.prob_raw)})`,
      onclick: () => branchFrom(step, c),
    },
    cells,
  );
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
  const input = el("input", {
    type: "number",
    min: 0,
    step: 1,
    id: "force-token-id",
    "data-testid": "force-token-id",
    "data-focus-key": "force-token-id",
    "aria-label": "token id to force at this step",
  });
  return el(
    "form",
    {
      class: "force-form",
      onsubmit: (event) => {
        event.preventDefault();
        forceTokenId(step, parseInt(input.value, 10));
      },
    },
    [
      el("label", { for: "force-token-id", text: "Force another token id here:" }),
      input,
      el("button", { type: "submit", class: "small", "data-testid": "force-token", text: "branch with it" }),
      state.info && state.info.eos_token_ids.length
        ? el("span", { class: "hint", text: ` end of sequence = id ${state.info.eos_token_ids.join(", ")}` })
        : null,
    ],
  );
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
      candidate = await lookUpCandidate(currentBranch(), step, tokenId);
    } catch (error) {
      showError(error);
      return;
    }
  }
  branchFrom(step, candidate);
}

/**
 * A token outside the recorded candidates, as the model saw it at `step`: its logit, raw probability and rank,
 * from a one-token request for the same context whose logit bias makes it the argmax (a bias changes what is
 * chosen, never the raw distribution the trace reports). Its final probability was not recorded: null.
 */
async function lookUpCandidate(branch, step, tokenId) {
  const body = {
    prompt: state.treePromptIds.concat(
      pathOf(branch)
        .slice(0, step)
        .map((t) => t.id),
    ),
    max_tokens: 1,
    temperature: 0,
    logit_bias: { [tokenId]: 100 },
    trace: true,
    trace_top: 1,
  };
  if (state.modelName) body.model = state.modelName;
  const out = await apiJson("/v1/completions", body);
  labelRequest(out.id, "look-up (forced token)");
  const found = out.choices[0].trace[0].candidates.find((c) => c.token_id === tokenId);
  if (!found) throw inputError(null, `token id ${tokenId} is not in this model's vocabulary`);
  return { ...found, prob_final: null, removed_by: null };
}
