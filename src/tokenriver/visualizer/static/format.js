"use strict";
/*
 * Formatting and DOM helpers shared by the visualizer's scripts: numbers with their units and the right
 * plural, the colour scale, and two small element builders. Nothing here touches the page's state.
 */

/** "1 token", "2 tokens": every count the page prints goes through here so no "1 blocks" slips out. */
function plural(count, singular, pluralForm = `${singular}s`) {
  return `${count} ${count === 1 ? singular : pluralForm}`;
}

function fmtProb(p) {
  if (p === null || p === undefined || Number.isNaN(p)) return "–";
  if (p >= 0.001 || p === 0) return p.toFixed(3);
  return p.toExponential(1);
}

function fmtPercent(p) {
  return `${(p * 100).toFixed(1)}%`;
}

/** A share of probability as a percentage that never rounds a non-zero share to 0% or a partial one to 100%. */
function fmtShare(p) {
  if (p > 0 && p < 0.0005) return "< 0.1%";
  if (p < 1 && p > 0.9995) return "> 99.9%";
  return fmtPercent(p);
}

function fmtMs(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const ms = seconds * 1000;
  return ms >= 100 ? `${ms.toFixed(0)} ms` : `${ms.toFixed(1)} ms`;
}

/** Bytes in binary units: KV memory is allocated in powers of two, so KiB/MiB read truer than kB/MB. */
function fmtBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  const units = ["bytes", "KiB", "MiB", "GiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? plural(value, "byte") : `${value.toFixed(value >= 100 ? 0 : 1)} ${units[unit]}`;
}

/** Token text with its whitespace made visible (for chips, bars and labels, where "" or "\n" would vanish or spill). */
function visibleText(text) {
  if (text === "") return "∅";
  return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍");
}

// Viridis, sampled at 9 stops: perceptually uniform and readable with every common colour-vision deficiency.
const VIRIDIS = [
  [68, 1, 84],
  [71, 44, 122],
  [59, 81, 139],
  [44, 113, 142],
  [33, 144, 141],
  [39, 173, 129],
  [92, 200, 99],
  [170, 220, 50],
  [253, 231, 37],
];

/** Viridis colour of a probability in [0, 1] (dark purple = unlikely, yellow = certain). */
function probColor(p) {
  const x = Math.max(0, Math.min(1, p)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  const rgb = VIRIDIS[i].map((c, k) => Math.round(c + (VIRIDIS[i + 1][k] - c) * f));
  return `rgb(${rgb.join(" ")})`;
}

/** WCAG relative luminance of an sRGB colour [r, g, b] (0–255). */
function luminance(rgb) {
  const [r, g, b] = rgb.map((c) => {
    const v = c / 255;
    return v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
  });
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}

/**
 * Text colour on probColor(p): white or black, whichever contrasts more. One of the two always reaches 4.58:1 (they
 * tie at a luminance of 0.179), above WCAG AA's 4.5:1 on every colour of the scale.
 */
function probInk(p) {
  const background = luminance(probColor(p).match(/\d+/g).map(Number));
  return 1.05 / (background + 0.05) >= (background + 0.05) / 0.05 ? "#ffffff" : "#000000";
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

/** Replace a node's children, skipping the null a builder returns when it has nothing to show. */
function setChildren(node, ...children) {
  node.replaceChildren(...children.filter((child) => child !== null && child !== undefined && child !== false));
}

/** A definition list of [label, value, testid] facts, the page's one way to show a set of numbers. */
function factList(facts, className = "stats") {
  return el(
    "dl",
    { class: className },
    facts.map(([label, value, testid]) =>
      el("div", { class: "stat" }, [el("dt", { text: label }), el("dd", { "data-testid": testid, text: value })]),
    ),
  );
}
