"""The speculation and sampling flag groups that `launch` and `serve` share.

Owns the flags' names, defaults and help text; launcher/cli/options.py turns them into PipelineOptions,
launcher/cli/main.py into SamplingParams. Must not: validate values (RunConfig and SamplingParams do, once).
"""

from __future__ import annotations

import argparse

from launcher.cli.options import GRAMMAR_DRAFTING
from launcher.cli.parsing import add_row_cost_flag, logit_bias_json, token_id_list, unescape
from launcher.coordinator.pipeline_options import DECODE_FEED, DEFAULT_DECODE_FEED, DRAFT_AT
from pipeline.engine.records import DEEP_ACCEPTANCE
from pipeline.run_config import SPECULATE_MODES


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation (SPEED)")
    g.add_argument("--speculate", default="auto", choices=("auto", *SPECULATE_MODES), metavar="MODE",
                   help="auto | none | speed | firp | speed+firp. speed: drafts from the exit layer run ahead in "
                   "stage 0; firp: predicted future hidden states verified as a chain; auto: speed with 2+ "
                   "CPU stages each on its own cores and a trained exit head, else none (default auto)")
    g.add_argument("--firp-k", type=int, help="FIRP drafts per pass (default: the shortest chain within "
                   "0.02 accepted drafts per pass of the best in the FIRP file's eval)")
    g.add_argument("--firp-file", help="trained FIRP maps (default: the file shipped for the model)")
    g.add_argument("--firp-min-prob", type=float, default=0.0, help="carry a FIRP draft only while its "
                   "probability is at least this (a chain stops at the first less likely draft; default 0)")
    add_row_cost_flag(g)
    g.add_argument("--draft-tree", type=int, default=1, metavar="W", help="token trees: a SPEED draft carries up to "
                   "W candidates for its position (greedy or sampled; README 'Token trees'); 1 = off")
    g.add_argument("--grammar-drafting", choices=tuple(GRAMMAR_DRAFTING), default=next(iter(GRAMMAR_DRAFTING)),
                   help="structured outputs' drafts: jump = they follow the grammar, a forced token is drafted as "
                   "is and a forced run goes as one multi-row item (jump-forward); drafts = they follow the "
                   "grammar, forced tokens one per item; off = the predictor's drafts as they are (the verifier "
                   "masks every row either way: output is the same); jump acts as drafts in dense bfloat16/float16, where "
                   "multi-row passes round rows apart (README 'Structured outputs'; default jump)")
    g.add_argument("--predictor", default="hybrid", help="logit-lens | early-exit | ngram | hybrid | FILE.safetensors "
                   "(a trained early-exit head); early-exit and hybrid use the trained head shipped for the model "
                   "and exit layer (default hybrid)")
    g.add_argument("--exit-predictor", metavar="FILE", help="trained early-exit head (from `speedpipe "
                   "train-predictor`) for --predictor early-exit or hybrid, instead of the shipped one; `none` = the untrained logit lens (default: the head shipped for the model and exit layer)")
    g.add_argument("--exit-layer", type=int, help="layer whose hidden state feeds the predictor "
                   "(default: the last layer of stage 0)")
    g.add_argument("--max-inflight", type=int, default=0,
                   help="items of one sequence in flight at once (default 0: chosen from the row-cost table and the "
                   "measured acceptance with --row-cost, else the number of stages)")
    g.add_argument("--draft-at", choices=DRAFT_AT, default=DRAFT_AT[0],
                   help="who turns the exit guess into a draft: the coordinator, or the exit stage itself when "
                   "it is stage 0 (no round trip; README 'Stage-local drafting') (default coordinator)")
    g.add_argument("--decode-feed", choices=DECODE_FEED, default=None,  # None: not given (flag_notes), then the default
                   help="who sends plain greedy decode's next item: the coordinator, or the last stage itself "
                   "(run next at --stages 1, sent straight to stage 0 beyond: no ring return through the "
                   f"coordinator; README 'Self-fed decode') (default {DEFAULT_DECODE_FEED})")
    g.add_argument("--deep-draft-min-acceptance", type=float, default=DEEP_ACCEPTANCE, metavar="P",
                   help="with --draft-at stage: the exit stage drafts one past the run-ahead depth only after "
                   f"its own draft from a gate bucket right at least this often (default {DEEP_ACCEPTANCE}; "
                   "1 = never)")
    g.add_argument("--speculative-disable-by-batch-size", type=int, metavar="N",
                   help="vLLM's flag: no new drafts (SPEED, FIRP, token trees) while N or more sequences run; "
                   "in-flight drafts are still verified (default: stages + 1 when --speculate auto chose speed, "
                   "where every stage already has real work; never for a mode you chose)")
    g.add_argument("--min-acceptance", default="auto",
                   help="adaptive drafting: send a draft only if drafts like it were accepted at least this "
                   "often; 'auto' = the measured break-even: 0.1 / (S - 0.9) for S stages each on its own cores "
                   "(0.09 at 2), 0.5 when 3 or 4 stages share 2 CPUs; 0 = always draft (default auto)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p x the top token's probability, in [0, 1] (0 = off)")
    g.add_argument("--seed", type=int, help="sampling seed (per prompt: seed + prompt index)")
    g.add_argument("--stop", action="append", default=[], type=unescape,
                   help=r"stop string (repeatable); \n, \t, \r and \\ are read as newline, tab, CR, backslash")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    g.add_argument("--no-skip-special-tokens", dest="skip_special_tokens", action="store_false",
                   help="show special tokens' text in the output (vLLM's skip_special_tokens false); stop strings "
                   "match the text as shown; the EOS that ends a prompt is shown only with --include-stop-str-in-output")
    g.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the matched stop string (or the ending EOS or stop token id's text) at the end of the output")
    g.add_argument("--logit-bias", type=logit_bias_json, metavar="JSON",
                   help='OpenAI\'s logit_bias: token id -> bias in [-100, 100] added to its logit, e.g. '
                   '\'{"50256": -100}\' (-100 bans a token, +100 forces it) (default: none)')
    g.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="vLLM's min_tokens: no EOS, stop token id or stop string ends the output before N tokens")
    g.add_argument("--stop-token-ids", type=token_id_list, default=(), metavar="IDS",
                   help="vLLM's stop_token_ids: comma-separated ids that end the output (e.g. 2,13), with "
                   "--ignore-eos too; the id's text is not printed")
    g.add_argument("--allowed-token-ids", type=token_id_list, metavar="IDS",
                   help="vLLM's allowed_token_ids: only these comma-separated ids are generated (default: all)")
    g.add_argument("--bad-words", action="append", default=[], metavar="WORD",
                   help="vLLM's bad_words: a word never generated, alone or after a space (repeatable)")
    g.add_argument("--response-format", choices=("text", "json_object"), default="text",
                   help="json_object: the output is one JSON object (OpenAI's response_format) (default text)")
    g.add_argument("--json-schema", metavar="PATH",
                   help="the output is JSON valid against the JSON schema in this file (README 'Structured outputs')")
    g.add_argument("--regex", metavar="PATTERN", help="the whole output matches this regular expression (Rust syntax)")
    g.add_argument("--choice", action="append", default=[], metavar="TEXT",
                   help="the output is exactly one of these strings (repeatable)")
    g.add_argument("--grammar", metavar="PATH",
                   help="the output matches the context-free grammar in this file: Lark (a `start:` rule) or GBNF "
                   "(`root ::= ...`) (README 'Structured outputs')")


def sampling_flags_given(args: argparse.Namespace) -> list[str]:
    """The sampling flags (`add_sampling_args`) set to other than their defaults, as typed
    (['--temperature', '--logit-bias']): `launch --serve` refuses them, since a server takes these
    settings per request (`serve` has no such flags)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_sampling_args(parser)
    return [action.option_strings[0] for action in parser._actions  # noqa: SLF001 - no public list
            if getattr(args, action.dest, action.default) != action.default]
