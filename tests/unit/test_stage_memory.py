"""`--stages auto`: the fewest stages whose weights + KV + RoPE tables each fit a per-stage memory budget.

What breaks when these fail: the split search (not the fewest stages, a stage over budget, a
non-contiguous or lopsided split), the bytes a layer / the embedding / the head count for, or the
CLI flags that turn a budget into --stages and --layer-split, or a stage's rotation tables left out of its bytes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from launcher.cli.main import build_parser
from launcher.cli.options import _auto_stages
from launcher.cli.parsing import UsageError
from pipeline.model.partition import LayerRange, smallest_fitting_split
from pipeline.speculation.tree import scratch_positions
from pipeline.weights.checkpoint import CheckpointReader, stage_tensor_names
from pipeline.weights.stage_memory import StagePlan, kv_bytes_per_layer, plan_stages_for_budget
from tests.family_models import write_family_model
from tests.stage_bytes import measured_stage_bytes, write_next_layer_file, write_quantised_gguf_folder


def _brute_force(layer_bytes, first, last, budget, stage=0):
    """(fewest stages, least max stage) over every contiguous split, by enumeration."""
    n = len(layer_bytes)
    for k in range(1, n + 1):
        best = None
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            costs = [sum(layer_bytes[a:b]) + (first if a == 0 else 0) + (last if b == n else 0) + stage
                     for a, b in zip(bounds, bounds[1:], strict=False)]
            if max(costs) <= budget and (best is None or max(costs) < best):
                best = max(costs)
        if best is not None:
            return k, best
    return None


@pytest.mark.parametrize("seed", range(30))
def test_split_has_the_fewest_stages_and_the_least_largest_stage(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 8, (1,), generator=gen))
    layers = torch.randint(1, 20, (n,), generator=gen).tolist()
    first, last = (int(v) for v in torch.randint(0, 30, (2,), generator=gen))
    budget = int(torch.randint(15, 80, (1,), generator=gen))
    stage = int(torch.randint(0, 10, (1,), generator=gen)) if seed % 2 else 0  # every stage's own (RoPE tables)
    want = _brute_force(layers, first, last, budget, stage)
    if want is None:
        with pytest.raises(ValueError, match="no split fits a per-stage budget"):
            smallest_fitting_split(layers, first_bytes=first, last_bytes=last, budget_bytes=budget, stage_bytes=stage)
        return
    ranges = smallest_fitting_split(layers, first_bytes=first, last_bytes=last, budget_bytes=budget, stage_bytes=stage)
    assert ranges[0].start == 0 and ranges[-1].stop == n
    assert all(a.stop == b.start and len(a) > 0 for a, b in zip(ranges, ranges[1:], strict=False))
    costs = [sum(layers[r.start:r.stop]) + (first if i == 0 else 0) + (last if i == len(ranges) - 1 else 0) + stage
             for i, r in enumerate(ranges)]
    assert (len(ranges), max(costs)) == want


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])  # gemma3: local + global RoPE, two table sets
def test_plan_counts_weights_kv_and_rotation_tables_of_each_stage(tmp_path, family):
    folder = write_family_model(tmp_path / "m", family)  # tied head: the last stage holds its own copy
    kw = {"dtype": torch.float32, "max_num_seqs": 2, "max_model_len": 64}
    one = plan_stages_for_budget(folder, budget_bytes=1 << 40, **kw)
    assert len(one.ranges) == 1
    plan = plan_stages_for_budget(folder, budget_bytes=int(one.stage_bytes[0] * 0.6), **kw)
    assert len(plan.ranges) == 2 and all(b <= plan.budget_bytes for b in plan.stage_bytes)
    measured = measured_stage_bytes(folder, plan.ranges, max_num_seqs=2, max_model_len=64)
    assert all(tables > 0 for _, _, tables in measured)
    assert plan.stage_bytes == [sum(m) for m in measured]
    assert plan.rotation_table_bytes == [tables for _, _, tables in measured]
    assert plan.kv_bytes == [kv for _, kv, _ in measured]
    assert "of a" in plan.lines()[0] and plan.layer_split() == ",".join(str(len(r)) for r in plan.ranges)
    assert f"{plan.rotation_table_bytes[0] / 2**20:.1f} MiB RoPE tables" in plan.lines()[0]


@pytest.mark.parametrize("dense_layout", ["reference", "fast"])
def test_a_one_stage_plan_charges_a_tied_embedding_and_head_as_often_as_the_stage_holds_them(tmp_path, dense_layout):
    """One stage of a tied model holds the embedding and the LM head as one tensor (reference layout):
    charged once (it was charged twice, so a budget the stage fits took two stages); the fast layout
    gives the head its own transposed copy ([Note: dense layout]): charged twice."""
    folder = write_family_model(tmp_path / "m", "qwen3")  # tied
    kw = {"dtype": torch.float32, "max_num_seqs": 2, "max_model_len": 64, "dense_layout": dense_layout}
    one = plan_stages_for_budget(folder, budget_bytes=1 << 40, **kw)
    (alone,) = measured_stage_bytes(folder, one.ranges, max_num_seqs=2, max_model_len=64, dense_layout=dense_layout)
    assert len(one.ranges) == 1 and one.stage_bytes == [sum(alone)]
    assert len(plan_stages_for_budget(folder, budget_bytes=sum(alone), **kw).ranges) == 1
    args = build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto", "--stage-memory-gib",
                                      str((sum(alone) - 1) / 2**30), "--max-model-len", "64", "--max-num-seqs", "2",
                                      "--dense-layout", dense_layout, "--speculate", "none", "--prompt", "x"])
    assert _auto_stages(args, progress=False)[0] == 2  # the CLI plans in the run's layout: a byte short, 2 stages


def _quantised_folder(root, family: str, mode: str):
    """A tiny `family` model for `mode`: a Hugging Face folder for int8 / int4 (requantised), the folder
    converted from a Q4_0 (tied qwen2, MoE qwen3_moe) or Q8_0 (untied mistral, MoE mixtral) GGUF for
    auto (the file's own blocks)."""
    if mode == "auto":
        return write_quantised_gguf_folder(root, family, "Q4_0" if family in ("qwen2", "qwen3_moe") else "Q8_0")
    return write_family_model(root / "m", family)


@pytest.mark.parametrize("mode", ["int8", "int4", "auto"])
@pytest.mark.parametrize("family", ["qwen2", "mistral", "mixtral", "qwen3_moe"])  # tied; untied; MoE (untied)
def test_a_quantised_plan_charges_each_stage_the_packed_weights_it_holds(tmp_path, family, mode):
    """A quantised stage holds its linears packed (int4 / int8 buffers; an MoE layer's router and every
    expert's pair too), its embedding, norms and biases in bfloat16, a tied model's head packed beside a
    dense embedding (tests/stage_bytes.py measures them): the plan charges exactly that, on one stage
    and on two. It charged every weight at --dtype (float32 here: 3-4x what the stages hold)."""
    folder = _quantised_folder(tmp_path, family, mode)
    kw = {"dtype": torch.float32, "max_num_seqs": 2, "max_model_len": 64, "quantization": mode}
    one = plan_stages_for_budget(folder, budget_bytes=1 << 40, **kw)
    (alone,) = measured_stage_bytes(folder, one.ranges, max_num_seqs=2, max_model_len=64, quantization=mode)
    assert len(one.ranges) == 1 and one.stage_bytes == [sum(alone)] and one.weight_bytes == [alone[0]]
    plan = plan_stages_for_budget(folder, budget_bytes=int(sum(alone) * 0.6), **kw)
    measured = measured_stage_bytes(folder, plan.ranges, max_num_seqs=2, max_model_len=64, quantization=mode)
    assert len(plan.ranges) == 2 and all(b <= plan.budget_bytes for b in plan.stage_bytes)
    assert plan.stage_bytes == [sum(m) for m in measured]
    assert plan.weight_bytes == [weights for weights, _, _ in measured]


def test_cli_stages_auto_fits_a_budget_that_holds_the_packed_weights_on_fewer_stages(tmp_path):
    """`launch --stages auto --quantization auto` on a Q4_0 GGUF: a budget one stage fits as built
    (packed weights) gives one stage, a byte less two. Charged at float32, no split fitted that budget
    (README's example: 3 stages of the default model at 0.4 GiB, where 2 fit)."""
    folder = write_quantised_gguf_folder(tmp_path, "qwen2", "Q4_0")
    (alone,) = measured_stage_bytes(folder, [LayerRange(0, 4)], max_num_seqs=2, max_model_len=64,
                                    quantization="auto")

    def stages(budget: int) -> tuple[int, str | None]:
        args = build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto", "--stage-memory-gib",
                                          str(budget / 2**30), "--max-model-len", "64", "--max-num-seqs", "2",
                                          "--quantization", "auto", "--speculate", "none", "--prompt", "x"])
        return _auto_stages(args, progress=False)

    assert stages(sum(alone)) == (1, "4")
    assert stages(sum(alone) - 1)[0] == 2


def test_a_gemma3_stage_without_a_sliding_layer_is_charged_one_set_of_rotation_tables(tmp_path):
    # layer 0 is the only sliding layer: a stage after it builds the global tables alone
    folder = write_family_model(tmp_path / "m", "gemma3_text",
                                layer_types=["sliding_attention"] + ["full_attention"] * 3)
    kw = {"dtype": torch.float32, "max_num_seqs": 2, "max_model_len": 64}
    one = plan_stages_for_budget(folder, budget_bytes=1 << 40, **kw)
    plan = plan_stages_for_budget(folder, budget_bytes=int(one.stage_bytes[0] * 0.6), **kw)
    measured = measured_stage_bytes(folder, plan.ranges, max_num_seqs=2, max_model_len=64)
    assert len(plan.ranges) == 2 and 2 * measured[1][2] == measured[0][2]  # the truth: one set, then two
    assert plan.rotation_table_bytes == [tables for _, _, tables in measured]
    assert plan.stage_bytes == [sum(m) for m in measured]


@pytest.mark.parametrize("max_inflight", [0, 2])
def test_plan_charges_the_token_tree_scratch_positions_of_each_stage(tmp_path, max_inflight):
    """The KV cache and the tables' bound hold max_model_len + scratch positions a slot; the scratch
    grows with the stage count when max_inflight is 0, so the count is chosen with its own scratch."""
    folder = write_family_model(tmp_path / "m", "qwen3", tie_word_embeddings=False)  # (one stage: no shared head)
    kw = {"dtype": torch.float32, "max_num_seqs": 2, "max_model_len": 64,
          "scratch_of": lambda k: scratch_positions(3, max_inflight or k)}
    one = plan_stages_for_budget(folder, budget_bytes=1 << 40, **kw)
    scratch_one = scratch_positions(3, max_inflight or 1)
    assert one.num_scratch == scratch_one and len(one.ranges) == 1
    (alone,) = measured_stage_bytes(folder, one.ranges, max_num_seqs=2, max_model_len=64, num_scratch=scratch_one)
    assert one.stage_bytes == [sum(alone)] and one.kv_bytes == [alone[1]]
    assert len(plan_stages_for_budget(folder, budget_bytes=sum(alone) - 1, **kw).ranges) == 2
    plan = plan_stages_for_budget(folder, budget_bytes=int(sum(alone) * 0.6), **kw)
    scratch = scratch_positions(3, max_inflight or len(plan.ranges))
    measured = measured_stage_bytes(folder, plan.ranges, max_num_seqs=2, max_model_len=64, num_scratch=scratch)
    assert len(plan.ranges) >= 2 and plan.num_scratch == scratch
    assert plan.stage_bytes == [sum(m) for m in measured]
    assert plan.kv_bytes == [kv for _, kv, _ in measured]
    assert f"with {scratch} token-tree scratch positions a slot" in plan.lines()[0]


def test_cli_plan_names_a_bad_draft_tree_before_charging_its_scratch(tmp_path):
    """--draft-tree 99's scratch positions fit no budget: the error must name the flag, not the budget."""
    folder = write_family_model(tmp_path / "m", "llama3")
    whole = plan_stages_for_budget(folder, budget_bytes=1 << 40, dtype=torch.float32, max_num_seqs=8,
                                   max_model_len=64).stage_bytes[0]
    args = build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto", "--stage-memory-gib",
                                      str(0.6 * whole / 2**30), "--max-model-len", "64", "--max-num-seqs", "8",
                                      "--speculate", "speed", "--draft-tree", "99", "--prompt", "x"])
    with pytest.raises(ValueError, match=r"--draft-tree must be between 1 .off. and \d+ candidates, got 99"):
        _auto_stages(args, progress=False)


def test_the_stage_count_is_the_fewest_that_fit_with_their_own_scratch_positions(tmp_path):
    """With max_inflight 0 more stages mean more scratch positions (and KV) on every stage: the plan's
    count fits at its own scratch, and one stage fewer does not fit at its own."""
    folder = write_family_model(tmp_path / "m", "llama3", tie_word_embeddings=False)
    kw = {"dtype": torch.float32, "max_num_seqs": 64, "max_model_len": 40, "scratch_of": lambda k: scratch_positions(8, k)}
    whole = plan_stages_for_budget(folder, budget_bytes=1 << 40, **kw).stage_bytes[0]
    counts = set()
    for share in range(20, 100, 2):
        budget = whole * share // 100
        try:
            plan = plan_stages_for_budget(folder, budget_bytes=budget, **kw)
        except ValueError:
            continue
        k = len(plan.ranges)
        counts.add(k)
        assert plan.num_scratch == scratch_positions(8, k) and max(plan.stage_bytes) <= budget, share
        if k > 1:  # k - 1 stages at their own scratch (as max_inflight k - 1 fixes it)
            fixed = {**kw, "scratch_of": lambda _, fewer=k - 1: scratch_positions(8, fewer)}
            assert len(plan_stages_for_budget(folder, budget_bytes=budget, **fixed).ranges) > k - 1
    assert len(counts) >= 2  # (3 stages hold a whole key block a slot more than 2, as many as 4: never the fewest here)


def test_cli_plan_charges_a_quantised_stage_its_bfloat16_kv_cache_and_tables(tmp_path, monkeypatch):
    """A quantised stage computes in bfloat16 (pipeline/weights/quant.py ACTIVATION_DTYPE): its KV cache
    and rotation tables take half the bytes of the float32 `--dtype`."""
    import pipeline.weights.stage_memory as stage_memory

    folder = write_family_model(tmp_path / "m", "llama3")
    plans, real = [], stage_memory.plan_stages_for_budget
    monkeypatch.setattr(stage_memory, "plan_stages_for_budget", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    args = build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto", "--stage-memory-gib", "1",
                                      "--max-model-len", "64", "--max-num-seqs", "2", "--quantization", "int8",
                                      "--speculate", "speed", "--draft-tree", "3", "--prompt", "x"])
    assert _auto_stages(args, progress=False)[0] == 1
    measured = measured_stage_bytes(folder, plans[0].ranges, max_num_seqs=2, max_model_len=64,
                                    num_scratch=scratch_positions(3, 1), quantization="int8",
                                    exit_head=(0, b""))  # hybrid without a shipped head: the logit lens's bfloat16 rows
    assert plans[0].kv_bytes == [kv for _, kv, _ in measured]
    assert plans[0].rotation_table_bytes == [tables for _, _, tables in measured]
    assert plans[0].stage_bytes == [sum(m) for m in measured]  # the int8 weights too


def test_a_budget_the_stage_fits_only_without_its_rotation_tables_takes_one_more_stage(tmp_path):
    folder = write_family_model(tmp_path / "m", "gemma3_text", tie_word_embeddings=False)
    kw = {"dtype": torch.float32, "max_num_seqs": 2, "max_model_len": 64}
    whole = LayerRange(0, CheckpointReader(folder).config.num_hidden_layers)
    (weights, kv, tables), = measured_stage_bytes(folder, [whole], max_num_seqs=2, max_model_len=64)
    assert len(plan_stages_for_budget(folder, budget_bytes=weights + kv + tables, **kw).ranges) == 1
    assert len(plan_stages_for_budget(folder, budget_bytes=weights + kv + tables // 2, **kw).ranges) == 2
    on_gpu = plan_stages_for_budget(folder, budget_bytes=weights + kv + tables // 2, device="cuda", **kw)
    assert len(on_gpu.ranges) == 1 and on_gpu.rotation_table_bytes == [0]  # an accelerator caches no tables


def test_plan_lines_give_each_stages_weights_kv_cache_and_rope_tables():
    gib, mib = 2**30, 2**20
    plan = StagePlan(ranges=[LayerRange(0, 3), LayerRange(3, 5)], stage_bytes=[3 * gib, 2 * gib], budget_bytes=4 * gib,
                     kv_bytes=[gib // 2, gib], rotation_table_bytes=[mib, 2 * mib])
    assert plan.weight_bytes == [3 * gib - gib // 2 - mib, gib - 2 * mib]
    assert plan.lines() == [
        "stage 0: layers [0, 3), 3.00 GiB (2.50 GiB weights + 512.0 MiB KV cache + 1.0 MiB RoPE tables) "
        "of a 4.00 GiB budget",
        "stage 1: layers [3, 5), 2.00 GiB (1.00 GiB weights + 1024.0 MiB KV cache + 2.0 MiB RoPE tables) "
        "of a 4.00 GiB budget"]


def test_cli_stages_auto_prints_each_stages_weights_kv_cache_and_rope_tables(tmp_path, capsys):
    """The plan lines `--stages auto` prints: each stage's weights (GiB) beside its KV cache and RoPE tables."""
    folder = write_family_model(tmp_path / "m", "llama3", vocab_size=32768)  # 8 MiB embedding, 8 MiB head
    kw = {"dtype": torch.float32, "max_num_seqs": 64, "max_model_len": 1024}
    whole = plan_stages_for_budget(folder, budget_bytes=1 << 40, **kw).stage_bytes[0]
    args = build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto", "--stage-memory-gib",
                                      str(0.6 * whole / 2**30), "--max-model-len", "1024", "--max-num-seqs", "64",
                                      "--speculate", "none", "--prompt", "x"])
    stages, split = _auto_stages(args, progress=True)
    plan = plan_stages_for_budget(folder, budget_bytes=int(0.6 * whole), **kw)
    assert stages == len(plan.ranges) >= 2 and split == plan.layer_split()
    err, reader = capsys.readouterr().err, CheckpointReader(folder)
    for i, r in enumerate(plan.ranges):
        weights = reader.nbytes(stage_tensor_names(reader.config, r, is_first=i == 0, is_last=i == stages - 1),
                                dtype=torch.float32)
        assert weights >= 2**30 // 200  # shows as 0.01 GiB, not 0.00
        assert (f"stage {i}: layers {r}, {plan.stage_bytes[i] / 2**30:.2f} GiB ({weights / 2**30:.2f} GiB weights + "
                f"{plan.kv_bytes[i] / 2**20:.1f} MiB KV cache + {plan.rotation_table_bytes[i] / 2**20:.1f} MiB RoPE "
                f"tables) of a ") in err


def test_cli_stages_auto_sets_stages_and_split(tmp_path):
    folder = write_family_model(tmp_path / "m", "llama3")
    whole = plan_stages_for_budget(folder, budget_bytes=1 << 40, dtype=torch.float32, max_num_seqs=8,
                                   max_model_len=64).stage_bytes[0]
    args = build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto", "--stage-memory-gib",
                                      str(0.6 * whole / 2**30), "--max-model-len", "64", "--prompt", "x"])
    stages, split = _auto_stages(args, progress=False)
    assert stages >= 2 and split.count(",") == stages - 1
    with pytest.raises(UsageError, match="--stage-memory-gib"):
        _auto_stages(build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto",
                                                "--prompt", "x"]), progress=False)


def test_plan_charges_a_next_layer_drafter_to_the_stage_of_its_exit_layer(tmp_path):
    """A given next-layer drafter's file and its KV layer count on the stage holding the exit layer
    (stage 0 by default), so a budget the model alone fits can need one more stage."""
    folder = write_family_model(tmp_path / "m", "llama3")
    cfg = CheckpointReader(folder).config
    kw = {"dtype": torch.float32, "max_num_seqs": 8, "max_model_len": 64}
    path = write_next_layer_file(folder, tmp_path / "next.safetensors", 0)
    kv = kv_bytes_per_layer(cfg, **kw)
    args = build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto", "--stage-memory-gib", "1",
                                      "--max-model-len", "64", "--speculate", "speed", "--predictor", str(path),
                                      "--prompt", "x"])
    base = plan_stages_for_budget(folder, budget_bytes=1 << 40, **kw)
    from launcher.coordinator.predictor_select import given_exit_memory
    size, kv_layers = given_exit_memory(predictor=str(path), exit_predictor=None)
    assert (size, kv_layers) == (path.stat().st_size, 1)
    extra = size + kv
    exit_kw = {"exit_bytes": size, "exit_kv_layers": kv_layers}
    assert plan_stages_for_budget(folder, budget_bytes=1 << 40, **exit_kw, **kw).stage_bytes == [
        base.stage_bytes[0] + extra]
    reader = CheckpointReader(folder)
    for exit_layer in (None, cfg.num_hidden_layers - 1):
        plan = plan_stages_for_budget(folder, budget_bytes=int(base.stage_bytes[0] * 0.6), **exit_kw,
                                      exit_layer=exit_layer, **kw)
        holder = 0 if exit_layer is None else len(plan.ranges) - 1
        assert len(plan.ranges) >= 2
        for i, (r, b) in enumerate(zip(plan.ranges, plan.stage_bytes, strict=True)):
            names = stage_tensor_names(cfg, r, is_first=i == 0, is_last=i == len(plan.ranges) - 1)
            assert b == (reader.nbytes(names, dtype=torch.float32) + kv * len(r) + (extra if i == holder else 0)
                         + plan.rotation_table_bytes[i])
            assert plan.kv_bytes[i] == kv * (len(r) + (i == holder))
    args.stage_memory_gib = base.stage_bytes[0] / 2**30  # the model alone fits one stage...
    assert _auto_stages(args, progress=False)[0] == 2  # ...but not with the drafter
    assert given_exit_memory(predictor="hybrid", exit_predictor=None) == (0, 0)


def test_plan_charges_a_next_layer_drafters_kv_layer_its_token_tree_scratch_positions(tmp_path, monkeypatch):
    """A next-layer drafter's KV layer sits in its stage's KV cache, scratch positions included: with
    max_model_len 62 and 4 scratch positions a slot it holds 96 positions (3 key blocks), not 64."""
    import pipeline.weights.stage_memory as stage_memory

    folder = write_family_model(tmp_path / "m", "llama3")
    path = write_next_layer_file(folder, tmp_path / "next.safetensors", 1)
    plans, real = [], stage_memory.plan_stages_for_budget
    monkeypatch.setattr(stage_memory, "plan_stages_for_budget", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    args = build_parser().parse_args(["launch", "--model", str(folder), "--stages", "auto", "--stage-memory-gib", "1",
                                      "--max-model-len", "62", "--max-num-seqs", "2", "--speculate", "speed",
                                      "--predictor", str(path), "--draft-tree", "3", "--prompt", "x"])
    assert _auto_stages(args, progress=False)[0] == 1
    measured = measured_stage_bytes(folder, plans[0].ranges, max_num_seqs=2, max_model_len=62,
                                    num_scratch=scratch_positions(3, 1), draft_after=1)
    assert plans[0].kv_bytes == [kv for _, kv, _ in measured]
    weights = CheckpointReader(folder).nbytes(stage_tensor_names(CheckpointReader(folder).config, plans[0].ranges[0],
                                                                 is_first=True, is_last=True), dtype=torch.float32)
    (with_head,) = measured_stage_bytes(folder, plans[0].ranges, max_num_seqs=2, max_model_len=62,
                                        exit_head=(1, b""))  # the exit head's norm and whole-vocabulary rows
    (bare,) = measured_stage_bytes(folder, plans[0].ranges, max_num_seqs=2, max_model_len=62)
    head = with_head[0] - bare[0]
    assert plans[0].stage_bytes == [weights + head + path.stat().st_size + measured[0][1] + measured[0][2]]


@pytest.mark.parametrize("max_model_len", [40, 64, 100])
def test_kv_bytes_per_layer_is_what_a_stage_allocates(max_model_len):
    # the cache rounds its positions up to whole key blocks; the budget must count them
    from pipeline.model.config import tiny_config
    from pipeline.model.partition import LayerRange
    from pipeline.model.stage_model import StageModel

    cfg = tiny_config()
    model = StageModel(cfg, LayerRange(0, 2), is_first=False, is_last=False)
    kv = model.new_kv_cache(max_num_seqs=3, max_model_len=max_model_len)
    assert kv_bytes_per_layer(cfg, dtype=torch.float32, max_num_seqs=3, max_model_len=max_model_len) * 2 == kv.nbytes
