"""How an error message echoes a value a client sent: short, on one line, with the value's size.

Owns `clipped` and `shown`, used by every refusal that quotes client data: SamplingParams checks
(pipeline/speculation/sampling.py), structured output formats (launcher/serving/formats/), and the HTTP
and gRPC front ends. A client's value can be
megabytes (a 4 MiB body): the message keeps its first SHOWN_CHARS characters, "…" and its size.
Must not: decide whether a value is refused (the callers do).
"""

from __future__ import annotations

from typing import Any

SHOWN_CHARS = 80  # most characters of a client's value that an error message echoes


def clipped(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` (client data as a message shows it) when at most `limit` characters; else its first
    `limit`, "…" and its length, e.g. `xxx… (20000 characters)`."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` for an error message that echoes a client's value (every HTTP and gRPC one); when
    longer than `limit` characters, its first `limit`, "…" and the value's size, so that a huge string
    or list keeps the message short: `'xxx…' (20000 characters)`, `[1, 2, …] (5000 items)`."""
    text = repr(value)
    if len(text) <= limit or not isinstance(value, (str, list, dict)):
        return clipped(text, limit)
    return f"{text[:limit]}… ({len(value)} {'characters' if isinstance(value, str) else 'items'})"
