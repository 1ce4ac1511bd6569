"use strict";
/*
 * Panel 7: inside the forward pass of the selected step. The pass that chose token s read the context (the
 * prompt and the path's tokens before s) and took the next-token distribution at the context's last position.
 * POST /v1/visualizer/inspect (engine/inspection.py) returns, for that position and per layer: the logit lens
 * (the top tokens if the model stopped after the layer), the attention weights over the context per head and
 * averaged (with the window of a sliding-window layer), and the norms of the attention and MLP updates to the
 * residual stream. Drawn as the stack embedding → layers → logits. Focusing, hovering or clicking a layer or a
 * head shows which context tokens it attends to, here and on the prompt's tokens in panel 1. Every number is the
 * server's; the page only scales bars.
 */

const INSPECT_TOP_K = 5;
// Lens tokens shown per layer row (the response carries INSPECT_TOP_K).
const LENS_SHOWN = 3;
// Wait this long after the selection settles before inspecting, so arrow keys can run over tokens.
const INSPECT_DELAY_MS = 200;

// key: the context inspected (its ids joined); layer, head: the attention shown ("mean" or a head index); drawn:
// what the panel shows now (the page redraws often while the engine view polls; this panel only when it changed).
const inside = {
  key: null,
  result: null,
  error: null,
  isLoading: false,
  layer: null,
  head: "mean",
  timer: null,
  drawn: null,
};

/** The selected step's context ({ids, step, token}), or null when no generated token is selected. */
function insideContext() {
  const branch = currentBranch();
  const step = state.selectedStep;
  if (!branch || step === null || !state.treePromptIds) return null;
  const path = pathOf(branch);
  if (step >= path.length) return null;
  const ids = state.treePromptIds.concat(path.slice(0, step).map((t) => t.id));
  return ids.length ? { ids, step, token: path[step] } : null;
}

function renderInside() {
  const box = $("inside");
  const context = insideContext();
  if (!context) {
    inside.drawn = null;
    clearPromptAttention();
    box.replaceChildren(
      el("p", { class: "hint", text: "Select a generated token to look inside the forward pass that chose it." }),
    );
    return;
  }
  const key = context.ids.join(",");
  if (key !== inside.key) scheduleInspect(key, context.ids);
  const drawn = [key, context.token.id, inside.isLoading, inside.error, inside.result];
  if (inside.drawn && drawn.every((part, i) => part === inside.drawn[i])) return;
  inside.drawn = drawn;
  withFocusKept(box, () => setChildren(box, ...insideBody(context)));
  showAttention();
}

function scheduleInspect(key, ids) {
  clearTimeout(inside.timer);
  Object.assign(inside, { key, result: null, error: null, isLoading: true });
  inside.timer = setTimeout(() => runInspect(key, ids), INSPECT_DELAY_MS);
}

/** Inspect once no generation is running (an inspection runs on the engine thread, between two steps). */
async function runInspect(key, ids) {
  if (isBusy()) {
    inside.timer = setTimeout(() => runInspect(key, ids), INSPECT_DELAY_MS);
    return;
  }
  try {
    const body = { token_ids: ids, position: ids.length - 1, top_k: INSPECT_TOP_K };
    const result = await apiJson("/v1/visualizer/inspect", body);
    if (key !== inside.key) return;
    inside.result = result;
    if (inside.layer === null || inside.layer >= result.num_layers) inside.layer = result.num_layers - 1;
  } catch (error) {
    if (key === inside.key) inside.error = error;
  } finally {
    if (key === inside.key) inside.isLoading = false;
    scheduleRender();
  }
}

function insideBody(context) {
  const position = context.ids.length - 1;
  const intro = el("p", { class: "hint", "data-testid": "inside-intro" }, [
    `Token ${context.step + 1}, “${visibleText(context.token.text)}”, came from the forward pass over `,
    `${plural(context.ids.length, "token")} of context. Below: its last position (${position + 1}), layer by `,
    "layer. Focus or hover a layer, or a head, to see which tokens it attends to (also marked under the prompt's ",
    "tokens in panel 1).",
  ]);
  if (inside.error) return [intro, inspectError(inside.error)];
  if (inside.isLoading || !inside.result) {
    return [intro, el("p", { class: "hint", "data-testid": "inside-loading", text: "Inspecting the forward pass…" })];
  }
  return [
    intro,
    el("div", { class: "inside-grid" }, [
      layerStack(inside.result, context.token),
      el("div", { id: "inside-attention", class: "inside-attention", "data-testid": "inside-attention" }),
    ]),
  ];
}

/** A refused inspection (a context past the server's limit, say): the server's own message, in this panel. */
function inspectError(error) {
  return el("div", { class: "inside-error", role: "status", "data-testid": "inside-error" }, [
    el("strong", { text: `The server refused this inspection${error.status ? ` (HTTP ${error.status})` : ""}: ` }),
    el("span", { "data-testid": "inside-error-message", text: error.message }),
    error.param ? el("span", { class: "hint", text: ` (parameter: ${error.param})` }) : null,
  ]);
}

/* ---------------------------------------------------------------- the stack */

function layerStack(result, token) {
  const norms = result.layers.flatMap((l) => [l.attention_update_norm, l.mlp_update_norm]);
  const maxNorm = Math.max(...norms, 1e-9);
  const positionText = visibleText(result.tokens[result.position]);
  const rows = [
    el("li", { class: "stack-end", "data-testid": "inside-embedding" }, [
      el("strong", { text: "embedding " }),
      `of “${positionText}” (id ${result.token_ids[result.position]}) at position ${result.position + 1}: the `,
      "residual stream starts here",
    ]),
    ...result.layers.map((layer, i) => layerRow(layer, i, maxNorm)),
    logitsRow(result, token),
  ];
  return el(
    "ol",
    {
      class: "inside-stack",
      "data-testid": "inside-stack",
      "data-position": result.position,
      "aria-label": `the forward pass: embedding, ${plural(result.num_layers, "layer")}, logits`,
      onkeydown: (event) => moveFocus(event, "[data-testid=inside-layer]", { ArrowUp: -1, ArrowDown: 1 }),
    },
    rows,
  );
}

function layerRow(layer, i, maxNorm) {
  const lens = layer.logit_lens;
  const attention = layer.attention;
  const window = attention && attention.window > 0 ? attention.window : 0;
  const isShown = i === inside.layer;
  const label =
    `layer ${i + 1}: stopped here the model would say “${lens[0].text}” (${fmtProb(lens[0].prob)}); ` +
    `attention update norm ${layer.attention_update_norm.toFixed(2)}, MLP update norm ` +
    `${layer.mlp_update_norm.toFixed(2)}${window ? `; sliding window of ${plural(window, "token")}` : ""}`;
  return el("li", {}, [
    el(
      "button",
      {
        type: "button",
        class: `layer-row${isShown ? " shown" : ""}`,
        "data-testid": "inside-layer",
        "data-layer": i,
        "data-top-token-id": lens[0].token_id,
        "data-attention-norm": layer.attention_update_norm,
        "data-mlp-norm": layer.mlp_update_norm,
        "data-window": window,
        "data-focus-key": `inside-layer-${i}`,
        tabindex: isShown ? 0 : -1,
        "aria-pressed": isShown ? "true" : "false",
        "aria-label": label,
        onclick: () => showLayer(i),
        onfocus: () => showLayer(i),
        onmouseenter: () => showLayer(i),
      },
      [
        el("span", { class: "layer-name", text: `L${i + 1}` }),
        el(
          "span",
          { class: "lens" },
          lens.slice(0, LENS_SHOWN).map((t) =>
            el("span", { class: "lens-token", "data-testid": "lens-token", "data-token-id": t.token_id }, [
              el("span", { class: "tok-text", text: visibleText(t.text) }),
              ` ${fmtProb(t.prob)}`,
            ]),
          ),
        ),
        el("span", { class: "norms" }, [
          normBar("attn", layer.attention_update_norm, maxNorm),
          normBar("mlp", layer.mlp_update_norm, maxNorm),
        ]),
        window ? el("span", { class: "badge", text: `window ${window}` }) : null,
      ],
    ),
  ]);
}

function normBar(kind, value, maxNorm) {
  return el("span", { class: `norm-line ${kind}` }, [
    el("span", { class: "norm-name", text: kind === "attn" ? "attn" : "MLP" }),
    el("span", { class: "norm-track" }, [
      el("span", { class: `norm-bar ${kind}`, style: `width:${((value / maxNorm) * 100).toFixed(1)}%` }),
    ]),
    el("span", { class: "norm-value", text: value.toFixed(1) }),
  ]);
}

/** The output: the last layer's lens is the model's next-token distribution, beside what the step recorded. */
function logitsRow(result, token) {
  const last = result.layers[result.num_layers - 1].logit_lens;
  const trace = token.trace;
  const recordedTop = trace ? trace.candidates.find((c) => c.rank === 1) : null;
  return el(
    "li",
    {
      class: "stack-end",
      "data-testid": "inside-logits",
      "data-top-token-id": last[0].token_id,
      "data-recorded-top-token-id": recordedTop ? recordedTop.token_id : "",
    },
    [
      el("strong", { text: "logits " }),
      `after the final norm and output layer: “${visibleText(last[0].text)}” ${fmtProb(last[0].prob)} on top. `,
      recordedTop
        ? `The step recorded “${visibleText(recordedTop.text)}” (p raw ${fmtProb(recordedTop.prob_raw)}) as its ` +
          `most likely token, and chose “${visibleText(token.text)}”. Inspection runs the model's readable ` +
          "modules, not the engine's fast kernels, so its probabilities can differ a little from the step's."
        : "",
    ],
  );
}

function showLayer(i) {
  if (inside.layer === i) return;
  inside.layer = i;
  $("inside")
    .querySelectorAll("[data-testid=inside-layer]")
    .forEach((row) => {
      const isShown = Number(row.dataset.layer) === i;
      row.classList.toggle("shown", isShown);
      row.setAttribute("aria-pressed", String(isShown));
      row.setAttribute("tabindex", isShown ? "0" : "-1");
    });
  showAttention();
}

/** Arrow keys move the focus along a list of buttons (one of them in the tab order), as the token row does. */
function moveFocus(event, selector, moves) {
  if (!(event.key in moves)) return;
  const items = [...event.currentTarget.querySelectorAll(selector)];
  const index = items.indexOf(document.activeElement);
  if (index < 0) return;
  event.preventDefault();
  const target = items[Math.max(0, Math.min(items.length - 1, index + moves[event.key]))];
  items.forEach((item) => item.setAttribute("tabindex", item === target ? "0" : "-1"));
  target.focus();
}

/* ---------------------------------------------------------------- attention */

/** The shown layer's weights: the chosen head's row, or the mean over heads. */
function shownWeights(attention) {
  return inside.head === "mean" ? attention.mean : attention.weights[inside.head];
}

function showAttention() {
  const box = document.getElementById("inside-attention");
  const result = inside.result;
  if (!box || !result || inside.layer === null) return;
  const attention = result.layers[inside.layer].attention;
  if (!attention.weights) {
    clearPromptAttention();
    box.replaceChildren(el("p", { class: "hint", text: attention.reason }));
    return;
  }
  if (inside.head !== "mean" && inside.head >= attention.weights.length) inside.head = "mean";
  withFocusKept(box, () =>
    setChildren(
      box,
      el("h3", {
        text:
          `Layer ${inside.layer + 1}: where position ${result.position + 1} looks ` +
          `(${inside.head === "mean" ? "mean of the heads" : `head ${inside.head + 1}`})`,
      }),
      attention.window > 0
        ? el("p", {
            class: "hint",
            "data-testid": "inside-window",
            text:
              `A sliding-window layer: it sees only the last ${plural(attention.window, "position")} up to ` +
              "its own.",
          })
        : null,
      headButtons(attention),
      contextTokens(result, shownWeights(attention)),
      attentionGrid(result, attention),
    ),
  );
  markPromptAttention(result, shownWeights(attention));
}

function headButtons(attention) {
  const heads = ["mean", ...attention.weights.map((_, h) => h)];
  return el(
    "div",
    {
      class: "head-buttons",
      role: "toolbar",
      "aria-label": "attention heads of this layer",
      onkeydown: (event) => moveFocus(event, "[data-testid=inside-head]", { ArrowLeft: -1, ArrowRight: 1 }),
    },
    heads.map((head) =>
      el("button", {
        type: "button",
        class: "small",
        "data-testid": "inside-head",
        "data-head": head,
        "data-focus-key": `inside-head-${head}`,
        tabindex: head === inside.head ? 0 : -1,
        "aria-pressed": head === inside.head ? "true" : "false",
        text: head === "mean" ? "mean" : `head ${head + 1}`,
        onclick: () => showHead(head),
        onfocus: () => showHead(head),
        onmouseenter: () => showHead(head),
      }),
    ),
  );
}

function showHead(head) {
  if (inside.head === head) return;
  inside.head = head;
  showAttention();
}

/** The context's tokens, each underlined in proportion to its weight (the largest weight is a full bar). */
function contextTokens(result, weights) {
  const top = Math.max(...weights, 1e-9);
  return el(
    "div",
    { class: "context-tokens", "data-testid": "inside-context" },
    result.tokens.map((text, j) =>
      el(
        "span",
        {
          class: `context-token${j === result.position ? " query" : ""}`,
          "data-testid": "inside-context-token",
          "data-weight": weights[j],
          title: `position ${j + 1} “${visibleText(text)}”: weight ${fmtProb(weights[j])}`,
          style: `box-shadow: inset 0 -5px 0 rgb(36 87 197 / ${(weights[j] / top).toFixed(3)})`,
        },
        visibleText(text),
      ),
    ),
  );
}

/**
 * One row per head and one for their mean, one cell per context position, darker where the weight is larger.
 * Each row is the softmax of the position's scores: it sums to 1 (the cells carry the server's numbers).
 */
function attentionGrid(result, attention) {
  const rows = [...attention.weights.map((w, h) => [h, w]), ["mean", attention.mean]];
  const cell = Math.max(2, Math.min(14, Math.floor(560 / result.tokens.length)));
  const labelW = 52;
  const rowH = 12;
  const width = labelW + result.tokens.length * cell;
  const shapes = rows.flatMap(([head, weights], r) => [
    svgEl("text", { x: 0, y: r * rowH + 10, class: "lane-label", text: head === "mean" ? "mean" : `head ${head + 1}` }),
    svgEl(
      "g",
      { "data-testid": "attention-row", "data-head": head, class: head === inside.head ? "shown" : "" },
      weights.map((w, j) =>
        svgEl("rect", {
          x: labelW + j * cell,
          y: r * rowH + 1,
          width: Math.max(1, cell - 1),
          height: rowH - 2,
          class: "attention-cell",
          "data-testid": "attention-cell",
          "data-weight": w,
          "fill-opacity": Math.max(0.04, Math.sqrt(w)).toFixed(3),
        }),
      ),
    ),
  ]);
  return el("div", { class: "timeline-scroll" }, [
    svgEl(
      "svg",
      {
        width,
        height: rows.length * rowH,
        viewBox: `0 0 ${width} ${rows.length * rowH}`,
        class: "attention-grid",
        role: "img",
        "aria-label":
          `attention weights of layer ${inside.layer + 1}: ${plural(attention.weights.length, "head")} and their ` +
          `mean over ${plural(result.tokens.length, "context token")}; each row sums to 1`,
      },
      shapes,
    ),
  ]);
}

/** Mark the prompt's tokens in panel 1 by the shown weights (only while panel 1 shows the tree's prompt). */
function markPromptAttention(result, weights) {
  const chips = [...document.querySelectorAll("#prompt-tokens [data-testid=prompt-token]")];
  const isTreePrompt = state.promptIds && samePrompt(state.promptIds);
  const top = Math.max(...weights, 1e-9);
  chips.forEach((chip, j) => {
    if (!isTreePrompt || j >= weights.length) {
      chip.style.boxShadow = "";
      delete chip.dataset.attention;
      return;
    }
    chip.dataset.attention = weights[j];
    chip.style.boxShadow = `inset 0 -5px 0 rgb(36 87 197 / ${(weights[j] / top).toFixed(3)})`;
  });
}

function clearPromptAttention() {
  document.querySelectorAll("#prompt-tokens [data-testid=prompt-token]").forEach((chip) => {
    chip.style.boxShadow = "";
    delete chip.dataset.attention;
  });
}
