"""Grammar: structured outputs (JSON object, JSON schema, regex, choice, grammar, structural tag) as a logits mask.

Owns `GrammarSpec` (a request's constraint: frozen, hashable, checked once when it is made),
`GrammarVocab` (a tokenizer compiled once per engine for the llguidance library) and `GrammarState`
(one sequence's matcher, kept in step with the prefix it is asked about). See [Note: grammar masks].
Must not: choose tokens (pipeline/speculation/verify.py masks the rows it chooses from), do I/O,
or know the HTTP / gRPC shapes of the constraint (launcher/serving/formats/ parses them).

[Note: grammar masks]
A constrained request's tokens are chosen from its logits rows with every token the grammar does
not allow after the row's prefix set to -inf (llguidance's token masks: Moskal et al., "llguidance",
github.com/guidance-ai/llguidance; the same library vLLM, SGLang and llama.cpp use). The mask comes
after the logit bias and the penalties (vLLM applies structured-output bitmasks after its logits
processors), before temperature and the filters, in the one verify path (`verify_result`) that
decides every committed token; row i's prefix is the committed output plus the tokens the same
result committed before it, exactly plain decoding's history there. So a draft the grammar forbids
has p = 0 and is rejected, greedy takes the masked argmax, and output under every speculation mode
and stage count is token-identical to plain masked decoding. `GrammarState` is a function of the
prefix it is given: it consumes the tokens the prefix adds and rolls back (or rebuilds) when asked
about a shorter or different one (a replay after a stage failure), so verify stays a function of
its inputs. When the grammar is complete llguidance allows only EOS, so generation ends with a
whole document (unless the token budget ends it first: finish reason "length", a truncated one).
Reported logprobs stay the raw model's, as with logit_bias ([Note: logprobs and penalties]).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import numpy as np
import torch

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")
# Longest spec text (schema JSON, regex, choice list as JSON, grammar, structural tag JSON). Compile time grows faster than linearly with
# size (SmolLM2 tokenizer, one core: 40k choices, 0.8 MB: 3.5 s; 100k, 2 MB: 19 s, inside the 4 MiB body
# limit); at this size every kind compiles in under ~0.3 s. OpenAI caps enum text at 120k characters.
MAX_GRAMMAR_CHARS = 2**18
MAX_COMPILED = 16  # compiled matchers a GrammarVocab keeps (specs in use; `GrammarVocab.matcher`)
# JSON as json.dumps writes it (", " and ": ", no other whitespace): flexible whitespace lets a small model
# emit spaces and newlines without end (llguidance's default allows any run of them between tokens).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# llguidance compiles a grammar recursively, one native stack frame chain per level of rule references: on a
# thread's usual 8 MiB stack a 75 kB JSON schema of 1,000 chained $refs, or a Lark / GBNF grammar of ~2,500
# chained rules, overflowed it and killed the process (SIGSEGV). On a thread with this much stack (address
# space, committed only as used) chains near the size limit compiled: 11,000 Lark rules (242 kB), 3,400 $refs.
COMPILE_STACK_BYTES = 256 * 2**20
_STACK_LOCK = threading.Lock()


def on_deep_stack(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), run on a new thread with COMPILE_STACK_BYTES of stack (llguidance's compiles: see above),
    its exception re-raised here. `threading.stack_size` is process-wide: set only while this thread starts."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = exc

    with _STACK_LOCK:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="llguidance-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


class GrammarError(RuntimeError):
    """A constrained sequence cannot go on: its matcher rejected a token or allows none. `tokens`
    are the tokens the failing result committed before the row that failed (valid ones). `fields`: the
    request's fields (SamplingParams names, the grammar's `GrammarSpec.field` for it) whose masks together allow no
    token there, a dead end of the request's own input that servers answer as bad input ([Note: no token
    left] in pipeline/speculation/verify.py); () when the matcher itself failed (an internal error)."""

    def __init__(self, message: str, tokens: Sequence[int] = (), *, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.tokens, self.fields = tuple(tokens), tuple(fields)


def _first_line(text: str, limit: int = 240) -> str:
    """llguidance's (often multi-line) message as one line: its first line, with the `error:` line of
    a regex parse error after it, cut at `limit` characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    line = " ".join([lines[0], *[x for x in lines[1:] if x.startswith("error:")][:1]])
    return line if len(line) <= limit else line[:limit] + "…"


_PROBLEMS: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()  # `_grammar_problem`'s results
_PROBLEMS_LOCK = threading.Lock()  # the front ends' threads share `_PROBLEMS`
MAX_PROBLEMS = 64  # validation results kept (by the grammar's SHA-256: a result never pins the text)


def _grammar_problem(grammar: str) -> str | None:
    """llguidance's one-line reason why `grammar` is invalid, else None. The last MAX_PROBLEMS results are
    kept under the grammar's SHA-256 (not its text: 64 texts of up to MAX_GRAMMAR_CHARS characters held
    ~64 MiB), so a spec renamed by `GrammarSpec.asked_by` is not checked again."""
    key = hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).digest()
    with _PROBLEMS_LOCK:
        if key in _PROBLEMS:
            _PROBLEMS.move_to_end(key)
            return _PROBLEMS[key]
    is_error, messages = on_deep_stack(llguidance.LLMatcher.validate_grammar_with_warnings, grammar)
    problem = _first_line(messages[0]) if is_error else None
    with _PROBLEMS_LOCK:
        _PROBLEMS[key] = problem
        while len(_PROBLEMS) > MAX_PROBLEMS:
            _PROBLEMS.popitem(last=False)
    return problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrammarSpec:
    """One request's output constraint.

    kind: "json_object" (any JSON object; text ""), "json_schema" (text: the schema's JSON),
    "regex" (text: the pattern, matched by the whole output, Rust `regex` syntax), "choice" (text: a
    JSON array of the allowed output strings), "grammar" (text: a context-free grammar, llguidance's
    Lark dialect, or llama.cpp's GBNF (`root ::= ...`), converted to Lark: `_grammar_text`),
    "structural_tag" (text: {"structures": [{"begin", "schema", "end"}], "triggers": [str]} as JSON:
    `_struct_tag_grammar`). `grammar` is llguidance's grammar for it.
    Raises ValueError (one line, llguidance's reason) for an unknown kind, text that is not
    valid for the kind, an unparsable or unsupported schema, an invalid regex or grammar.
    """

    kind: str
    text: str = ""
    # the request field that asked for the constraint, as a dead end names it ([Note: no token left] in
    # pipeline/speculation/verify.py): response_format, structured_outputs, tool_choice, gRPC's structured_output
    field: str = dataclasses.field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"{self.kind} must be given as a string, got {type(self.text).__name__}")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{self.kind.replace('_', ' ')} is {len(self.text)} characters long, over the limit of "
                             f"{MAX_GRAMMAR_CHARS}")
        problem = _grammar_problem(self.grammar)
        if problem is not None:
            raise ValueError(f"invalid {self.kind.replace('_', ' ')}: {problem}")

    def asked_by(self, field: str) -> GrammarSpec:
        """This constraint, named after the request field `field` that asked for it (checked once only)."""
        return dataclasses.replace(self, field=field)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        """The spec allowing exactly one of `choices` (non-empty strings). Raises ValueError."""
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return cls(kind="choice", text=json.dumps(list(choices)))

    @functools.cached_property
    def grammar(self) -> str:
        """llguidance's grammar (JSON text) for this spec. Raises ValueError for text that is not
        valid JSON (a schema, or a choice list)."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "grammar":
            return _grammar_text(self.text)
        try:
            value = json.loads(self.text)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's recursion limit
            raise ValueError(f"invalid {self.kind.replace('_', ' ')}: not JSON ({exc})") from None
        if self.kind == "json_schema":
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"invalid json schema: must be a JSON object, got {type(value).__name__}")
            if value is False:
                raise ValueError("invalid json schema: false allows no document")
            value = {} if value is True else value  # true: any JSON value (llguidance's options need an object)
            return llguidance.LLMatcher.grammar_from_json_schema(value, overrides=_JSON_OPTIONS)
        if self.kind == "structural_tag":
            return _struct_tag_grammar(value)
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        # Lark string literals are JSON strings; llguidance matches them byte for byte.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))


def _grammar_text(text: str) -> str:
    """llguidance's grammar for a `grammar` spec, as vLLM's guidance backend reads `structured_outputs.grammar`
    (`llguidance.grammar_from("grammar", text)`): Lark when a line starts, after spaces, with `start` and a colon
    or with `%llguidance` (`gbnf_to_lark.is_lark_syntax`; so GBNF's `start ::=` too), otherwise GBNF, converted
    by `llguidance.gbnf_to_lark` (its `root` rule becomes `start`). Raises ValueError (one line) for GBNF it
    cannot convert; Lark errors surface in GrammarSpec's validation."""
    if not text.strip():
        raise ValueError("invalid grammar: empty")
    try:
        return llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        raise ValueError(f"invalid grammar: {_first_line(str(exc))}") from None


def _struct_tag_grammar(value: Any) -> str:
    """llguidance's grammar for a structural tag (vLLM's `structural_tag`, its guidance backend's reading):
    free text in which each trigger starts a region `begin` JSON(schema) `end`, by `llguidance.StructTag`.
    value: {"structures": [{"begin": str, "schema": object or null (any JSON), "end": str}], "triggers": [str]};
    each begin starts with a trigger. Triggers are matched as text, never as special tokens (a spec does not
    know the tokenizer; one `<...>` that is no special token of it would fail every request). Raises ValueError."""
    structures, triggers = (value.get("structures"), value.get("triggers")) if isinstance(value, dict) else (0, 0)
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError("invalid structural tag: 'triggers' must be a non-empty list of non-empty strings")
    if not (isinstance(structures, list) and structures):
        raise ValueError("invalid structural tag: 'structures' must be a non-empty list")
    tags = []
    for i, s in enumerate(structures):
        begin, end, schema = (s.get("begin"), s.get("end"), s.get("schema")) if isinstance(s, dict) else (0, 0, 0)
        if not (isinstance(begin, str) and isinstance(end, str) and isinstance(schema, (dict, type(None)))):
            raise ValueError(f"invalid structural tag: structure {i} must have strings 'begin' and 'end' and an "
                             "object 'schema'")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"invalid structural tag: structure {i}'s begin {begin!r} starts with no trigger")
        options = {"x-guidance": dict(_JSON_OPTIONS)}  # JSON as json.dumps writes it
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, end=end, grammar={**(schema or {}), **options}))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


class GrammarVocab:
    """A tokenizer as llguidance sees it, shared by every constrained sequence of one engine.

    tokenizer_json: the Hugging Face `tokenizers` JSON (`tokenizers.Tokenizer.to_str()`);
    eos_token_ids: the tokens that end a sequence (allowed once the grammar is complete).
    The llguidance tokenizer (~0.3-1 s to build for a 49k vocabulary) is built on first use, so
    engines that never see a constrained request pay nothing. Raises ValueError from `ll` for a
    tokenizer llguidance cannot read.
    """

    def __init__(self, tokenizer_json: str, *, eos_token_ids: Sequence[int]) -> None:
        self._json, self.eos_token_ids = tokenizer_json, tuple(eos_token_ids)
        self._compiled: collections.OrderedDict[GrammarSpec, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()  # the front ends' threads and the engine's share `_compiled`

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def of(tokenizer: Any) -> GrammarVocab:
        """The vocab of a `pipeline.model.tokenizer.Tokenizer` (its `to_json()` and `eos_token_ids`), one per
        tokenizer object: the coordinator's engine and its request checks share it (and its llguidance build)."""
        return GrammarVocab(tokenizer.to_json(), eos_token_ids=tokenizer.eos_token_ids)

    @functools.cached_property
    def ll(self) -> llguidance.LLTokenizer:
        try:
            return llguidance.LLTokenizer(self._json, eos_token=list(self.eos_token_ids) or None)
        except Exception as exc:  # llguidance raises plain exceptions (ValueError, RuntimeError)
            raise ValueError(f"structured outputs cannot use this tokenizer: {_first_line(str(exc))}") from None

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A new matcher for `spec`, at the start of the output: a copy (~0.1 ms) of one compiled once per spec
        (up to ~0.3 s) and kept for the last MAX_COMPILED specs, so the front end compiles it on the request's
        thread (`pipeline.engine`'s callers: launcher/coordinator/request_handle.py) and the engine thread and
        the n choices of one request only copy it. Never raises for the grammar: one that fails with this
        tokenizer (llguidance's limits) gives a matcher in its error state ([Note: grammar masks])."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled.deep_copy()
        compiled = on_deep_stack(functools.partial(  # outside the lock: may be slow
            llguidance.LLMatcher, self.ll, spec.grammar, log_level=0))
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
            return compiled.deep_copy()


class GrammarState:
    """One constrained sequence's llguidance matcher, answering which tokens may follow a prefix.

    The matcher holds the tokens it consumed; `sync(prefix)` makes them the given prefix of the
    sequence's output (consuming what it adds, rolling back what differs). [Note: grammar masks]
    Raises GrammarError when the prefix holds a token the grammar forbids, or the grammar cannot be
    built with this tokenizer (from `allowed`, never from the constructor, which runs on the engine's
    thread at admission); ValueError from the constructor for a tokenizer llguidance cannot read.
    """

    def __init__(self, spec: GrammarSpec, vocab: GrammarVocab) -> None:
        self.spec, self.vocab = spec, vocab
        self._matcher = self._new_matcher()
        self.tokens: list[int] = []  # the tokens the matcher consumed, in order
        self._bitmask = torch.zeros((vocab.ll.vocab_size + 31) // 32, dtype=torch.int32)

    def _new_matcher(self) -> llguidance.LLMatcher:
        # Never raises: a grammar that fails with this tokenizer (llguidance's limits) leaves the matcher in
        # its error state, which the first `allowed` reports as a GrammarError that fails this request alone.
        return self.vocab.matcher(self.spec)

    def sync(self, prefix: Sequence[int]) -> None:
        """Make the consumed tokens equal `prefix` (the sequence's output so far). Raises GrammarError."""
        if self._matcher.is_error():  # a failed sync left it there: start again
            self._matcher, self.tokens = self._new_matcher(), []
        common = 0
        limit = min(len(self.tokens), len(prefix))
        if self.tokens[:limit] == list(prefix[:limit]):
            common = limit
        else:
            while common < limit and self.tokens[common] == prefix[common]:
                common += 1
        if common < len(self.tokens):
            if not self._matcher.rollback(len(self.tokens) - common):
                self._matcher, self.tokens = self._new_matcher(), []  # past llguidance's rollback: rebuild
                common = 0
            else:
                del self.tokens[common:]
        for token in prefix[common:]:
            if not self._matcher.consume_token(int(token)):
                raise GrammarError(f"output token {len(self.tokens)} ({int(token)}) breaks the structured output "
                                   f"constraint: {_first_line(self._matcher.get_error())}")
            self.tokens.append(int(token))

    def allowed(self, prefix: Sequence[int], vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar allows after `prefix` (ids the tokenizer lacks,
        at or past its vocabulary, never). Raises GrammarError when the matcher failed."""
        self.sync(prefix)
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        if self._matcher.is_error():
            raise GrammarError(f"structured output failed after {len(self.tokens)} tokens: "
                               f"{_first_line(self._matcher.get_error())}")
        n = min(vocab_size, self.vocab.ll.vocab_size)
        bits = torch.from_numpy(np.unpackbits(self._bitmask.numpy().view(np.uint8), count=n, bitorder="little")
                                .view(np.bool_))  # 0 / 1 bytes read as bool: no copy
        if n == vocab_size:
            return bits
        out = torch.zeros(vocab_size, dtype=torch.bool)
        out[:n] = bits
        return out

    def masked(self, logits: torch.Tensor, prefix: Sequence[int]) -> torch.Tensor:
        """logits: [vocab_size] float with every token not allowed after `prefix` set to -inf (a new
        tensor). Raises GrammarError when no token is allowed or the matcher failed."""
        allowed = self.allowed(prefix, logits.shape[-1]).to(logits.device)
        if not bool(allowed.any()):
            raise GrammarError(f"no token of the model's vocabulary continues the structured output after "
                               f"{len(self.tokens)} tokens", fields=(self.spec.field,))
        return torch.where(allowed, logits.float(), float("-inf"))

    @property
    def is_complete(self) -> bool:
        """True when the consumed tokens form a whole document (the grammar accepts here)."""
        return self._matcher.is_accepting()
