"""`--quantization auto` on K-quant GGUFs: Q4_K blocks as the int4 kernel's groups, Q6_K requantised.

What breaks when these fail: `decode_q4_k` (the 144-byte super-block: float16 d and dmin, 6-bit
scales and minimums packed in 12 bytes, the nibble order of its 8 sub-blocks), the Q/K un-permute on
its records (llama's Q/K rows, as in SmolLM2 / Llama Q4_K_M files), Q6_K projections (which Q4_K_M
files use for attn_v, ffn_down and the head) not requantised to int4 or not named by
`requantised_linears`, a split changing a token, or the result drifting from the float32 model of
the same dequantised weights.
gguf's numpy `quantize` has no Q4_K or Q6_K, so the blocks are built here from random bytes (quants,
packed scales) with small finite float16 super-block scales: valid blocks, which `gguf.quants.dequantize`
reads. The float32 reference is the folder `convert_gguf` wrote from them (gguf's dequantisation of
every tensor, checked here too) loaded dense.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pipeline.weights.checkpoint import CheckpointReader
from pipeline.weights.gguf_blocks import GgufBlockReader, requantised_linears
from pipeline.weights.gguf_import import convert_gguf, open_gguf
from pipeline.weights.quant import Int4Groups, Int4Linear, quantize_dense
from tests.tiny_model import random_state_dict
from tests.unit.test_families import PROMPT, Chain
from tests.unit.test_gguf_families import _config, add_family_metadata, family_gguf_name
from tests.unit.test_gguf_quantised_families import MAX_ROW_ERROR, MEAN_ROW_ERROR, NUM_NEW_TOKENS, _stages

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Q = gguf.GGMLQuantizationType
SUPER_BLOCK = 256  # weights per K-quant super-block
# file -> GGML type of each projection kind (HF module suffix); every other matrix Q4_K, norms F32.
# "Q4_K_M": llama.cpp's mix keeps attn_v and ffn_down in Q6_K (in some layers; here in all).
FILES = {"Q4_K": {}, "Q4_K_M": {"self_attn.v_proj": Q.Q6_K, "mlp.down_proj": Q.Q6_K}}
# Per-row ||auto - float32|| / ||float32|| bounds (max, mean) per file. Q4_K: those of the Q4_0/Q4_1 files
# (the file's own blocks; bfloat16 activations and KV are the error; measured max 0.13, mean 0.017).
# Q4_K_M: its Q6_K projections (64 levels) are requantised to int4 groups (16 levels) on top, which
# `--quantization int8` avoids: measured max 0.40, mean 0.17 over two seeds (int8: 0.08, 0.03). A
# wrong nibble order, a lost un-permute or unpacked scales leave logits unrelated: error ~1.
BOUNDS = {"Q4_K": (MAX_ROW_ERROR, MEAN_ROW_ERROR), "Q4_K_M": (0.6, 0.3)}


def q4_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols // 256 * 144] uint8 Q4_K super-blocks: f16 d in [1.5e-4, 4.5e-4], f16 dmin in
    [1e-3, 3e-3], then random bytes for the 12 bytes of 6-bit scales/mins and the 128 bytes of nibbles
    (w = d * sc * q - dmin * m: |w| < 0.45, mean near 0)."""
    n = rows * cols // SUPER_BLOCK
    d = rng.uniform(1.5e-4, 4.5e-4, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    dmin = rng.uniform(1e-3, 3e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return np.concatenate([d, dmin, rng.integers(0, 256, (n, 140), dtype=np.uint8)], axis=1).reshape(rows, -1)


def q6_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols // 256 * 210] uint8 Q6_K super-blocks: random ql[128], qh[64] and int8 scales[16],
    then f16 d in [5e-5, 1.5e-4] (w = d * scale * (q - 32): |w| < 0.62)."""
    n = rows * cols // SUPER_BLOCK
    d = rng.uniform(5e-5, 1.5e-4, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return np.concatenate([rng.integers(0, 256, (n, 208), dtype=np.uint8), d], axis=1).reshape(rows, -1)


def write_k_quant_gguf(path: Path, types: dict[str, Q], *, seed: int = 5) -> None:
    """A tiny llama GGUF (hidden and intermediate 256: whole super-blocks, tied embedding) whose matrices
    are random Q4_K blocks, or `types[module]` (Q6_K) for the modules it names; norms F32."""
    config = _config("llama3")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    add_family_metadata(w, "llama", config)
    for name, t in random_state_dict(config, seed=seed).items():
        if t.ndim == 1:
            w.add_tensor(family_gguf_name("llama", name), t.numpy())
            continue
        kind = next((k for module, k in types.items() if f".{module}." in name), Q.Q4_K)
        blocks = (q4_k_blocks if kind == Q.Q4_K else q6_k_blocks)(*t.shape, rng)
        w.add_tensor(family_gguf_name("llama", name), blocks, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def k_ggufs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """file kind -> (the GGUF, its converted folder)."""
    root = tmp_path_factory.mktemp("k_quants")
    out = {}
    for kind, types in FILES.items():
        write_k_quant_gguf(root / f"{kind}.gguf", types)
        out[kind] = root / f"{kind}.gguf", convert_gguf(root / f"{kind}.gguf", root / kind, progress=False)
    return out


def test_hand_built_blocks_are_what_the_file_holds(k_ggufs):
    """The blocks are K-quants as gguf reads them, and the float32 folder holds gguf's dequantisation."""
    path, folder = k_ggufs["Q4_K_M"]
    types = {t.name: t for t in open_gguf(path).tensors}
    assert types["blk.0.attn_q.weight"].tensor_type == Q.Q4_K and types["blk.0.attn_v.weight"].tensor_type == Q.Q6_K
    dense = CheckpointReader(folder).read(["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight"],
                                          dtype=torch.float32)
    for gguf_name, hf in (("blk.1.ffn_gate.weight", "gate_proj"), ("blk.1.ffn_down.weight", "down_proj")):
        t = types[gguf_name]
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(want).all() and 0.03 < want.std() < 0.3, (gguf_name, want.std())
        np.testing.assert_array_equal(dense[f"model.layers.1.mlp.{hf}.weight"].numpy(), want)


@pytest.mark.parametrize("kind", list(FILES))
def test_auto_reads_q4_k_blocks_as_the_file_s_own_int4_groups(k_ggufs, kind):
    """Each Q4_K tensor (Q/K rows un-permuted, the tied head too) is an Int4Groups record whose values are
    exactly the float32 folder's; Q6_K ones come back dense, for requantisation."""
    path, folder = k_ggufs[kind]
    reader = CheckpointReader(folder)
    blocks = GgufBlockReader(path, reader.config)
    names = [n for n in sorted(reader.tensor_names) if n.endswith("_proj.weight") and ".layers.0." in n]
    names.append("model.embed_tokens.weight")
    for name in names:
        record, dense = blocks.read_one(name), reader.read([name], dtype=torch.float32)[name]
        if any(f".{module}." in name for module in FILES[kind]):
            assert isinstance(record, torch.Tensor) and torch.equal(record, dense), name
            continue
        assert isinstance(record, Int4Groups) and record.group_size == 32, name
        torch.testing.assert_close(record.dequantize(), dense, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", list(FILES))
def test_auto_runs_k_quants_as_int4_close_to_float32_and_identically_on_1_and_2_stages(k_ggufs, kind):
    path, folder = k_ggufs[kind]
    full = _stages(folder, 1, "auto")[0]
    linears = {n: m for n, m in full.named_modules() if isinstance(m, (torch.nn.Linear, Int4Linear))}
    assert "lm_head" in linears and len(linears) == 4 * full.config.num_hidden_layers + 1
    assert all(type(m) is Int4Linear for m in linears.values()), {n: type(m).__name__ for n, m in linears.items()}
    # o_proj (Q4_K) holds the file's own q and scales; a Q6_K down_proj, int4 groups of its dense weight.
    blocks = GgufBlockReader(path, full.config)
    down = "model.layers.0.mlp.down_proj.weight"
    for module, want in (("self_attn.o_proj", blocks.read_one("model.layers.0.self_attn.o_proj.weight")),
                         ("mlp.down_proj", blocks.read_one(down) if not FILES[kind] else
                          quantize_dense(CheckpointReader(folder).read([down], dtype=torch.float32)[down], "int4"))):
        got, own = linears[f"layers.0.{module}"], Int4Linear(want)
        assert torch.equal(got.packed, own.packed) and torch.equal(got.scales_zeros, own.scales_zeros), module
    num_q6 = len(FILES[kind]) * full.config.num_hidden_layers
    assert requantised_linears(path, full.config) == ({"Q6_K": num_q6} if num_q6 else {})

    dense = _stages(folder, 1, "none")[0]
    got = Chain([full])(PROMPT, 0, all_rows=True).float()
    want = Chain([dense])(PROMPT, 0, all_rows=True)
    assert want.std() > 0.1, "degenerate model: near-constant logits"
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)  # [len(PROMPT)]
    assert err.max() < BOUNDS[kind][0] and err.mean() < BOUNDS[kind][1], err.tolist()

    one = Chain([full]).greedy(PROMPT, NUM_NEW_TOKENS)
    assert Chain(_stages(folder, 2, "auto")).greedy(PROMPT, NUM_NEW_TOKENS) == one
    assert len(set(one)) > 1, "degenerate model: one token repeated"
