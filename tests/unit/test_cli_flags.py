"""The command line's surface, in process (nothing is spawned): vLLM's spellings, `--version`,
defaults in every help line, the short `launch --help` and `--help-all`, short per-command errors,
`--stop` escapes and the prompts-file errors. What breaks if these fail: a vLLM user's flags are
refused, or a mistake prints a wall of usage instead of one line naming it.
"""

from __future__ import annotations

import argparse
import re

import pytest

from launcher.bench.plots import percent_label
from launcher.cli.errors import flag_message
from launcher.cli.launch import plural
from launcher.cli.main import UsageError, _parse, build_parser, main
from launcher.cli.parsing import DefaultsFormatter, read_prompts_file, unescape, version_string

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def _exit(capsys, argv: list[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def test_vllm_spellings_parse_to_speedpipe_options(parser):
    args = _parse(parser, ["launch", "-pp", "3", "--distributed-executor-backend", "mp", "-tp", "1"])
    assert (args.stages, args.backend, args.tensor_parallel_size) == (3, "local", 1)
    args = _parse(parser, ["serve", "smollm2-135m", "--pipeline-parallel-size", "4",
                           "--distributed-executor-backend", "ray"])
    assert (args.model_tag, args.stages, args.backend) == ("smollm2-135m", 4, "ray")


def test_tensor_parallel_above_1_and_a_model_given_twice_are_usage_errors(capsys):
    assert main(["serve", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("speedpipe serve: error: --tensor-parallel-size 2") and "--stages" in err
    assert len(err.splitlines()) == 1
    for given in (["--model", "model-b"], ["--model=model-b"], ["--mod", "model-b"], ["--mo=model-b"]):
        assert main(["serve", "model-a", *given]) == 2  # abbreviated: positional model-a won silently
        assert "given twice" in capsys.readouterr().err
    assert main(["serve", "-tp", "1", "--port", "70000"]) == 2  # -tp 1 accepted; the port is what fails
    assert "--port" in capsys.readouterr().err


def test_version_on_the_command_and_on_launch(capsys):
    for argv in (["--version"], ["launch", "--version"]):
        code, out, _ = _exit(capsys, argv)
        assert code == 0 and out.strip() == version_string() and out.startswith("speedpipe ")


def test_launch_help_is_short_and_help_all_lists_every_flag(capsys):
    code, short, _ = _exit(capsys, ["launch", "--help"])
    assert code == 0 and len(short.splitlines()) <= 80
    for flag in ("--stages", "--model", "--speculate", "--prompt", "--stop", "--json", "--help-all"):
        assert flag in short, flag
    hidden = ("--firp-k", "--ray-address", "--port", "--max-inflight", "--stage-timeout-s", "--nnodes")
    assert not [f for f in hidden if f in short]
    code, full, _ = _exit(capsys, ["launch", "--help-all"])
    assert code == 0 and all(f in full for f in hidden)


def test_every_flag_of_every_command_shows_its_default(parser):
    formatter = DefaultsFormatter("x")
    subparsers = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    bench = subparsers["bench"]._subparsers._group_actions[0].choices  # noqa: SLF001
    missing = []
    for name, sub in [*subparsers.items(), *(("bench " + k, v) for k, v in bench.items())]:
        for action in sub._actions:  # noqa: SLF001
            if (not action.option_strings or action.nargs == 0 or action.default in ([], ())
                    or action.help == argparse.SUPPRESS or action.required):  # required: no default to show
                continue
            if "default" not in formatter._get_help_string(action).lower():  # noqa: SLF001
                missing.append(f"{name} {action.option_strings[0]}")
    assert missing == []


@pytest.mark.parametrize(("argv", "needle"), [
    (["launch", "--stages", "abc"], "argument --stages"),
    (["launch", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["bench", "serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["simulate", "--stage-overhead-ms", "x"], "--stage-overhead-ms"),
    (["launch", "--logit-bias", "{50256: -100}"], "argument --logit-bias: not JSON (Expecting property name"),
    (["launch", "--logit-bias", "[1]"], "argument --logit-bias: must be a JSON object of token id -> bias"),
    (["launch", "--grammar-drafting", "fast"], "argument --grammar-drafting: invalid choice: 'fast'"),
    (["serve", "--grammar-drafting", "on"], "argument --grammar-drafting: invalid choice: 'on'"),
    (["launch", "--dtype", "float64"], "argument --dtype: must be one of float32, bfloat16, float16, auto, half, "
                                       "float, got 'float64'"),
    (["serve", "--dtype", "fp16"], "argument --dtype: must be one of "),
])
def test_argument_errors_are_two_lines_naming_the_command(capsys, argv, needle):
    code, _, err = _exit(capsys, argv)
    lines = err.strip().splitlines()
    command = " ".join(a for a in argv[:2] if not a.startswith("-"))
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith(f"speedpipe {command}: error: ") and needle in lines[0], lines
    assert lines[1] == f"usage: speedpipe {command} [OPTIONS]  (see `speedpipe {command} --help`)"


def test_logit_bias_json_reaches_the_sampling_params_and_bad_values_name_the_flag(capsys):
    from launcher.cli.main import sampling_params

    args = _parse(build_parser(), ["launch", "--logit-bias", '{"50256": -100, "7": 2.5}'])
    assert sampling_params(args).logit_bias == ((7, 2.5), (50256, -100.0))
    assert sampling_params(_parse(build_parser(), ["launch"])).logit_bias == ()
    args = _parse(build_parser(), ["launch", "--logit-bias", '{"7": 250}'])
    with pytest.raises(ValueError, match="logit_bias of token 7") as info:
        sampling_params(args)
    assert flag_message(str(info.value)) == "--logit-bias of token 7 must be a number in [-100, 100], got 250"


def test_stop_escapes_and_plain_text():
    assert unescape(r"\n\n") == "\n\n" and unescape(r"a\tb\\n") == "a\tb\\n" and unescape("END") == "END"
    assert unescape("\\") == "\\" and unescape(r"\x") == r"\x"
    args = _parse(build_parser(), ["launch", "--stop", r"\n\n", "--stop", "###"])
    assert args.stop == ["\n\n", "###"]


def test_prompts_file_errors_name_the_file(tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x8a\x00\xff")
    with pytest.raises(UsageError, match=rf"--prompts-file {binary} is not UTF-8 text \(byte 0x8a at offset 0\)"):
        read_prompts_file(str(binary))
    with pytest.raises(UsageError, match=f"--prompts-file {tmp_path} is a directory"):
        read_prompts_file(str(tmp_path))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(UsageError, match="has no prompt"):
        read_prompts_file(str(tmp_path / "empty.txt"))


def test_a_plain_text_prompt_may_start_with_a_brace_and_jsonl_is_read_whole(tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text('Write a haiku.\n\n{"a": 1} as YAML, please\n')
    assert read_prompts_file(str(plain)) == ["Write a haiku.", '{"a": 1} as YAML, please']
    jsonl = tmp_path / "prompts.txt"
    jsonl.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    assert read_prompts_file(str(jsonl)) == ["one", "two"]
    jsonl.write_text('{"prompt": "one"}\nplain\n')
    with pytest.raises(UsageError, match=r"prompts.txt:2: invalid JSON"):
        read_prompts_file(str(jsonl))


def test_counts_and_percent_labels_read_well():
    assert (plural(1, "item"), plural(0, "item"), plural(3, "item")) == ("1 item", "0 items", "3 items")
    assert (percent_label(-0.001), percent_label(0.126), percent_label(-0.05)) == ("0%", "+13%", "-5%")


def _readme_flag_table(title: str) -> list[str]:
    """The flags named in the first column of the README table that follows the line `title`."""
    import pathlib
    import re
    lines = (pathlib.Path(__file__).parents[2] / "README.md").read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[i + 3:]:
        if not line.startswith("|"):
            break
        rows += re.findall(r"`(-[-\w]+)", line.split("|")[1])
    return rows


def test_the_readme_flag_tables_match_launch_help_and_help_all(parser):
    """README "Everyday flags" lists only what `launch --help` shows, "Advanced flags" only what
    `--help-all` adds; every flag named exists."""
    from launcher.cli.parsing import ADVANCED_DESTS
    launch = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("launch"))
    dest_of = {opt: a.dest for a in launch._actions for opt in a.option_strings}
    everyday, advanced = _readme_flag_table("Everyday flags"), _readme_flag_table("Advanced flags")
    assert everyday and advanced
    unknown = [f for f in everyday + advanced if f not in dest_of]
    assert not unknown, f"README names flags `launch` does not have: {unknown}"
    assert not [f for f in everyday if dest_of[f] in ADVANCED_DESTS], "an advanced flag in the everyday table"
    assert not [f for f in advanced if dest_of[f] not in ADVANCED_DESTS], "an everyday flag in the advanced table"


def test_launch_says_which_draft_threshold_it_uses_and_why(monkeypatch):
    """The `--min-acceptance auto` line `launch` prints: 0.5 where 4 local CPU stages share 2 CPUs,
    the per-core break-even where every stage has its own (Ray bundles here)."""
    from launcher.backends.placement import PlacementOptions
    from launcher.cli.speculation_defaults import draft_gate_note
    from launcher.coordinator.pipeline_options import PipelineOptions

    monkeypatch.setattr("launcher.backends.placement.usable_cpus", lambda: 2)
    shared = draft_gate_note(PipelineOptions(num_stages=4, speculate="speed"))
    assert ">= 50%" in shared and "2 of 4 stages compute at once" in shared
    own = draft_gate_note(PipelineOptions(num_stages=2, speculate="speed", placement=PlacementOptions(backend="ray", ray_address="10.0.0.10:6379")))
    assert ">= 9%" in own and "2 stages, each on its own cores" in own


def test_serve_refuses_the_flags_of_a_prompt_run(capsys):
    """`launch --serve --prompt ... --json` started a server and ignored both: exit 2 instead."""
    assert main(["launch", "--serve", "--prompt", "hi", "--json"]) == 2
    err = capsys.readouterr().err
    assert "--prompt, --json cannot be used with --serve" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags", [["--logit-bias", '{"50256": -100}'], ["--temperature", "0.7"], ["--stop", "x"],
                                   ["--max-new-tokens", "8", "--ignore-eos"]])
def test_serve_refuses_sampling_flags_it_would_ignore(capsys, flags):
    """`launch --serve --logit-bias ...` (or --temperature, --stop, ...) started a server that never
    used them (a server takes them per request; `serve` has no such flags): exit 2 naming them."""
    assert main(["launch", "--serve", *flags]) == 2
    err = capsys.readouterr().err
    named = [f for f in flags if f.startswith("--")]
    assert f"{', '.join(named)} cannot be used with --serve" in err and len(err.strip().splitlines()) == 1


def test_speculation_flags_without_speculation_are_named(capsys):
    """`--speculate none --draft-at stage` runs plain decoding: the flag is named as doing nothing."""
    from launcher.cli.options import options_and_reason

    args = _parse(build_parser(), ["launch", "--stages", "2", "--speculate", "none", "--draft-at", "stage",
                                   "--firp-k", "3"])
    options_and_reason(args, progress=False)
    assert "note: --draft-at, --firp-k have no effect with --speculate none" in capsys.readouterr().err
    args = _parse(build_parser(), ["launch", "--stages", "2", "--speculate", "none", "--grammar-drafting", "off"])
    options_and_reason(args, progress=False)  # (two fields, one flag: named once)
    assert "note: --grammar-drafting has no effect with --speculate none" in capsys.readouterr().err


def test_vllm_dtype_spellings_are_accepted():
    assert [_parse(build_parser(), ["launch", "--dtype", d]).dtype for d in ("auto", "half", "float", "bfloat16")] == [
        "float32", "float16", "float32", "bfloat16"]


# vLLM's --dtype values (vllm/config/model.py `ModelDType`), the reference of what the flag accepts.
VLLM_DTYPES = {"auto", "half", "float16", "bfloat16", "float", "float32"}


def _commands(parser) -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its argv prefix ("launch", "bench sweep", ...)."""
    subparsers = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    bench = subparsers["bench"]._subparsers._group_actions[0].choices  # noqa: SLF001
    return {**subparsers, **{"bench " + k: v for k, v in bench.items()}}


DTYPE_COMMANDS = ["launch", "serve", "bench sweep", "simulate"]


def test_every_command_with_a_dtype_flag_is_checked_below(parser):
    with_dtype = [n for n, sub in _commands(parser).items() if any(a.dest == "dtype" for a in sub._actions)]  # noqa: SLF001
    assert sorted(with_dtype) == sorted(DTYPE_COMMANDS)


@pytest.mark.parametrize("command", DTYPE_COMMANDS)
def test_dtype_help_and_error_list_exactly_the_values_it_accepts(capsys, parser, command):
    """The help listed float32 | bfloat16 | float16 although auto / half / float were accepted too, and a bad value's
    error named only those three: both now list vLLM's six, each of which parses to a model dtype name. `bench sweep`
    and `simulate` refused auto / half / float that launch and serve took (RunConfig's "--dtype must be one of
    float32, bfloat16, float16")."""
    from pipeline.model.config import MODEL_DTYPES

    action = next(a for a in _commands(parser)[command]._actions if a.dest == "dtype")  # noqa: SLF001
    assert {action.type(d) for d in VLLM_DTYPES} == set(MODEL_DTYPES)
    if command in ("launch", "serve"):
        assert {_parse(parser, [command, "--dtype", d]).dtype for d in VLLM_DTYPES} == set(MODEL_DTYPES)
    assert set(re.findall(r"\b(?:b?float\d*|half|auto)\b", action.help)) == VLLM_DTYPES, action.help
    code, _, err = _exit(capsys, [*command.split(), "--dtype", "float64"])
    listed = err.splitlines()[0].partition("must be one of ")[2].partition(", got")[0]
    assert code == 2 and set(listed.split(", ")) == VLLM_DTYPES, err


def test_without_max_model_len_its_default_is_lowered_to_the_models_context(tmp_path):
    """Before: a model with max_position_embeddings 512 was refused unless the user lowered
    --max-model-len, a flag they had not given (exit 2); vLLM derives the default from the model."""
    from launcher.cli.options import DEFAULT_MAX_MODEL_LEN, options_and_reason
    from launcher.coordinator.run_plan import resolve
    from tests.tiny_model import write_tiny_model

    short = write_tiny_model(tmp_path / "short", max_position_embeddings=512)
    base = ["launch", "--model", str(short), "--stages", "2", "--speculate", "none"]
    options, _ = options_and_reason(_parse(build_parser(), base), progress=False)
    assert options.max_model_len == 512
    assert resolve(options).config.max_position_embeddings == 512  # not refused
    for given in (["--max-model-len", "600"], ["--max-model-len=600"], ["--max-model", "600"], ["--max-m=600"]):
        # asked for (abbreviations too, which argparse takes): kept, then refused
        options, _ = options_and_reason(_parse(build_parser(), base + given), progress=False)
        assert options.max_model_len == 600
        with pytest.raises(ValueError, match=r"max_model_len 600 is more than the model's context 512 \(max_position_embeddings, config.json\)"):
            resolve(options)
    long = write_tiny_model(tmp_path / "long", max_position_embeddings=8192)
    args = _parse(build_parser(), ["launch", "--model", str(long), "--stages", "2", "--speculate", "none"])
    assert options_and_reason(args, progress=False)[0].max_model_len == DEFAULT_MAX_MODEL_LEN


def test_bench_sweep_lowers_its_default_max_model_len_to_the_model_s_context(tmp_path):
    """bench sweep's default 1024 refused a 512-context model ("lower --max-model-len", a flag not
    given), as launch and serve did; a length the user gives is still refused past the model's."""
    from launcher.bench import sweep
    from launcher.bench.sweep import BenchConfig, add_bench_args
    from tests.tiny_model import write_tiny_model

    short = write_tiny_model(tmp_path / "short", max_position_embeddings=512)
    p = argparse.ArgumentParser()
    add_bench_args(p)
    base = ["--out", str(tmp_path / "o"), "--model", str(short), "--stages", "1", "--speculate", "none"]
    args = p.parse_args(base)
    options = sweep._session_options(args, [BenchConfig(1, "none", "-", 1)], ["hi"])
    assert args.max_model_len == 512 and {o["max_model_len"] for o in options.values()} == {512}
    with pytest.raises(ValueError, match=r"max_model_len 600 is more than the model's context 512 \(max_position_embeddings, config.json\)"):
        sweep._session_options(p.parse_args([*base, "--max-model-len", "600"]), [BenchConfig(1, "none", "-", 1)],
                               ["hi"])
