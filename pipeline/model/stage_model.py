"""The decoder of every supported family, cut into stages.

Owns the torch modules (grouped-query attention with RoPE, gated MLP, decoder layer) and
`StageModel`, the part of the model one pipeline stage runs: the layers of one `LayerRange`, plus
the token embedding on the first stage and the final norm + LM head on the last.
Must not: read files (pipeline/weights/checkpoint.py does), talk to other processes, or pick KV slots.

Tokens of several items (sequences) are packed along one axis ("varlen" layout, as in vLLM):
    x: [num_tokens] token ids (first stage) or [num_tokens, hidden_size] hidden states (others)
    spans: one `Span(slot, start, num_tokens)` per item, in the same order as the packed rows.

Inside a layer, modules call their children's `forward` directly, skipping `nn.Module.__call__`'s
hook machinery (~10 calls a layer a pass); hooks on a DecoderLayer still run: StageModel calls it.

FIRP pseudo rows: [Note: pseudo rows] in pipeline/model/row_layout.py. Families: [Note: model families]
in pipeline/model/config.py (larger blocks: pipeline/model/family_blocks.py, pipeline/model/moe.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from pipeline.model.attention import KEY_BLOCK, AttentionPlan, span_attention
from pipeline.model.config import ModelConfig
from pipeline.model.family_blocks import ACTIVATION_FNS, make_embedding, make_norm, soft_cap
from pipeline.model.kv_cache import KVCache
from pipeline.model.moe import SparseMoE
from pipeline.model.partition import LayerRange
from pipeline.model.rope import RotationTables, config_cos_sin, config_inv_freq, rope_cos_sin, rotate
from pipeline.model.row_layout import PassInterrupted, PseudoLayout, Span, anchor_rows, last_rows_of
from pipeline.model.tensor_names import checkpoint_name


@dataclasses.dataclass
class StageForward:
    """What one stage forward produced.

    out: hidden [num_tokens, hidden] (not last) or float32 logits [num_logit_rows, vocab] (last).
    pseudo: pseudo hidden [num_pseudo, hidden] (not last) or float32 logits [num_pseudo, vocab]
        (last); None when the micro-batch has no live pseudo rows.
    exit_hidden: [num_items, hidden] hidden after the exit layer at each item's last row, or None.
    """

    out: torch.Tensor
    pseudo: torch.Tensor | None = None
    exit_hidden: torch.Tensor | None = None


class Attention(nn.Module):
    """Grouped-query self-attention over the packed rows plus each item's cached keys/values.

    Layer `layer` of `config`: optional q/k RMSNorm over head_dim before RoPE, a sliding window
    on sliding layers, the family's query scale and attention soft-cap. phi3 checkpoints hold q/k/v fused (`qkv_proj`).
    """

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.qkv_proj: nn.Linear | None = None
        if config.model_type == "phi3":
            self.qkv_proj = nn.Linear(config.hidden_size, (h + 2 * kv) * d, bias=config.attention_bias)
        else:
            self.q_proj = nn.Linear(config.hidden_size, h * d, bias=config.attention_bias)
            self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=config.attention_bias)
            self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = make_norm(config, d) if config.qk_norm else None
        self.k_norm = make_norm(config, d) if config.qk_norm else None
        self.window = config.sliding_window if config.is_sliding(layer) else None
        self.scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar ** -0.5
        self.softcap = config.attn_logit_softcapping  # Gemma 2 ([Note: attention soft-capping] in attention.py)

    def fuse(self) -> None:
        """Replace q/k/v projections by one [q; k; v] matmul (same numbers, fewer kernel calls)."""
        if self.qkv_proj is not None:  # already fused (phi3 checkpoints, or a second call)
            return
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        fused = nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features, bias=q.bias is not None,
                          device=q.weight.device, dtype=q.weight.dtype)
        fused.weight = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]), requires_grad=False)
        if q.bias is not None:
            fused.bias = nn.Parameter(torch.cat([q.bias, k.bias, v.bias]), requires_grad=False)
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v: [..., heads * d], [..., kv_heads * d] x 2, as separate tensors (for q/k norms and the
        next-layer drafter's training; `forward` rotates the fused output's q and k as one view instead)."""
        if self.qkv_proj is None:
            return self.q_proj.forward(x), self.k_proj.forward(x), self.v_proj.forward(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.qkv_proj.forward(x).split([q_size, kv_size, kv_size], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                plan: AttentionPlan | Sequence[Span], kv: KVCache, layer: int) -> torch.Tensor:
        # x: [num_tokens (+ num_pseudo), hidden]; cos, signed_sin: the same rows' `rotation_tables`
        # (pipeline/model/rope.py; a plain sin would rotate the wrong way)
        # plan: built once per forward by StageModel.forward_rows; plain spans (no pseudo rows) also do
        if not isinstance(plan, AttentionPlan):
            plan = AttentionPlan.build(plan, None, x.device)
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None and self.q_norm is None:  # q and k are adjacent columns: rotate them as one view
            qkv = self.qkv_proj.forward(x)
            qk, v = qkv[:, :(h + kvh) * d].reshape(t, h + kvh, d), qkv[:, (h + kvh) * d:]
        else:
            q, k, v = self._qkv(x)
            q, k = q.reshape(t, h, d), k.reshape(t, kvh, d)
            if self.q_norm is not None:
                q, k = self.q_norm.forward(q), self.k_norm.forward(k)
            qk = torch.cat([q, k], dim=1)
        qk = rotate(qk, cos, signed_sin)  # one rotation for q and k
        out = span_attention(qk[:, :h], qk[:, h:], v.reshape(t, kvh, d), plan, kv, layer, window=self.window,
                             scale=self.scale, softcap=self.softcap)
        return self.o_proj.forward(out.reshape(t, h * d))


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)); act is SiLU (SwiGLU) or tanh-GELU (GeGLU).

    intermediate_size: default config.intermediate_size (MoE experts pass their own). phi3
    checkpoints hold gate and up fused (`gate_up_proj`).
    """

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.act_fn = ACTIVATION_FNS[config.hidden_act]
        self.gate_up_proj: nn.Linear | None = None
        if config.model_type == "phi3":
            self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=False)
        else:
            self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
            self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def fuse(self) -> None:
        """Replace gate and up projections by one [gate; up] matmul."""
        if self.gate_up_proj is not None:
            return
        g, u = self.gate_proj, self.up_proj
        fused = nn.Linear(g.in_features, 2 * g.out_features, bias=False, device=g.weight.device, dtype=g.weight.dtype)
        fused.weight = nn.Parameter(torch.cat([g.weight, u.weight]), requires_grad=False)
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj.forward(self.act_fn(self.gate_proj.forward(x)) * self.up_proj.forward(x))
        gate_up = self.gate_up_proj.forward(x)
        inter = gate_up.shape[-1] // 2
        return self.down_proj.forward(self.act_fn(gate_up[..., :inter]) * gate_up[..., inter:])


def _feed_forward(config: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s feed-forward: a gated MLP, or a sparse MoE block (pipeline/model/moe.py)."""
    if not config.is_moe_layer(layer):
        return MLP(config)
    return SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                     renormalise=config.norm_topk_prob,
                     make_expert=lambda: MLP(config, config.moe_intermediate_size))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.)).

    With `config.sandwich_norms` (Gemma 3): x + post_attn_norm(attn(norm(x))), then
    + post_ff_norm(mlp(pre_ff_norm(.))). Layer `layer` picks its attention kind and feed-forward.
    """

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(config, config.hidden_size)
            self.post_feedforward_layernorm = make_norm(config, config.hidden_size)
        self.mlp = _feed_forward(config, layer)

    def forward(self, x, cos, signed_sin, plan, kv, layer):
        attn = self.self_attn.forward(self.input_layernorm.forward(x), cos, signed_sin, plan, kv, layer)
        if self.sandwich:
            x = x + self.post_attention_layernorm.forward(attn)
            ff = self.mlp.forward(self.pre_feedforward_layernorm.forward(x))
            return x + self.post_feedforward_layernorm.forward(ff)
        x = x + attn
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class StageModel(nn.Module):
    """The modules of one pipeline stage: layers `layer_range`, embedding if first, norm + head if last.

    Parameter names equal the Hugging Face checkpoint names without the leading "model."
    (`layers.12.self_attn.q_proj.weight`, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`),
    with absolute layer indices, so a stage's state dict is loaded straight from the checkpoint.
    Build it on the meta device and `load_state_dict(..., assign=True)` to avoid a second copy.
    """

    def __init__(self, config: ModelConfig, layer_range: LayerRange, *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        if layer_range.stop > config.num_hidden_layers:
            raise ValueError(f"layer range {layer_range} exceeds the model's {config.num_hidden_layers} layers")
        self.config = config
        self.layer_range = layer_range
        self.is_first, self.is_last = is_first, is_last
        self.embed_tokens = make_embedding(config) if is_first else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in layer_range})
        self.norm = make_norm(config, config.hidden_size) if is_last else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if is_last else None
        self.register_buffer("inv_freq", config_inv_freq(config, local=False), persistent=False)
        self.register_buffer("inv_freq_local", config_inv_freq(config, local=True), persistent=False)
        self.register_buffer("inv_freq_long", config_inv_freq(config, local=False, long=True), persistent=False)
        self._rotations: dict[tuple[bool, torch.dtype], RotationTables] = {}  # [Note: cached rotation tables], rope.py
        self.draft_layer, self.draft_after = None, None  # [Note: next-layer drafter], pipeline/speculation/drafting/layer_drafter.py

    def attach_draft_layer(self, layer: DecoderLayer, *, after: int) -> None:
        """Run `layer` after this stage's layer `after` on every row, its KV one extra cache layer (make the
        cache after this); its last-row output becomes `exit_hidden`. Raises ValueError for a foreign layer."""
        if after not in self.layer_range:
            raise ValueError(f"draft layer after layer {after}, outside this stage's layers {self.layer_range}")
        self.draft_layer, self.draft_after = layer, after

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype, *,
                    max_positions: int | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{absolute layer: (cos, signed sin) [num_tokens, 1, head_dim]} for this stage's layers at `positions`,
        the `rotation_tables` of pipeline/model/rope.py (sliding layers of a family with its own local RoPE
        base get the local tables). max_positions: the cached tables' bound (`RotationTables.lookup`)."""
        cached, bound = self._rotations, {"max_positions": max_positions}
        tables = {False: cached.setdefault((False, dtype), RotationTables()).lookup(
            positions, (self.inv_freq, self.inv_freq_long, dtype),
            lambda p: config_cos_sin(self.config, p, self.inv_freq, self.inv_freq_long, dtype), **bound)}
        if self.config.uses_local_rope(self.layer_range):
            tables[True] = cached.setdefault((True, dtype), RotationTables()).lookup(
                positions, (self.inv_freq_local, dtype), lambda p: rope_cos_sin(p, self.inv_freq_local, dtype),
                **bound)
        return {i: tables.get(self.config.is_sliding(i), tables[False]) for i in self.layer_range}

    def new_kv_cache(self, *, max_num_seqs: int, max_model_len: int, num_scratch: int = 0) -> KVCache:
        """A KV cache sized for this stage's layers, in the model's dtype and device (num_scratch:
        token-tree scratch positions per slot, [Note: sibling rows] in pipeline/model/row_layout.py),
        with room for whole blocks of KEY_BLOCK keys (read as views, pipeline/model/attention.py)."""
        weight = next(iter(self.parameters()))
        return KVCache(num_layers=len(self.layer_range) + (self.draft_layer is not None), max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, num_kv_heads=self.config.num_key_value_heads,
                       head_dim=self.config.head_dim, dtype=weight.dtype, device=weight.device, num_scratch=num_scratch,
                       read_block=KEY_BLOCK)

    def forward(self, x: torch.Tensor, spans: Sequence[Span], kv: KVCache, *,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage on packed rows.

        x: [num_tokens] int64 token ids if first stage, else [num_tokens, hidden_size].
        spans: per item, in row order; sum of num_tokens == num_tokens.
        logit_rows: [num_rows] row indices whose logits the last stage returns (default: each
            item's last row).
        Returns hidden [num_tokens, hidden_size] (not last), or logits [num_rows, vocab_size]
        float32 (last). Writes K/V of every row into `kv` and sets each slot's length to the end of
        its span. Raises ValueError if a span does not fit its KV slot.
        """
        return self.forward_rows(x, spans, kv, logit_rows=logit_rows).out

    @torch.inference_mode()
    def forward_rows(self, x: torch.Tensor, spans: Sequence[Span], kv: KVCache, *,
                     logit_rows: torch.Tensor | None = None, exit_layer: int | None = None,
                     pseudo: torch.Tensor | None = None, firp_layer: int | None = None,
                     make_pseudo=None, interrupt=None) -> StageForward:
        """Run this stage on packed real rows and FIRP pseudo rows ([Note: pseudo rows] in pipeline/model/row_layout.py).

        x, spans, logit_rows: as in `forward`; logit_rows may also be (rows, apart): the head runs on
            the `apart` rows in a matmul of their own, after `rows`, so the logits of `rows` are those
            of a pass without them (prompt-logprob rows: stage_executor.py); out is then both, in order.
        exit_layer: an absolute layer of this stage whose hidden state at each item's last row
            is returned as `exit_hidden` [num_items, hidden_size]; None: no exit hidden state.
        pseudo: [sum num_pseudo, hidden] pseudo rows made by an earlier stage, or None.
        firp_layer, make_pseudo: if `pseudo` is None and absolute layer `firp_layer` is in this
            stage, after it `make_pseudo(anchor_hidden [num_anchor_rows, hidden])` returns the
            pseudo rows [sum num_pseudo, hidden] (anchors in span order; chains in anchor order).
        Without either, spans' pseudo chains are ignored (a stage before the FIRP layer).
        interrupt: called before each layer; True raises PassInterrupted (KV lengths unchanged).
        Returns a StageForward; the last stage turns every pseudo row into logits.
        """
        for span in spans:
            kv.check_write(span.slot, span.start, span.num_tokens)
            if span.is_sibling:  # [Note: sibling rows] in pipeline/model/row_layout.py
                kv.scratch_index(span.scratch)
        device = x.device
        positions = torch.cat([torch.arange(s.start, s.start + s.num_tokens) for s in spans]).to(device)
        last_rows = torch.tensor(list(last_rows_of(spans)), device=device)
        h = self.embed_tokens(x) if self.is_first else x
        num_real = h.shape[0]
        layout = None
        if pseudo is not None:
            h, positions, layout = self._add_pseudo(h, positions, pseudo, spans)
        bound = kv.max_model_len + kv.num_scratch  # [Note: cached rotation tables] in rope.py
        ropes = self.rope_tables(positions, h.dtype, max_positions=bound)
        plan = AttentionPlan.build(spans, layout, device, scratch_base=kv.max_model_len)
        exit_hidden = None
        for local, (name, layer) in enumerate(self.layers.items()):
            if interrupt is not None and interrupt():
                raise PassInterrupted(local)
            h = layer(h, *ropes[int(name)], plan, kv, local)
            if int(name) == self.draft_after:
                drafted = self.draft_layer(h, *ropes[int(name)], plan, kv, len(self.layers))
                if exit_layer is not None:
                    exit_hidden = drafted[last_rows]
            elif exit_layer is not None and int(name) == exit_layer:
                exit_hidden = h[last_rows]
            if layout is None and make_pseudo is not None and int(name) == firp_layer:
                anchors = torch.tensor(list(anchor_rows(spans)), dtype=torch.int64, device=device)
                if len(anchors):
                    h, positions, layout = self._add_pseudo(h, positions, make_pseudo(h[anchors]), spans)
                    ropes = self.rope_tables(positions, h.dtype, max_positions=bound)
                    plan = AttentionPlan.build(spans, layout, device, scratch_base=kv.max_model_len)
        for span in (s for s in spans if not s.is_sibling):  # a sibling's key went to scratch
            kv.set_length(span.slot, span.start + span.num_tokens)
        real, fake = h[:num_real], (h[num_real:] if layout is not None else None)
        if not self.is_last:
            return StageForward(real, fake, exit_hidden)
        rows, apart = logit_rows if isinstance(logit_rows, tuple) else (last_rows if logit_rows is None else logit_rows, None)
        logits = self._logits(real[rows] if fake is None else torch.cat([real[rows], fake]))  # one head matmul for both
        out = logits[:len(rows)] if apart is None else torch.cat([logits[:len(rows)], self._logits(real[apart])])
        return StageForward(out, None if fake is None else logits[len(rows):], exit_hidden)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and the family's soft-cap: [rows, hidden] -> float32 [rows, vocab]."""
        return soft_cap(self.lm_head.forward(self.norm.forward(h)).float(), self.config.final_logit_softcapping)

    @staticmethod
    def _add_pseudo(h: torch.Tensor, positions: torch.Tensor, pseudo: torch.Tensor,
                    spans: Sequence[Span]) -> tuple[torch.Tensor, torch.Tensor, PseudoLayout]:
        """Append pseudo rows [num_pseudo, hidden] and their positions; build the layout."""
        want = sum(s.num_pseudo for s in spans)
        if pseudo.shape[0] != want:
            raise ValueError(f"{pseudo.shape[0]} pseudo rows for spans that need {want}")
        pos = torch.tensor([p for s in spans for p in s.pseudo_positions()], dtype=positions.dtype)
        return (torch.cat([h, pseudo.to(h.dtype)]), torch.cat([positions, pos.to(positions.device)]),
                PseudoLayout.build(spans, h.device))


def set_rope_buffers(model: StageModel, config: ModelConfig, device: torch.device | str = "cpu") -> None:
    """Fill a meta-built model's RoPE frequency buffers (global, local for Gemma 3's sliding layers, LongRoPE's long)."""
    model.inv_freq, model.inv_freq_local = (config_inv_freq(config, local=loc).to(device) for loc in (False, True))
    long = config_inv_freq(config, local=False, long=True)
    model.inv_freq_long = None if long is None else long.to(device)


def checkpoint_shapes(config: ModelConfig, layer_range: LayerRange, *, is_first: bool,
                      is_last: bool) -> dict[str, tuple[int, ...]]:
    """{checkpoint tensor name: the shape one stage's model needs} (built on the meta device: no
    memory), to check a checkpoint's headers before any stage starts."""
    with torch.device("meta"):
        model = StageModel(config, layer_range, is_first=is_first, is_last=is_last)
    return {checkpoint_name(n, config): tuple(p.shape) for n, p in model.named_parameters()}


def build_stage_model(config: ModelConfig, layer_range: LayerRange, *, is_first: bool, is_last: bool,
                      tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu", fuse: bool = True, consume: bool = False) -> StageModel:
    """Build a StageModel on the meta device and assign its weights from `tensors` (checkpoint names).

    fuse: concatenate q/k/v and gate/up projections into single matmuls after loading (as vLLM's
    QKVParallelLinear / MergedColumnParallelLinear do): identical maths, fewer, larger kernels.
    consume: remove the tensors used from `tensors`, so that fusing frees the unfused copies (a
    stage worker's peak memory then stays near its weights, not twice its projections).

    Raises ValueError naming the first missing or mis-shaped checkpoint tensor.
    """
    with torch.device("meta"):
        model = StageModel(config, layer_range, is_first=is_first, is_last=is_last)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        ckpt = checkpoint_name(name, config)
        if ckpt not in tensors:
            raise ValueError(f"checkpoint has no tensor {ckpt!r} (needed by stage layers {layer_range})")
        t = tensors[ckpt]
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint tensor {ckpt!r} has shape {tuple(t.shape)}, expected {tuple(param.shape)}")
        state[name] = t.to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True, strict=True)
    for name in state if consume else ():
        tensors.pop(checkpoint_name(name, config), None)
    del state
    if is_first and is_last and config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # one tensor, as in the checkpoint
    set_rope_buffers(model, config, device)
    if fuse:
        for layer in model.layers.values():
            layer.self_attn.fuse()
            layer.mlp.fuse()  # (an MoE block fuses each expert)
    return model.eval()
