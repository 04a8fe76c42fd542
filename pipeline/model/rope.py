"""Rotary position embeddings (RoPE): scaling settings, frequencies, cos/sin tables and the rotation.

Owns the RoPE of every family: the typed `rope_scaling` (`RopeScaling`: linear, Llama 3, YaRN,
LongRoPE) read from config.json as transformers reads it, with the one-line refusal of every other
type; the base frequencies with that scaling; the cos/sin attention factor; Gemma 3's separate base
for sliding-window layers; and the half-split rotation of q and k, on all of a head's dims or
(partial rotary, phi3) on its first `rotary_dim` ones.
Must not: hold model weights or know about stages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # config.py imports RopeScaling from here
    from pipeline.model.config import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Families whose transformers modelling code rotates only the first int(head_dim * partial_rotary_factor)
# dims of a head (phi3's apply_rotary_pos_emb); the others' code ignores the factor or fails on it.
PARTIAL_ROTARY_FAMILIES = ("phi3",)
_REFUSED = {
    "dynamic": "transformers' dynamic NTK rescales every row of a forward pass by the longest position in that "
               "pass and keeps the largest seen so far, so its frequencies depend on batching and history, "
               "not on positions alone",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as in Hugging Face `rope_scaling` / `rope_parameters`.

    rope_type: one of ROPE_TYPES: "default"; "linear" (positions divided by `factor`); "llama3"
        (Llama 3.1 wavelength-dependent scaling: `low_freq_factor`, `high_freq_factor`); "yarn"
        (YaRN, arXiv 2309.00071 §3.2-3.4: `beta_fast`, `beta_slow`, `truncate`); "longrope" (LongRoPE,
        arXiv 2402.13753: per-dimension `short_factor` / `long_factor`, rotary_dim // 2 entries each).
    original_max_position_embeddings: the pre-training context (llama3, yarn, longrope); LongRoPE's
        long factors apply at positions at or past it.
    attention_factor: cos and sin are multiplied by it (YaRN's mscale, LongRoPE's scale; 1 otherwise),
        already resolved from factor / mscale / mscale_all_dim as transformers does.
    Raises ValueError for an unknown or refused type, a factor <= 0, or an out-of-range parameter.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type in _REFUSED:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported: {_REFUSED[self.rope_type]}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        for name in ("low_freq_factor", "high_freq_factor") if self.rope_type == "llama3" else ():
            if getattr(self, name) <= 0:  # llama3 divides the original context length by each
                raise ValueError(f"rope_scaling {name} must be > 0, got {getattr(self, name)}")
        if self.original_max_position_embeddings <= 0 or self.attention_factor <= 0:
            raise ValueError(f"rope_scaling original_max_position_embeddings ({self.original_max_position_embeddings}) "
                             f"and attention_factor ({self.attention_factor}) must be > 0")
        if self.rope_type == "yarn" and not self.beta_fast > 0 < self.beta_slow:  # YaRN takes log(1 / beta)
            raise ValueError(f"rope_scaling beta_fast ({self.beta_fast}) and beta_slow ({self.beta_slow}) must be > 0")
        if self.rope_type == "longrope":
            factors = self.short_factor + self.long_factor
            if not self.short_factor or len(self.short_factor) != len(self.long_factor) or min(factors) <= 0:
                raise ValueError("rope_scaling short_factor and long_factor must be lists of numbers > 0 of one "
                                 f"length, got {len(self.short_factor)} and {len(self.long_factor)} entries")

    def check_rotary_dim(self, rotary_dim: int) -> None:
        """Raise ValueError when LongRoPE's factor lists do not hold one entry per frequency (rotary_dim // 2)."""
        if self.rope_type == "longrope" and len(self.short_factor) != rotary_dim // 2:
            raise ValueError(f"rope_scaling short_factor/long_factor have {len(self.short_factor)} entries, "
                             f"expected rotary_dim // 2 = {rotary_dim // 2}")

    @property
    def frequencies_only(self) -> bool:
        """True when this scaling changes only the inverse frequencies: no attention factor, and LongRoPE
        with one factor set (a GGUF's `rope_freqs`), so cos/sin need no position switch or scale."""
        return self.attention_factor == 1.0 and self.short_factor == self.long_factor

    def to_hf_dict(self) -> dict[str, Any]:
        """The `rope_scaling` keys of this type, as transformers reads them back."""
        d: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type in ("llama3", "yarn", "longrope"):
            d["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            d.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.rope_type == "yarn":
            d.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate,
                     attention_factor=self.attention_factor)
        if self.rope_type == "longrope":
            d.update(short_factor=list(self.short_factor), long_factor=list(self.long_factor),
                     attention_factor=self.attention_factor)
        return d


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature sqrt(1/t) = 0.1 * mscale * ln(scale) + 1 (arXiv 2309.00071 §3.4, Eq. 22;
    transformers' `yarn_get_mscale`); 1 for scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _attention_factor(kind: str, d: dict[str, Any], factor: float, original: int) -> float:
    """cos/sin scale when config.json gives no `attention_factor`, as transformers' `_compute_yarn_parameters`
    and `_compute_longrope_parameters` derive it."""
    if d.get("attention_factor") is not None:
        return float(d["attention_factor"])
    if kind == "yarn":
        mscale, mscale_all_dim = d.get("mscale"), d.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        return yarn_get_mscale(factor)
    if kind == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def scaling_from_dict(d: dict[str, Any] | None, config: dict[str, Any], model_type: str) -> RopeScaling | None:
    """RopeScaling from a `rope_scaling` / `rope_parameters` dict `d` (None or "default" -> None) of the
    config.json dict `config`, resolving absent keys as transformers' config classes and
    `standardize_rope_params` do: a top-level `original_max_position_embeddings` wins over the dict's
    (phi3's defaults to 4096), then the dict's, then max_position_embeddings; a missing yarn/longrope
    `factor` is max_position_embeddings / original; phi3 reads "su" and "yarn" as "longrope".
    Raises ValueError for an unsupported type (one line, naming it and the supported ones)."""
    if not d:
        return None
    kind = d.get("rope_type", d.get("type", "default"))
    if model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi3Config.convert_rope_params_to_dict
    if kind == "default":
        return None
    max_len = int(config.get("max_position_embeddings", 2048))
    top = config.get("original_max_position_embeddings", 4096 if model_type == "phi3" else None)
    original = int(top if top is not None and kind != "linear" else
                   d.get("original_max_position_embeddings", 8192 if kind in ("llama3", "linear") else max_len))
    factor = d.get("factor")
    factor = float(max_len / original if factor is None and kind in ("yarn", "longrope") else
                   1.0 if factor is None else factor)
    return RopeScaling(
        rope_type=kind, factor=factor, original_max_position_embeddings=original,
        low_freq_factor=float(d.get("low_freq_factor", 1.0)), high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
        truncate=bool(d.get("truncate", True)), attention_factor=_attention_factor(kind, d, factor, original),
        short_factor=tuple(float(x) for x in d.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in d.get("long_factor") or ()),
    )


def partial_rotary_factor(d: dict[str, Any], rope: dict[str, Any], model_type: str) -> float:
    """The fraction of each head's dims that RoPE rotates: `rope`'s (the rope_parameters dict) value, else
    config.json's top-level one, else 1. Raises ValueError for a value other than 1 for a family outside
    PARTIAL_ROTARY_FAMILIES (ModelConfig checks the range and the rotary_dim it gives)."""
    factor = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if factor != 1.0 and model_type not in PARTIAL_ROTARY_FAMILIES:
        raise ValueError(f"partial_rotary_factor {factor} is not supported for {model_type} (transformers "
                         f"rotates part of a head only for {', '.join(PARTIAL_ROTARY_FAMILIES)})")
    return factor


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None, *, long: bool = False) -> torch.Tensor:
    """Inverse RoPE frequencies [rotary_dim // 2] (float32), unscaled or with the scaling of `scaling`.

    long: LongRoPE's long factors instead of its short ones (other types ignore it).
    Source: RoFormer (arXiv 2104.09864) §3.4; Llama 3.1 scaling as in Meta's reference code; YaRN and
    LongRoPE as in `_compute_yarn_parameters` / `_compute_longrope_parameters` of transformers'
    modeling_rope_utils.py, op for op (so the float32 values are the same bits).
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    kind = "default" if scaling is None else scaling.rope_type
    if kind == "longrope":  # LongRoPE (arXiv 2402.13753 §3): one rescale factor per frequency
        ext = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
        return 1.0 / (ext * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, scaling)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies [dim // 2] (arXiv 2309.00071 §3.2, Eq. 17-18): frequencies that
    turn more than `beta_fast` times over the original context are kept (extrapolated), those that turn
    fewer than `beta_slow` times are divided by `factor` (interpolated), with a linear ramp over the
    dims between. Op for op transformers' `_compute_yarn_parameters`."""
    def correction_dim(num_rotations: float) -> float:  # the dim whose wavelength fits num_rotations times
        return (dim * math.log(scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, *,
                 attention_factor: float = 1.0, long_inv_freq: torch.Tensor | None = None,
                 long_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_tokens, rotary_dim] for integer `positions` [num_tokens] (computed in float32).

    attention_factor: multiplies cos and sin (YaRN's mscale, arXiv 2309.00071 §3.4; LongRoPE's scale),
        as transformers' rotary embeddings do before casting to `dtype`.
    long_inv_freq: LongRoPE's long-factor frequencies, used for the rows at positions >= `long_from`
        ([Note: LongRoPE switch]); None: `inv_freq` for every row.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    if long_inv_freq is not None:
        long = positions.float()[:, None] * long_inv_freq[None, :]
        freqs = torch.where((positions >= long_from)[:, None], long, freqs)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


# [Note: LongRoPE switch]
# transformers (`longrope_frequency_update` in modeling_rope_utils.py) picks the long factors for a
# whole forward pass when max(position_ids) + 1 > original_max_position_embeddings, else the short
# ones, and never re-rotates cached keys. In its greedy `generate` (a prompt pass, then one row per
# pass) that is: a decode row at position p >= original uses the long factors, one below uses the
# short ones, and so does a prompt that fits in the original context. Here the rule is that one, per
# row: long iff position >= original_max_position_embeddings, so the result never depends on how
# many rows share a pass (--stages, speculation, batching, chunked prefill). It differs from
# transformers only for a prompt longer than the original context, whose rows below it transformers
# rotates with the long factors (its prefill pass reaches past the original context) and this
# runtime with the short ones, as transformers itself does for the same rows fed one at a time.


def rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables `rotate` takes, built once per forward from cos/sin [num_tokens, head_dim]: cos as
    [num_tokens, 1, head_dim], and sin with its first half negated, [num_tokens, 1, head_dim]."""
    half = sin.shape[-1] // 2
    return cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]


# [Note: cached rotation tables]
# A pass's `rotation_tables` cost ~0.12 ms a stage on the critical path of every token (a dozen small
# ops, with cold caches after the layers' weights went through), and every stage of a split pays them.
# Every entry of the tables is a function of its position alone (elementwise ops: the product of
# position and frequency, cos, sin, the attention factor, the LongRoPE switch, the cast, the sign),
# so `RotationTables` computes them once for positions [0, N) and a pass gathers its rows. They are
# computed ROTATION_TABLE_CHUNK positions per call, a size one thread runs whole, as every pass of
# fewer than ~500 rows does; tests/unit/test_rope.py checks the gathered rows bitwise against the
# per-pass computation, over every position, for each RoPE kind. When a position past them is asked
# for, the tables double, by at most ROTATION_TABLE_HEADROOM positions more than asked (cos and sin
# take 16 MB at 32k positions, head_dim 64, float32), and never past `max_positions`: the most positions
# the stage can be asked for, the positions its KV cache holds (StageModel passes max_model_len plus the
# token-tree scratch positions; every real row sits below max_model_len). A pass reaching past the bound
# (a FIRP pseudo row of an anchor near max_model_len) gets the per-pass computation, so the tables' bytes
# are bounded and the memory plan and the start-up memory check charge them (pipeline/weights/stage_memory.py
# `rotation_table_bytes`: at the bound, cos and signed sin per table key the stage's layers use, in the
# stage's activation dtype: bfloat16 for a quantised stage). CPU positions only: on an accelerator, finding how far
# the tables must reach reads the largest position back to the host (a device sync per pass, twice
# with FIRP), which costs more there than the dozen ops it saves; such a pass computes its tables as
# before.
ROTATION_TABLE_CHUNK = 256
ROTATION_TABLE_HEADROOM = 8192


class RotationTables:
    """The `rotation_tables` of positions [0, N), grown on demand ([Note: cached rotation tables])."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._cos = self._signed_sin = None  # [N, 1, rotary_dim] each

    def lookup(self, positions: torch.Tensor, key: tuple, cos_sin, *,
               max_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [num_tokens, 1, rotary_dim] of int64 `positions` [num_tokens] (>= 0), as
        `rotation_tables(*cos_sin(positions))` gives them. cos_sin: positions -> (cos, sin) [n, rotary_dim];
        key: what it depends on (frequency tensors, dtype), compared by identity: new ones rebuild.
        max_positions: the tables never grow past positions [0, max_positions) (None: no bound); a pass
        with a position at or past it gets the per-pass computation, as do positions on another device
        than the CPU (no host sync)."""
        if positions.device.type != "cpu":
            return rotation_tables(*cos_sin(positions))
        if len(key) != len(self._key) or any(a is not b for a, b in zip(key, self._key, strict=True)):
            self._key, self._cos, self._signed_sin = key, None, None
        have = 0 if self._cos is None else self._cos.shape[0]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > have or self._cos is None:  # (no tables yet: zero positions gather from the first chunk)
            bound = math.inf if max_positions is None else max_positions
            if need > bound or bound < 1:
                return rotation_tables(*cos_sin(positions))
            size = max(need, min(2 * have, need + ROTATION_TABLE_HEADROOM), ROTATION_TABLE_CHUNK)
            self._grow(int(min(size, bound)), cos_sin, positions.device)
        return self._cos[positions], self._signed_sin[positions]

    def _grow(self, size: int, cos_sin, device: torch.device) -> None:
        """Extend the tables to positions [0, size), ROTATION_TABLE_CHUNK positions per computation."""
        have = 0 if self._cos is None else self._cos.shape[0]
        with torch.no_grad():
            parts = [rotation_tables(*cos_sin(torch.arange(lo, min(lo + ROTATION_TABLE_CHUNK, size), device=device)))
                     for lo in range(have, size, ROTATION_TABLE_CHUNK)]
            old = [] if self._cos is None else [(self._cos, self._signed_sin)]
            self._cos, self._signed_sin = (torch.cat([p[i] for p in old + parts]) for i in (0, 1))


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [num_tokens, num_heads, head_dim] by the `rotation_tables` of its rows (half-split layout).

    The same numbers as x * cos + cat(-x2, x1) * sin (RoFormer, arXiv 2104.09864 §3.4.2), bit for bit:
    negating sin instead of x is exact, and one `roll` replaces two slices, a negation and a cat
    (three fewer ops per layer on the decode path). Tables narrower than head_dim (partial rotary,
    rotary_dim = cos.shape[-1]) rotate the first rotary_dim dims and pass the rest through, as
    transformers' phi3 `apply_rotary_pos_emb` does."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + torch.roll(x, rotary_dim // 2, -1) * signed_sin
    rot = x[..., :rotary_dim]
    return torch.cat((rot * cos + torch.roll(rot, rotary_dim // 2, -1) * signed_sin, x[..., rotary_dim:]), dim=-1)


def config_inv_freq(config: ModelConfig, *, local: bool, long: bool = False) -> torch.Tensor | None:
    """Global RoPE frequencies [rotary_dim // 2], or those of sliding layers with their own unscaled base
    (Gemma 3). long: LongRoPE's long-factor set (None for every other scaling, for `local`, and when
    both sets are one, as a Llama 3.x GGUF's `rope_freqs` gives: no second table to switch to)."""
    if long:
        scaling = config.rope_scaling
        if local or scaling is None or scaling.rope_type != "longrope" or scaling.long_factor == scaling.short_factor:
            return None
        return rope_inv_freq(config.rotary_dim, config.rope_theta, scaling, long=True)
    if local and config.rope_local_theta is not None:
        return rope_inv_freq(config.rotary_dim, config.rope_local_theta, None)
    return rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)


def config_cos_sin(config: ModelConfig, positions: torch.Tensor, inv_freq: torch.Tensor,
                   long_inv_freq: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_tokens, rotary_dim] of the global (scaled) RoPE of `config` at `positions` [num_tokens]:
    `rope_cos_sin` with the config's attention factor and LongRoPE switch ([Note: LongRoPE switch])."""
    scaling = config.rope_scaling
    if scaling is None:
        return rope_cos_sin(positions, inv_freq, dtype)
    return rope_cos_sin(positions, inv_freq, dtype, attention_factor=scaling.attention_factor,
                        long_inv_freq=long_inv_freq, long_from=scaling.original_max_position_embeddings)
