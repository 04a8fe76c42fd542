"""Argument-parser behaviour shared by every `speedpipe` command: short errors, defaults in help,
`--help` / `--help-all`, `--version`, and vLLM's flag spellings.

Owns how the command line *looks* (and reading a prompts file, shared by `launch` and `bench serve`): an `ArgumentParser` whose errors are one line naming the
problem plus a one-line usage hint of the command that failed (never the top-level usage, never a
30-line usage block), a help formatter that shows every flag's default, the split of `launch`'s
flags into the everyday ones (`--help`) and the advanced ones (`--help-all`), and the checks of
vLLM's spellings (`serve MODEL`, `--tensor-parallel-size`). Must not: define a command's flags'
meaning or run anything.

[Note: vLLM names] vLLM users type `vllm serve MODEL -pp 4 --distributed-executor-backend ray`;
speedpipe accepts the same words as aliases of its own (`--stages`, `--backend`, `--model`), so a
script written for one runs on the other. Tensor parallelism does not exist here: the only accepted
`--tensor-parallel-size` is 1, anything else is a usage error that points at `--stages`.
"""

from __future__ import annotations

import argparse
import json
from importlib import metadata
from pathlib import Path

from pipeline.speculation.grammar import GrammarSpec


class UsageError(ValueError):
    """Bad user input detected by the CLI itself (exit 2)."""


SHORT_HELP_GROUPS = ("placement", "serving (OpenAI-compatible HTTP and gRPC)")
# Flags of other groups that only `--help-all` lists (speculation tuning, rarely needed knobs).
ADVANCED_DESTS = frozenset({
    "firp_k", "firp_file", "firp_min_prob", "row_cost", "row_cost_file", "exit_predictor", "exit_layer", "max_inflight", "min_acceptance", "draft_at",
    "deep_draft_min_acceptance", "decode_feed", "speculative_disable_by_batch_size",
    "draft_tree", "grammar_drafting",
    "threads_per_stage", "stage_timeout_s", "cache_dir", "no_timeline", "no_progress", "tensor_parallel_size",
    "stage_memory_gib", "max_stage_restarts", "restart_window_s", "dense_layout", "top_k", "min_p", "logit_bias",
    "min_tokens", "stop_token_ids", "allowed_token_ids", "bad_words",
    "response_format", "json_schema", "regex", "choice", "grammar", "skip_special_tokens", "include_stop_str_in_output",
})


def version_string() -> str:
    """`speedpipe X.Y.Z` from the installed package metadata ("unknown" when not installed)."""
    try:
        return f"speedpipe {metadata.version('speedpipe')}"
    except metadata.PackageNotFoundError:
        return "speedpipe (version unknown: not installed)"


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends ` (default: X)` to every flag whose help text does not already state its default.
    Flags that are off by default (store_true), required ones and empty repeatable lists show nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or action.default is argparse.SUPPRESS or not action.option_strings
                or action.required):
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._HelpAction, argparse._VersionAction)):
            return text
        if action.default in ([], ()):
            return text
        shown = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {shown})"


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are short: `PROG: error: MESSAGE` and a one-line usage hint
    naming this (sub)command's --help. Exits 2, like argparse."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(2, f"{self.prog}: error: {message}\nusage: {self.prog} [OPTIONS]  (see `{self.prog} --help`)\n")


class HelpAllAction(argparse.Action):
    """`--help-all`: print the help with every flag (the advanced ones included), exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:  # noqa: SLF001 - argparse has no public action list
            if getattr(action, "full_help", None) is not None:
                action.help = action.full_help
        parser.print_help()
        parser.exit()


def shorten_help(parser: argparse.ArgumentParser, *, hidden_groups: tuple[str, ...] = SHORT_HELP_GROUPS,
                 advanced: frozenset[str] = ADVANCED_DESTS) -> None:
    """Hide the advanced flags of `parser` from `--help` (they still parse) and add `--help-all`.
    `launch --serve` itself stays listed; the flags of what it starts are advanced."""
    count = 0
    for group in parser._action_groups:  # noqa: SLF001
        for action in group._group_actions:  # noqa: SLF001
            if action.help is argparse.SUPPRESS:
                continue
            if (group.title in hidden_groups and action.dest != "serve") or action.dest in advanced:
                action.full_help = action.help
                action.help = argparse.SUPPRESS
                count += 1
    parser.add_argument("--help-all", action=HelpAllAction,
                        help=f"show every flag, also the {count} advanced ones this help leaves out")


def add_vllm_aliases(group: argparse._ArgumentGroup) -> None:
    """`--tensor-parallel-size/-tp` (only 1 is accepted; see check_vllm_args)."""
    group.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                       help="vLLM's flag; speedpipe splits by layers, so only 1 is accepted")


def check_vllm_args(args: argparse.Namespace) -> None:
    """Apply vLLM spellings to a parsed namespace. Raises ValueError (exit 2) naming the flag."""
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(f"--tensor-parallel-size {tp}: tensor parallelism is not supported (only 1); "
                         f"speedpipe splits the model by layers: use --pipeline-parallel-size/--stages {tp}")
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model_given and args.model != tag:
            raise ValueError(f"the model is given twice: positional {tag!r} and --model {args.model!r}; give one")
        args.model = tag


def mark_model_given(argv: list[str]) -> bool:
    """True if `--model` appears on the command line (so a positional MODEL can be checked against it)."""
    return flag_given(argv, "--model")


def flag_given(argv: list[str], flag: str) -> bool:
    """True if `flag` (e.g. "--model") appears on the command line, as `FLAG V` or `FLAG=V`, or
    abbreviated as argparse accepts it (`--mod V`: argv parsed, so the prefix named one option)."""
    return any(2 < len(opt) and flag.startswith(opt) for opt in (a.split("=", 1)[0] for a in argv
                                                                  if a.startswith("--")))


def logit_bias_json(text: str) -> dict:
    """`--logit-bias` value: a JSON object ('{"50256": -100}'); SamplingParams checks its ids and biases.
    Raises argparse.ArgumentTypeError (exit 2, naming the flag) for text that is not a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of token id -> bias, got {text[:80]!r}")
    return value


def token_id_list(text: str) -> tuple[int, ...]:
    """`--stop-token-ids` / `--allowed-token-ids` value: comma-separated token ids ("2,13"); SamplingParams
    checks their range, count and vocabulary. Raises argparse.ArgumentTypeError (exit 2, naming the flag)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdecimal() and p.isascii() for p in parts):
        raise argparse.ArgumentTypeError(f"must be comma-separated token ids (integers >= 0), got {text[:80]!r}")
    return tuple(int(p) for p in parts)


def unescape(text: str) -> str:
    """`--stop` values: turn the two-character sequences \\n, \\t, \\r and \\\\ into the characters
    (a shell passes `"\\n\\n"` as backslash-n-backslash-n); everything else is kept as typed."""
    out, i = [], 0
    table = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in table:
            out.append(table[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def read_prompts_file(name: str, *, flag: str = "--prompts-file") -> list[str]:
    """Prompts of a file: one per line (blank lines skipped), or JSONL objects with a string 'prompt'
    (a .jsonl file, or one whose first prompt line starts with "{").
    A leading UTF-8 byte-order mark is dropped. Raises UsageError naming `flag` and the file:
    missing, a directory or other non-regular file, not UTF-8 text, bad JSON."""
    path = Path(name)
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory, not a file of prompts")
    if not path.exists():
        raise UsageError(f"{flag} {path} does not exist")
    if not path.is_file():
        raise UsageError(f"{flag} {path} is not a regular file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not prompt text
    except UnicodeDecodeError as exc:
        raise UsageError(f"{flag} {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                         f"{exc.start}): give one prompt per line or JSONL") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    # JSONL is a property of the file (its name, or its first prompt line), not of each line: a
    # plain-text prompt may start with "{".
    jsonl = path.suffix == ".jsonl" or (bool(lines) and lines[0][1].lstrip().startswith("{"))
    prompts = []
    for n, line in lines:
        if jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{flag} {path}:{n}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise UsageError(f"{flag} {path}:{n}: expected an object with a string 'prompt'")
            prompts.append(obj["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise UsageError(f"{flag} {path} has no prompt")
    return prompts


def add_row_cost_flag(group: argparse._ArgumentGroup) -> None:
    """`--row-cost` and its older spelling `--row-cost-file PATH` (= `--row-cost file:PATH`)
    ([Note: row-cost-driven chains] in pipeline/engine/row_budget.py, [Note: run-ahead depth] in
    pipeline/measure/row_cost.py)."""
    group.add_argument("--row-cost", default="auto", metavar="auto|none|calibrate|file:PATH",
                       help="where the cost of a pass by its number of rows comes from: calibrate = every stage "
                       "times its own 1..N-row passes at start-up (about a second); file:PATH = a "
                       "tests/benchmarks/row_cost.py JSON report; none = no table (fixed --firp-k chains, "
                       "run-ahead = --stages). With a table, FIRP chain lengths and the SPEED run-ahead depth "
                       "(unless --max-inflight is given) follow it and the measured acceptance (default auto: "
                       "calibrate when --speculate uses FIRP, else none)")
    group.add_argument("--row-cost-file", metavar="PATH", help="the same as --row-cost file:PATH (kept for "
                       "existing scripts)")


def min_acceptance_arg(text: str) -> float | None:
    """--min-acceptance: 'auto' (None) or a probability."""
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise UsageError(f"--min-acceptance must be 'auto' or a number in [0, 1], got {text!r}")
    return value


def read_prompts(args: argparse.Namespace) -> list[str]:
    """Prompts from --prompt and --prompts-file, in order. Raises UsageError."""
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        raise UsageError("no prompt given: use --prompt TEXT (repeatable) or --prompts-file FILE")
    for i, p in enumerate(prompts):  # whitespace is text to a tokenizer (the server takes it too)
        if not p:
            raise UsageError(f"prompt {i} is empty")
    return prompts


def structured_output_flags(args: argparse.Namespace) -> dict[str, object]:
    """{flag: value} of the structured output flags given (`--response-format json_object`, `--json-schema`,
    `--regex`, `--choice`, `--grammar`): the command line's words for a request's `response_format`."""
    return {flag: value for flag, value in (("--response-format json_object", args.response_format == "json_object"),
                                            ("--json-schema", args.json_schema), ("--regex", args.regex),
                                            ("--choice", args.choice), ("--grammar", args.grammar)) if value}


def grammar_from_args(args: argparse.Namespace) -> GrammarSpec | None:
    """The structured output constraint of `--response-format json_object`, `--json-schema PATH`, `--regex`,
    `--choice` or `--grammar PATH` (at most one of them), or None. Raises UsageError naming the flag (exit 2)
    for two of them, one with --ignore-eos, an unreadable file, or a schema / regex / grammar llguidance refuses."""
    given = structured_output_flags(args)
    if not given:
        return None
    if len(given) > 1 or args.ignore_eos:
        raise UsageError(f"{', '.join([*given, *['--ignore-eos'] * args.ignore_eos])} cannot be used together "
                         "(one structured output, which ends with EOS)")
    ((flag, value),) = given.items()
    try:
        if flag in ("--json-schema", "--grammar"):
            try:
                text = Path(value).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read {value}: {exc.strerror if isinstance(exc, OSError) else exc}") from None
            return GrammarSpec(kind=flag.removeprefix("--").replace("-", "_"), text=text)
        if flag == "--regex":
            return GrammarSpec(kind="regex", text=value)
        return GrammarSpec.choice(value) if flag == "--choice" else GrammarSpec(kind="json_object")
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
