"use strict";
/*
 * Panel 4: the token tree (one row per path, one cell per token, keyboard-navigable) and the comparison of
 * two paths aligned at their first divergent token.
 */

/* ---------------------------------------------------------------- tree */

const ROW = 34;
const CELL = 16;
const PAD = 22;

function cacheHint() {
  if (!state.info || !state.treePromptIds) return "";
  const size = state.info.block_size;
  const whole = Math.floor(state.treePromptIds.length / size);
  if (whole === 0) {
    return (
      `This prompt (${plural(state.treePromptIds.length, "token")}) is shorter than one KV block of ` +
      `${plural(size, "token")}: the prefix cache reuses only whole blocks, so a branch recomputes it.`
    );
  }
  return (
    `A branch finds the prompt's first ${plural(whole, "whole block")} (${plural(whole * size, "token")}) in the ` +
    "prefix cache and recomputes only the tokens after them."
  );
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
  const svg = svgEl(
    "svg",
    {
      width,
      height: rows.length * ROW,
      viewBox: `0 0 ${width} ${rows.length * ROW}`,
      class: "tree-svg",
      role: "group",
      "aria-label": `token tree with ${plural(state.branches.length, "path")}`,
      onkeydown: onTreeKeydown,
    },
    shapes,
  );
  withFocusKept(box, () => {
    setChildren(
      box,
      el("div", { class: "tree-labels" }, rows.map(treeLabel)),
      el("div", { class: "tree-lanes" }, [svg]),
      state.importReport
        ? el("p", { class: "hint import-report", "data-testid": "import-report", text: state.importReport })
        : null,
    );
  });
}

function treeLane(branch, lane, laneOf) {
  const y = lane * ROW + ROW / 2;
  const start = branch.prefix.length;
  const shapes = [];
  if (branch.parentId === null) {
    shapes.push(
      svgEl("circle", { cx: 8, cy: y, r: 5, class: "tree-root" }, [
        svgEl("title", { text: `prompt (${plural(state.treePromptIds ? state.treePromptIds.length : 0, "token")})` }),
      ]),
    );
    shapes.push(svgEl("line", { x1: 13, y1: y, x2: PAD, y2: y, class: "tree-edge" }));
  } else {
    // From the parent's token just before the fork (or its prompt dot) down to this branch's first token.
    const parentY = laneOf.get(branch.parentId) * ROW + ROW / 2;
    const x0 = start === 0 ? 8 : PAD + (start - 1) * CELL + (CELL - 3) / 2;
    const x1 = PAD + start * CELL;
    shapes.push(
      svgEl("path", { d: `M ${x0} ${parentY + 6} C ${x0} ${y}, ${x0} ${y}, ${x1} ${y}`, class: "tree-edge fork" }),
    );
  }
  const focusCell = treeFocusCell();
  pathOf(branch)
    .slice(start)
    .forEach((token, j) => {
      const step = start + j;
      const p = tokenProb(token) ?? 0.5;
      const isSelected = branch.id === state.currentId && step === state.selectedStep;
      const isFocusCell = focusCell.branch === branch.id && focusCell.step === step;
      const cls = ["tree-cell", token.isForced ? "forced" : "", isSelected ? "selected" : ""].join(" ");
      shapes.push(
        svgEl(
          "rect",
          {
            x: PAD + step * CELL,
            y: y - 8,
            width: CELL - 3,
            height: 16,
            rx: 3,
            fill: probColor(p),
            class: cls,
            tabindex: isFocusCell ? 0 : -1,
            role: "button",
            "aria-pressed": isSelected ? "true" : "false",
            "aria-label": `path ${branch.id}, token ${step + 1}: “${token.text}”, p ${fmtProb(p)}`,
            "data-testid": "tree-cell",
            "data-branch": branch.id,
            "data-step": step,
            "data-focus-key": `cell-${branch.id}-${step}`,
            onclick: () => selectCell(branch.id, step),
          },
          [
            svgEl("title", {
              text: `path ${branch.id}, token ${step + 1}: “${visibleText(token.text)}” p ${fmtProb(p)}`,
            }),
          ],
        ),
      );
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
        type: "button",
        class: "small toggle",
        "data-testid": "tree-toggle",
        "data-focus-key": `toggle-${branch.id}`,
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
  return el(
    "div",
    {
      class: `tree-row${isCurrent ? " current" : ""}`,
      "data-testid": "tree-row",
      "data-branch": branch.id,
      "data-parent": branch.parentId ?? "",
      "data-status": branch.status,
      style: `padding-left:${Math.min(depthOf(branch), 6) * 8}px`,
    },
    [
      toggle,
      el(
        "button",
        {
          type: "button",
          class: "tree-select",
          "data-testid": "tree-select",
          "data-focus-key": `select-${branch.id}`,
          "aria-current": isCurrent ? "true" : null,
          title: own,
          onclick: () => {
            selectBranch(branch.id, state.selectedStep !== null ? Math.min(state.selectedStep, path.length - 1) : null);
            state.isFollowing = false;
            scheduleRender();
          },
        },
        [
          el("span", { class: "tree-title" }, [
            el("strong", { text: `path ${branch.id}` }),
            " ",
            el("span", { class: "snippet", "data-testid": "tree-snippet", text: own.slice(0, 28) || "…" }),
          ]),
          el("span", { class: "tree-settings", "data-testid": "tree-settings", text: settingsText(branch.params) }),
        ],
      ),
      el("span", {
        class: "logprob",
        "data-testid": "tree-logprob",
        title: "Σ log p_raw of the path",
        text: cumulativeLogprob(path).toFixed(1),
      }),
      el("label", { class: "compare-check", title: "compare this path" }, [
        el("input", {
          type: "checkbox",
          "data-testid": "compare-check",
          "data-focus-key": `compare-${branch.id}`,
          "aria-label": `compare path ${branch.id}`,
          checked: state.compareIds.has(branch.id),
          onchange: (event) => {
            if (event.target.checked) state.compareIds.add(branch.id);
            else state.compareIds.delete(branch.id);
            scheduleRender();
          },
        }),
      ]),
    ],
  );
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
    box.replaceChildren(
      branches.length ? el("p", { class: "hint", text: "Tick a second path to compare it with this one." }) : "",
    );
    return;
  }
  box.hidden = false;
  const [a, b] = branches.map(pathOf);
  const split = firstDivergence(a, b);
  setChildren(
    box,
    el("h3", { text: `Compare path ${branches[0].id} and path ${branches[1].id}` }),
    el("p", {
      "data-testid": "compare-divergence",
      "data-step": split,
      text:
        split >= Math.min(a.length, b.length)
          ? `No divergence: one path continues the other for ${plural(split, "token")}.`
          : `They share ${plural(split, "token")} and first differ at token ${split + 1}.`,
    }),
    compareAligned(branches, [a, b], split),
    split < Math.min(a.length, b.length) ? compareMargin(a[split], b[split], branches) : null,
  );
}

/** The two paths token by token in two rows, the shared part dimmed and the first divergent token marked. */
function compareAligned(branches, paths, split) {
  return el(
    "div",
    { class: "compare-grid" },
    paths.map((path, i) =>
      el("div", { class: "compare-item", "data-testid": "compare-item" }, [
        el("span", { class: "compare-head" }, [
          el("strong", { text: `path ${branches[i].id}` }),
          ` · Σ log p = ${cumulativeLogprob(path).toFixed(2)} · ${settingsText(branches[i].params)}`,
        ]),
        el(
          "p",
          { class: "compare-text" },
          path.map((t, step) =>
            el("span", {
              class: step < split ? "shared" : step === split ? "diverge" : "",
              "data-testid": step === split ? "compare-diverge-token" : null,
              text: visibleText(t.text),
            }),
          ),
        ),
      ]),
    ),
  );
}

/**
 * At the divergent token both paths saw the same context, so the raw distribution is shared; the final ones
 * differ when the two paths used different settings (two runs at two temperatures, say): both are shown.
 */
function compareMargin(tokenA, tokenB, branches) {
  const pa = tokenProb(tokenA);
  const pb = tokenProb(tokenB);
  const trace = tokenA.trace || tokenB.trace;
  const finals = [tokenA, tokenB].map((t) => (t.trace ? finalDistribution(t.trace) : new Map()));
  const takenBy = (c) =>
    [tokenA, tokenB]
      .map((t, i) => (t.id === c.token_id ? `path ${branches[i].id}` : null))
      .filter(Boolean)
      .join(", ");
  const rows = trace
    ? trace.candidates
        .slice()
        .sort((x, y) => x.rank - y.rank)
        .slice(0, 8)
        .map((c) =>
          el(
            "tr",
            {
              class: c.token_id === tokenA.id || c.token_id === tokenB.id ? "picked" : "",
            },
            [
              el("td", { text: visibleText(c.text) }),
              el("td", { class: "num", text: fmtProb(c.prob_raw) }),
              ...finals.map((final) =>
                el("td", { class: "num", "data-testid": "compare-final", text: fmtProb(final.get(c.token_id) ?? 0) }),
              ),
              el("td", { text: takenBy(c) }),
            ],
          ),
        )
    : [];
  const head = ["candidate", "p raw", `p final, path ${branches[0].id}`, `p final, path ${branches[1].id}`, "taken by"];
  return el("div", { class: "compare-margin", "data-testid": "compare-margin" }, [
    el("p", {
      text:
        `At the divergent token: path ${branches[0].id} took “${visibleText(tokenA.text)}” (p raw ${fmtProb(pa)}), ` +
        `path ${branches[1].id} took “${visibleText(tokenB.text)}” (p raw ${fmtProb(pb)}); margin ` +
        `${pa !== null && pb !== null ? (pa - pb).toFixed(3) : "–"} in probability, ` +
        `${pa && pb ? Math.log(pa / pb).toFixed(2) : "–"} in log p.`,
    }),
    rows.length
      ? el("table", { class: "compare-table" }, [
          el("thead", {}, [
            el(
              "tr",
              {},
              head.map((text) => el("th", { text })),
            ),
          ]),
          el("tbody", {}, rows),
        ])
      : null,
  ]);
}
