"""`launch` structured output flags: --response-format json_object, --json-schema PATH, --regex, --choice,
--grammar PATH.

What breaks when these fail: a flag does not reach SamplingParams.grammar (the run is unconstrained),
two constraints (or one with --ignore-eos) are taken together, a bad schema file or regex is accepted
or refused without naming the flag, or `launch --serve` silently ignores them (a server takes them
per request). A constrained run on the tiny model is in tests/distributed/test_structured_outputs_tiny.py.
"""

from __future__ import annotations

import json

import pytest

from launcher.cli.main import UsageError, _parse, build_parser, main, sampling_params
from pipeline.speculation.grammar import GrammarSpec

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
GBNF = 'root ::= "n=" [0-9]+'



def _params(*flags: str):
    return sampling_params(_parse(build_parser(), ["launch", *flags]))


def test_each_flag_reaches_the_sampling_params(tmp_path):
    path, grammar = tmp_path / "schema.json", tmp_path / "g.gbnf"
    path.write_text(json.dumps(SCHEMA))
    grammar.write_text(GBNF)
    assert _params().grammar is None and _params("--response-format", "text").grammar is None
    assert _params("--response-format", "json_object").grammar == GrammarSpec(kind="json_object")
    assert _params("--json-schema", str(path)).grammar == GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))
    assert _params("--regex", "[0-9]+").grammar == GrammarSpec(kind="regex", text="[0-9]+")
    assert _params("--choice", "yes", "--choice", "no").grammar == GrammarSpec.choice(["yes", "no"])
    assert _params("--grammar", str(grammar)).grammar == GrammarSpec(kind="grammar", text=GBNF)


@pytest.mark.parametrize(("flags", "message"), [
    (["--regex", "a(b"], "--regex: invalid regex: "),
    (["--json-schema", "/nonexistent/s.json"], "--json-schema: cannot read /nonexistent/s.json"),
    (["--regex", "a", "--choice", "a"], "--regex, --choice cannot be used together"),
    (["--response-format", "json_object", "--ignore-eos"], "--response-format json_object, --ignore-eos cannot"),
    (["--choice", ""], "--choice: choice must be a non-empty list of non-empty strings"),
    (["--grammar", "/nonexistent/g.lark"], "--grammar: cannot read /nonexistent/g.lark"),
    (["--grammar", "/nonexistent/g.lark", "--regex", "a"], "--regex, --grammar cannot be used together"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(flags, message):
    with pytest.raises(UsageError) as info:
        _params(*flags)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), info.value


def test_a_bad_schema_file_is_refused_naming_the_flag(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"type": 3}')
    with pytest.raises(UsageError, match="--json-schema: invalid json schema: type must be"):
        _params("--json-schema", str(path))


@pytest.mark.parametrize(("text", "message"), [("start: undefined_rule", 'unknown name: "undefined_rule"'),
                                               ('root ::= "a" (', "Expected ')'"), ("", "empty")])
def test_a_bad_grammar_file_exits_2_with_one_line_naming_the_flag(tmp_path, capsys, text, message):
    path = tmp_path / "g.txt"
    path.write_text(text)
    assert main(["launch", "--prompt", "Hi", "--grammar", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--grammar: invalid grammar: " in err and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("flags", [["--regex", "[0-9]+"], ["--response-format", "json_object"], ["--choice", "a"],
                                   ["--grammar", "g.lark"]])
def test_serve_refuses_structured_output_flags(capsys, flags):
    assert main(["launch", "--serve", *flags]) == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} cannot be used with --serve" in err and len(err.strip().splitlines()) == 1
