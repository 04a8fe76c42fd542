"""How the command line words an error: parameter names become the flags a user typed.

Owns the table from configuration parameter names (RunConfig, PipelineOptions, SamplingParams, and
the predictor-training ones) to `speedpipe` flags, and the rewrite of a one-line error message with it ([Note: parameter names in
errors] in pipeline/run_config.py). Must not: decide whether input is valid.
"""

from __future__ import annotations

import re

# Parameter -> flag, where the two differ by more than "_" -> "-" or the flag is not "--" + name.
_RENAMED = {"num_stages": "--stages"}
# Parameters whose flag is "--" + name with "-" for "_".
_SAME_NAME = (
    "layer_split", "dtype", "device", "max_model_len", "max_num_seqs", "threads_per_stage", "stage_timeout_s",
    "cache_dir", "speculate", "predictor", "exit_predictor", "exit_layer", "max_inflight", "min_acceptance",
    "firp_k", "firp_file", "firp_min_prob", "log_level", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "logit_bias", "min_tokens", "stop_token_ids", "allowed_token_ids", "bad_words",
    "quantization", "row_cost_file", "row_cost", "dense_layout", "draft_at", "draft_tree", "deep_draft_min_acceptance",
    "decode_feed", "speculative_disable_by_batch_size",
)
PARAMETER_FLAGS: dict[str, str] = {**{name: "--" + name.replace("_", "-") for name in _SAME_NAME}, **_RENAMED}
# `train-predictor` parameters (ExitTrainConfig, the corpus, the draft vocabulary): flag = "--" + name.
TRAINING_FLAGS: dict[str, str] = {**{name: "--" + name.replace("_", "-") for name in (
    "arch", "steps", "lr", "rank", "corpus", "draft_vocab", "dropout", "soft_weight", "mlp_size")},
    "num_blocks": "--blocks"}
_ALL_FLAGS = {**TRAINING_FLAGS, **PARAMETER_FLAGS}
# Plain words that open a message followed by any value of theirs ("corpus PATH: no such file").
_ANY_VALUE = ("corpus", "quantization")

# Names with an underscore are identifiers wherever they appear (not inside a path). A plain word
# ("device", "predictor") is the parameter only as the subject that opens the message, followed by
# "must" or by a value of it ("dtype must be ...", "speculate firp needs ...", "device cuda was ..."):
# "predictor file X does not exist" names a file, not the flag.
# A name in single quotes ("tensor 'draft_vocab'", "no integer 'exit_layer'") is a tensor or metadata
# field of a file, not a parameter: it is matched whole and left as it is.
_UNDERSCORED = "|".join(sorted((n for n in _ALL_FLAGS if "_" in n), key=len, reverse=True))
_IDENTIFIERS = re.compile(r"'(?:" + _UNDERSCORED + r")'|(?<![\w/.-])(" + _UNDERSCORED + r")(?![\w/-])")
_SUBJECT = re.compile(r"^(" + "|".join(n for n in _ALL_FLAGS if "_" not in n)
                      + r")(?= (must|cuda|none|speed|firp|speed\+firp) )|^(" + "|".join(_ANY_VALUE) + ")(?= )")


def flag_message(message: str) -> str:
    """`message` with every parameter name it cites replaced by its flag, e.g.
    "num_stages must be >= 1, got 0" -> "--stages must be >= 1, got 0". Text that already names
    flags, or no parameter, is returned unchanged, and so is a name in single quotes (a file's
    tensor or metadata field: "tensor 'draft_vocab' must hold ...")."""
    message = _IDENTIFIERS.sub(lambda m: _ALL_FLAGS[m.group(1)] if m.group(1) else m.group(0), message)
    return _SUBJECT.sub(lambda m: _ALL_FLAGS[m.group(1) or m.group(3)], message)
