"use strict";
/*
 * The output constraint of panel 5 (structured output): none, any JSON object, a JSON schema, a regex or a
 * choice, sent as vLLM's `structured_outputs` field of /v1/completions. A constraint belongs to a path, like its
 * seed: it covers the path's whole generated text, so a request that continues a path (a branch, samples, a
 * step, a replay) also sends the path's tokens so far as `structured_output_prefix_ids` and the grammar picks
 * up where the path left off instead of starting over.
 */

const CONSTRAINT_LABELS = {
  json: ["JSON schema", "a JSON object, e.g. {\"type\": \"object\"}"],
  regex: ["regex", "the whole generated text must match it"],
  choice: ["choices", "one per line, or comma-separated"],
};

/** Show the text box only for the kinds that take a text, labelled for that kind. */
function updateConstraintInput() {
  const kind = $("constraint-kind").value;
  const label = CONSTRAINT_LABELS[kind];
  $("constraint-text-row").hidden = !label;
  if (label) {
    $("constraint-text-name").textContent = label[0];
    $("constraint-text-hint").textContent = label[1];
  }
}

/** The `structured_outputs` field for the chosen constraint, or null; throws an input error the page can catch. */
function readConstraint() {
  const kind = $("constraint-kind").value;
  const text = $("constraint-text").value;
  if (kind === "none") return null;
  if (kind === "json_object") return { json_object: true };
  if (kind === "json") {
    let schema;
    try {
      schema = JSON.parse(text);
    } catch (error) {
      throw inputError("structured_outputs", `the JSON schema is not valid JSON: ${error.message}`);
    }
    if (schema === null || typeof schema !== "object" || Array.isArray(schema))
      throw inputError("structured_outputs", "a JSON schema must be a JSON object, e.g. {\"type\": \"object\"}");
    return { json: schema };
  }
  if (kind === "regex") {
    // The server's regex dialect (Rust's) is not JavaScript's: only the server can say whether it compiles.
    if (text === "") throw inputError("structured_outputs", "a regex constraint needs a pattern");
    return { regex: text };
  }
  const choices = text
    .split(text.includes("\n") ? "\n" : ",")
    .map((choice) => choice.trim())
    .filter((choice) => choice !== "");
  if (!choices.length) throw inputError("structured_outputs", "a choice constraint needs at least one option");
  return { choice: choices };
}

/** The constraint fields of a request that continues `branch` after its first `step` tokens ({} when free). */
function constraintFields(branch, step) {
  const constraint = branch.params.structured_outputs;
  if (!constraint) return {};
  return {
    structured_outputs: constraint,
    structured_output_prefix_ids: pathOf(branch)
      .slice(0, step)
      .map((t) => t.id),
  };
}

/** A constraint in a few characters, for the path settings in the tree and in panel 3. */
function constraintText(constraint) {
  const short = (text) => (text.length > 24 ? `${text.slice(0, 23)}…` : text);
  if (constraint.json_object) return "JSON object";
  if (constraint.json) return "JSON schema";
  if (constraint.regex !== undefined) return `regex ${short(constraint.regex)}`;
  return `choice ${short(constraint.choice.join(" | "))}`;
}

function initConstraint() {
  $("constraint-kind").addEventListener("change", updateConstraintInput);
  updateConstraintInput();
}

document.addEventListener("DOMContentLoaded", initConstraint);
