"""The second real model, Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF in 22 chunk packages), end to end.

What breaks when these fail: assembling the chunks, importing a qwen2 GGUF (config, qkv biases,
untied head, tensor names), the qwen2 pre-tokenizer, special tokens or chat template rebuilt from
the GGUF, greedy output on 1, 2 and 4 stages, or per-stage memory (a stage holding more than its
share of the weights), speculation on this model (SPEED with the n-gram and logit-lens predictors,
FIRP with untrained identity maps: greedy tokens equal those without speculation), or the check that
refuses a predictor trained for another model (the shipped SmolLM2 heads). The oracle is transformers reading the same GGUF file itself
(`from_pretrained(..., gguf_file=...)`, dequantised to float32): its own tensor mapping and
tokenizer conversion, independent of ours.

Skips with the install command when the chunk packages are not installed (CI does not install
them: 1.1 GB). Memory: transformers' float32 copy (~7 GB) is freed before any pipeline starts.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import shutil
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from launcher.coordinator.pipeline_options import PipelineOptions
from launcher.coordinator.run_plan import resolve
from launcher.coordinator.session import PipelineSession
from launcher.serving.openai_protocol import render_chat
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.sampling import SamplingParams
from pipeline.weights.model_chunks import assemble
from pipeline.weights.registry import CACHE_ENV, CHUNKED_REGISTRY, default_cache_dir, resolve_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

MODEL = "qwen2.5-coder-1.5b"
NUM_NEW_TOKENS = 24
PROMPTS = (
    "def fibonacci(n):\n    ",
    "# Python: read a CSV file and print the sum of its second column\nimport csv\n",
    "The three primary colors of light are",
    "Once upon a time, in a small village by the sea, there lived",
)
RESULT_TIMEOUT_S = 900.0
WORKER_MODULE = "workers.stage_worker"
RSS_FACTOR = 1.3


def _tokenizer_strings() -> list[str]:
    """A few hundred varied strings: code, prose, unicode, whitespace runs, numbers, special tokens."""
    base = ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }", "SELECT * FROM t;",
            "Hello, world!", "naïve café résumé", "日本語のテキスト", "Привет, мир", "emoji 😀👍🏽 end", "مرحبا",
            "   leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\r\n", "\n\n\n", "    \n  \t ",
            "3.14159 2,718 1e-10 0x1F 1234567890", "I'm you're it's we'll they'd", "CamelCaseWords snake_case",
            "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "a" * 50, "https://example.com/a?b=c&d=e",
            "    if x:\n        y = [i for i in range(10)]\n", "€100 £20 ¥3000", "Ünïcödé ßtraße", "ﬁ ﬂ ﬀ", "e\u0301"]
    out = list(base)
    for i, s in enumerate(base):
        out += [s.upper(), " " + s, s + " " * (i % 5), s * 2, f"{i}: {s}", s.replace(" ", "  ")]
    out += [" " * n + "x" for n in range(1, 20)] + [str(10 ** n + n) for n in range(30)]
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Iterator[Path]:
    """$SPEEDPIPE_CACHE_DIR when set (reuse a conversion), else a session-private folder, removed
    after the module: the assembled GGUF and its float32 conversion take 7.7 GB, and pytest keeps
    the temporary folders of its last 3 runs."""
    if os.environ.get(CACHE_ENV):
        yield default_cache_dir()
        return
    private = tmp_path_factory.mktemp("speedpipe-cache")
    yield private
    shutil.rmtree(private, ignore_errors=True)


@pytest.fixture(scope="module")
def gguf_path(cache_dir: Path) -> Path:
    chunked = CHUNKED_REGISTRY[MODEL]
    if importlib.util.find_spec(f"{chunked.package_prefix}1") is None:
        pytest.skip(f"the {MODEL} chunk packages are not installed: {chunked.install_command()}")
    return assemble(chunked, cache_dir, progress=False)


@pytest.fixture(scope="module")
def model_dir(gguf_path: Path, cache_dir: Path) -> Path:
    return resolve_model(MODEL, cache_dir=cache_dir, progress=False)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_greedy(gguf_path: Path, model_dir: Path) -> list[list[int]]:
    """transformers' greedy tokens of PROMPTS from the GGUF itself (float32); the model is freed after."""
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              dtype=torch.float32).eval()
    tok = Tokenizer(model_dir)
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NUM_NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, ids.shape[1]:].tolist())
    del model
    gc.collect()
    return out


def _peak_rss_bytes(pid: int) -> int:
    """VmHWM (peak resident set size) of a live process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def _run(model_dir: Path, num_stages: int, **overrides) -> dict:
    options = PipelineOptions(num_stages=num_stages, model=str(model_dir), progress=False, max_model_len=128,
                              max_num_seqs=len(PROMPTS), stage_timeout_s=600.0, **overrides)
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with PipelineSession(options, resolve(options)) as session:
        handles = [session.coordinator.submit(p, params) for p in PROMPTS]
        tokens = [h.result(RESULT_TIMEOUT_S).token_ids for h in handles]
        stats = session.coordinator.stage_stats()
        peaks = {}
        for p in psutil.Process().children(recursive=True):
            cmdline = " ".join(p.cmdline())
            if WORKER_MODULE in cmdline:
                peaks[int(re.search(r"--stage-index[ =](\d+)", cmdline).group(1))] = _peak_rss_bytes(p.pid)
        return {"tokens": tokens, "weights_bytes": [st.weights_bytes for st in stats],
                "peak_rss_bytes": [peaks[i] for i in range(num_stages)],
                "tensor_names": [list(load.tensor_names) for load in session.load_responses]}


@pytest.fixture(scope="module")
def runs(model_dir: Path, hf_greedy) -> dict[int, dict]:
    """Pipeline runs on 1, 2 and 4 stages (after the transformers reference was computed and freed)."""
    return {s: _run(model_dir, s) for s in (1, 2, 4)}


def test_gguf_tokenizer_ids_equal_transformers(model_dir: Path, hf_tokenizer):
    """Ids equal transformers' GGUF tokenizer. Qwen2's own tokenizer (transformers' Qwen2Tokenizer,
    the model's tokenizer.json) NFC-normalises first; transformers' GGUF builder leaves that out, so
    for the few strings that are not already NFC the oracle gets the NFC form."""
    ours = Tokenizer(model_dir)
    strings = _tokenizer_strings()
    assert len(strings) >= 200 and any(unicodedata.normalize("NFC", s) != s for s in strings)
    mismatches = [s for s in strings
                  if ours.encode(s) != hf_tokenizer.encode(unicodedata.normalize("NFC", s), add_special_tokens=False)]
    assert not mismatches, f"{len(mismatches)} of {len(strings)} differ, e.g. {mismatches[:3]!r}"
    assert ours.eos_token_ids[0] == ours.token_id("<|im_end|>") == 151645


def test_chat_template_renders_as_transformers(model_dir: Path, hf_tokenizer):
    messages = [{"role": "system", "content": "You are a coding assistant."},
                {"role": "user", "content": "Write a function that reverses a string."},
                {"role": "assistant", "content": "def rev(s):\n    return s[::-1]"},
                {"role": "user", "content": "Now in C."}]
    for msgs in (messages, messages[1:2]):  # with a system prompt, and with the template's default one
        want = hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert render_chat(msgs, tokenizer=Tokenizer(model_dir)) == want


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_greedy_on_stages_equals_transformers_from_the_same_gguf(runs, hf_greedy, num_stages):
    assert runs[num_stages]["tokens"] == hf_greedy


def test_each_stage_peak_rss_is_within_its_weight_share(runs):
    """No stage holds the whole model: peak RSS <= 1.3 x its weights + one process's fixed overhead."""
    run = runs[4]
    import subprocess
    import sys

    overhead = int(subprocess.run(  # a stage worker process before it loads any weights
        [sys.executable, "-c", f"import {WORKER_MODULE}, pathlib; print([int(l.split()[1]) * 1024 for l in "
         "pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM')][0])"],
        capture_output=True, text=True, check=True).stdout)
    total = sum(runs[1]["weights_bytes"])
    print(f"fixed overhead {overhead / 2**20:.0f} MiB; whole model {total / 2**30:.2f} GiB")
    for i, (weights, peak) in enumerate(zip(run["weights_bytes"], run["peak_rss_bytes"], strict=True)):
        print(f"stage {i}: weights {weights / 2**30:.2f} GiB, peak RSS {peak / 2**30:.2f} GiB, "
              f"limit {(RSS_FACTOR * weights + overhead) / 2**30:.2f} GiB")
        assert peak <= RSS_FACTOR * weights + overhead, (i, peak, weights, overhead)
        assert weights < 0.5 * total
    names = [set(n) for n in run["tensor_names"]]
    assert all(not (a & b) for i, a in enumerate(names) for b in names[i + 1:]), "a tensor read by two stages"


def test_speculate_speed_on_4_stages_equals_transformers(model_dir: Path, hf_greedy):
    """One sequence at a time (so idle stages are filled with drafts), SPEED with the logit lens."""
    options = PipelineOptions(num_stages=4, model=str(model_dir), progress=False, max_model_len=128, max_num_seqs=1,
                              stage_timeout_s=600.0, speculate="speed")
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with PipelineSession(options, resolve(options)) as session:
        tokens = [session.coordinator.submit(p, params).result(RESULT_TIMEOUT_S).token_ids for p in PROMPTS[:2]]
        spec = session.coordinator.spec
    assert tokens == hf_greedy[:2]
    assert spec.drafted_tokens > 0, "no draft was sent: speculation was not exercised"


# -- speculation on this model (issue 15 item 4) -----------------------------------------------------

SPEC_STAGES = 2


@pytest.fixture(scope="module")
def plain_2_stages(model_dir: Path) -> list[list[int]]:
    """Greedy tokens of PROMPTS on 2 stages without speculation, one sequence at a time."""
    return _spec_run(model_dir, speculate="none")[0]


def _spec_run(model_dir: Path, **overrides) -> tuple[list[list[int]], object]:
    """Greedy tokens of PROMPTS on SPEC_STAGES stages, one sequence at a time (so idle stages take
    drafts), and the scheduler's speculation counters."""
    options = PipelineOptions(num_stages=SPEC_STAGES, model=str(model_dir), progress=False, max_model_len=128,
                              max_num_seqs=1, stage_timeout_s=600.0, **{"row_cost": "none", **overrides})
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with PipelineSession(options, resolve(options)) as session:
        tokens = [session.coordinator.submit(p, params).result(RESULT_TIMEOUT_S).token_ids for p in PROMPTS]
        return tokens, session.coordinator.spec


def _identity_firp_file(model_dir: Path, path: Path, *, exit_layer: int, k: int) -> Path:
    """A FIRP file of k untrained maps (identity, zero bias: FirpMaps' initial state) for this model."""
    from pipeline.speculation.firp import FirpMaps
    from pipeline.speculation.predictor_file import model_identity, save_predictor

    identity = model_identity(model_dir)
    meta = {"kind": "firp", "model": identity.to_dict(), "exit_layer": exit_layer, "k": k, "arch": "affine",
            "corpus": "none (untrained identity maps)"}
    return save_predictor(path, FirpMaps(identity.hidden_size, k).to_tensors(), meta)


@pytest.mark.parametrize("predictor", ["ngram", "logit-lens"])
def test_speculate_speed_on_2_stages_equals_no_speculation(model_dir: Path, plain_2_stages, predictor):
    tokens, spec = _spec_run(model_dir, speculate="speed", predictor=predictor, min_acceptance=0.0)
    assert tokens == plain_2_stages
    assert spec.drafted_tokens > 0, "no draft was sent: speculation was not exercised"


def test_speculate_firp_on_2_stages_equals_no_speculation(model_dir: Path, plain_2_stages, tmp_path):
    """FIRP maps of this model's size (1536 x 1536 each: 4.7 MB per map in float16, more than gRPC's
    default 4 MiB message, so this also checks the control plane's raised limit)."""
    path = _identity_firp_file(model_dir, tmp_path / "firp.safetensors", exit_layer=14, k=2)
    assert path.stat().st_size > 4 << 20
    tokens, spec = _spec_run(model_dir, speculate="firp", firp_file=str(path), firp_k=2)
    assert tokens == plain_2_stages
    assert spec.drafted_tokens > 0, "no FIRP draft was sent"


def test_predictors_trained_for_the_default_model_are_refused(model_dir: Path):
    """The shipped SmolLM2-135M heads and FIRP maps (hidden 576, vocab 49152) do not fit this model."""
    from launcher.coordinator.run_plan import SHIPPED_DIR

    shipped = sorted(SHIPPED_DIR.glob("smollm2-135m-*.safetensors"))
    assert any("-firp-" in p.name for p in shipped) and any("-early-exit-" in p.name for p in shipped)
    for path in shipped:
        overrides = ({"speculate": "firp", "firp_file": str(path)} if "-firp-" in path.name
                     else {"speculate": "speed", "predictor": "early-exit", "exit_predictor": str(path)})
        options = PipelineOptions(num_stages=SPEC_STAGES, model=str(model_dir), progress=False, **overrides)
        with pytest.raises(ValueError, match=r"(model|hash|hidden|vocab)") as err:
            resolve(options)
        assert "\n" not in str(err.value) and path.name in str(err.value), str(err.value)


def test_a_predictor_of_another_hidden_size_is_refused_even_with_this_models_hash(model_dir: Path, tmp_path):
    """A shipped 135M head relabelled with this model's hash still fails: its hidden size (576) and
    tensor shapes are not this model's (1536)."""
    from launcher.coordinator.run_plan import SHIPPED_DIR
    from pipeline.speculation.predictor_file import load_predictor, model_identity, save_predictor

    shipped = load_predictor(sorted(SHIPPED_DIR.glob("smollm2-135m-*-early-exit-*.safetensors"))[0])
    identity = model_identity(model_dir)
    meta = {**shipped.meta, "model": {**shipped.meta["model"], "name": identity.name, "hash": identity.hash}}
    meta.pop("format")
    path = save_predictor(tmp_path / "relabelled.safetensors", shipped.tensors, meta)
    options = PipelineOptions(num_stages=SPEC_STAGES, model=str(model_dir), progress=False, speculate="speed",
                              predictor="early-exit", exit_predictor=str(path), exit_layer=shipped.exit_layer)
    with pytest.raises(ValueError, match=r"hidden size 576, but the running model's is 1536"):
        resolve(options)
