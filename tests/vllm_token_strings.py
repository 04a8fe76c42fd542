"""Reference for logprob token strings: vLLM's own algorithm, ported here and run on transformers' tokenizer.

A port of vllm/tokenizers/detokenizer_utils.py `_get_leading_space_marker`, `_restore_leading_spaces` and
`convert_ids_list_to_tokens` (PR #48674) and of vllm/v1/engine/logprobs.py `LogprobsProcessor._verify_tokens` /
`_correct_decoded_token` (PR #34875), written against the Hugging Face `PreTrainedTokenizerFast` API as vLLM calls
it (`backend_tokenizer.to_str()`, `convert_ids_to_tokens`, `decode`), so that a test compares speedpipe's
launcher/serving/formats/token_strings.py (the `tokenizers` library, no transformers) with an independent decode. The
context a test passes is speedpipe's rule (the sequence's tokens before the position, at most 4): see
[Note: logprob token strings].
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

MAX_CONTEXT = 4  # vLLM's `_get_sampled_context_ids` max_context


@functools.cache
def hf_tokenizer(folder: str | Path):
    """transformers' fast tokenizer of a model folder (the one vLLM would load); one per folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def leading_space_marker(hf) -> str | None:
    """vLLM's `_get_leading_space_marker`: a Metaspace pre-tokenizer's replacement (alone or in a Sequence)."""
    pre = json.loads(hf.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    if pre.get("type") == "Metaspace":
        return pre.get("replacement", "\u2581")
    if pre.get("type") == "Sequence":
        for sub in pre.get("pretokenizers", []):
            if sub.get("type") == "Metaspace":
                return sub.get("replacement", "\u2581")
    return None


def restore_leading_spaces(raw_token: str, token_str: str, marker: str) -> str:
    """vLLM's `_restore_leading_spaces`."""
    num_markers = 0
    for ch in raw_token:
        if ch != marker:
            break
        num_markers += 1
    if num_markers == 0:
        return token_str
    existing = len(token_str) - len(token_str.lstrip(" "))
    missing = num_markers - existing
    return " " * missing + token_str if missing > 0 else token_str


def convert_ids_list_to_tokens(hf, token_ids: list[int]) -> list[str]:
    """vLLM's `convert_ids_list_to_tokens`: each id decoded alone, its stripped leading spaces put back."""
    marker = leading_space_marker(hf)
    if marker is None:
        return [hf.decode([tid]) or "" for tid in token_ids]
    raw_tokens = hf.convert_ids_to_tokens(token_ids)
    return [restore_leading_spaces(raw, hf.decode([tid]) or "", marker) for tid, raw in zip(token_ids, raw_tokens, strict=True)]


def correct_decoded_token(hf, token_id: int, context_token_ids: list[int]) -> str:
    """vLLM's `LogprobsProcessor._correct_decoded_token`."""
    max_ctx = min(len(context_token_ids), MAX_CONTEXT)
    for num_ctx in range(1, max_ctx + 1):
        context = context_token_ids[-num_ctx:]
        full_decoded = hf.decode(context + [token_id])
        if full_decoded.endswith("\ufffd"):
            continue
        clean_end = len(context)
        for j in range(len(context) - 1, -1, -1):
            if hf.decode([context[j]]).endswith("\ufffd"):
                clean_end = j
            else:
                break
        clean_prefix = hf.decode(context[:clean_end]) if clean_end > 0 else ""
        if full_decoded.startswith(clean_prefix):
            return full_decoded[len(clean_prefix):]
        common_len = 0
        for a, b in zip(clean_prefix, full_decoded, strict=False):
            if a != b:
                break
            common_len += 1
        return full_decoded[common_len:]
    return ""


def verify_tokens(hf, tokens: list[int], context_token_ids: list[int]) -> list[str]:
    """vLLM's `convert_ids_list_to_tokens` then `_verify_tokens` for the alternatives `tokens` of one position
    (chosen first) after the sequence's tokens `context_token_ids` (only the last MAX_CONTEXT are used)."""
    decoded = convert_ids_list_to_tokens(hf, tokens)
    context = list(context_token_ids[-MAX_CONTEXT:])
    return [correct_decoded_token(hf, t, context) if s.endswith("\ufffd") else s for t, s in zip(tokens, decoded, strict=True)]


def token_strings(folder: str | Path, tokens: list[int], context_token_ids: list[int]) -> list[str]:
    """`verify_tokens` with transformers' tokenizer of the model folder `folder`."""
    return verify_tokens(hf_tokenizer(str(folder)), tokens, context_token_ids)
