"""Reasoning output: a thinking block (`<think>…</think>`, Qwen3 and DeepSeek-R1 style) kept apart from the answer.

The thinking goes to `message.reasoning_content` (and `reasoning`, vLLM's newer name), the rest to `content`.
Some templates open the block in the prompt (the generation prompt ends with `<think>`); the output then starts
inside it. `split` works on the text generated so far: what it returns for a prefix is a prefix of what it
returns later, so streaming sends the difference and tags split across chunks are held back until they are
whole. A constraint on the output (structured output, a tool-call grammar) starts after the thinking block:
SamplingParams.structured_output.starts_after holds the tokens of `</think>`.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def has_reasoning(chat_template: str | None) -> bool:
    """Whether the model's chat template speaks of a thinking block."""
    return THINK_OPEN in (chat_template or "")


def starts_in_reasoning(prompt_text: str | None) -> bool:
    """Whether the rendered prompt already opened the thinking block."""
    return (prompt_text or "").rstrip().endswith(THINK_OPEN)


def split(text: str, starts_inside: bool, is_finished: bool) -> tuple[str | None, str]:
    """(reasoning or None when there is no thinking block, content) of the output so far."""
    if not starts_inside:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            if not is_finished and THINK_OPEN.startswith(stripped):
                return None, ""  # may still become "<think>"
            return None, text
        text = stripped[len(THINK_OPEN) :]
    end = text.find(THINK_CLOSE)
    if end < 0:
        if is_finished:
            return text, ""  # the block never closed: it was all thinking
        return text[: len(text) - _partial_suffix(text, THINK_CLOSE)], ""
    return text[:end], text[end + len(THINK_CLOSE) :].lstrip()


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that begins marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def thinks_before_answering(prompt_text: str | None) -> bool:
    """Whether the output will begin with thinking: the prompt leaves a block open, or opens none (the model
    writes `<think>` itself). A prompt that closes the block (thinking switched off) answers at once."""
    text = prompt_text or ""
    return text.rfind(THINK_OPEN) >= text.rfind(THINK_CLOSE)
