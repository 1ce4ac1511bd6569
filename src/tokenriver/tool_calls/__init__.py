"""Tool calling, shared by every entry point (the server, LLM.chat, the command line): how tools reach the
prompt, which grammar enforces a call, and how output becomes tool calls. Plain dicts in OpenAI's shapes; no
model, tokenizer or web framework (the caller answers the one vocabulary question, `special_token_id`).

Three envelope formats, chosen from the model's chat template:
- "hermes" (Qwen 2.5/3, Hermes): the template renders `tools`; a call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row when parallel.
- "llama3" (Llama 3.1+): the template renders `tools`; a call is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several separated by `;` when parallel.
- "generic" (templates without tool support, such as SmolLM2's): as llama.cpp does, the tools and a JSON
  envelope are described in the system prompt, and the whole answer is one JSON object:
  `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or `{"response": "..."}`.

Enforcement: every tool_choice but "none" gets a grammar in the format's own envelope. "required" and a named
function allow calls only; "auto" allows prose or calls (for hermes, prose and then calls: a lazy grammar that
starts at `<tool_call>`). "none" renders no tools and parses nothing.
"""

from tokenriver.tool_calls.calling import CHOICES, FORMATS, ToolCalling, tool_format

__all__ = ["CHOICES", "FORMATS", "ToolCalling", "tool_format"]
