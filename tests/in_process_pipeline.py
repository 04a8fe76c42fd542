"""The real Engine driving real StageExecutors of real StageModels, in one process, in lock-step.

Owns `InProcessPipeline`: S stages joined by FIFO queues (one micro-batch per stage per step), each
running `StageExecutor.run` on its model with its own KV cache (epochs, in-band squash, releases),
the exit stage's exit head, and the one pure `Engine` (pipeline/engine/engine.py) fed the events the
coordinator would feed it (exit guesses, results): no second copy of the pump. It gives
multi-stage and speculative greedy output on any model without processes, for tests that sweep
many models (every family) where a real session per model would be too slow.
Must not: replace the multi-process tests (no wire, no threads, no timing).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from pipeline.engine.engine import Engine
from pipeline.engine.events import ExitPassed, Result, StepOutput, Submit
from pipeline.engine.records import SchedulerConfig
from pipeline.engine.stage_executor import StageExecutor
from pipeline.engine.wire import forward_tensors
from pipeline.model.family_blocks import plain_norm_weight
from pipeline.model.stage_model import StageModel
from pipeline.speculation.firp import FirpMaps
from pipeline.speculation.grammar import GrammarVocab
from pipeline.speculation.items import ItemKind
from pipeline.speculation.predictors import ExitHead, Predictor, exit_guesses
from pipeline.speculation.sampling import SamplingParams
from pipeline.speculation.tree import scratch_positions


def exit_head_for(last: StageModel) -> ExitHead:
    """A logit-lens exit head: copies of the last stage's final norm and LM head (as the worker loads)."""
    cfg = last.config
    head = ExitHead(cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, softcap=cfg.final_logit_softcapping)
    head.norm.weight.data.copy_(plain_norm_weight(last.norm.weight.detach(), cfg))
    head.lm_head.weight.data.copy_(last.lm_head.weight.detach())
    return head.eval()


class InProcessPipeline:
    """Generate with `stages` (a split of one model) under the real Engine; see the module docstring."""

    def __init__(self, stages: Sequence[StageModel], *, max_model_len: int, max_num_seqs: int = 4,
                 predictor: Predictor | None = None, exit_layer: int | None = None, draft_tree: int = 1,
                 grammar_vocab: GrammarVocab | None = None, grammar_drafts: bool = True, firp_k: int = 0,
                 grammar_jump: bool = True) -> None:
        """grammar_vocab: the tokenizer of structured outputs (`SamplingParams.grammar`), when a request has one;
        grammar_drafts: `SchedulerConfig.grammar_drafts` (constrained drafts follow the grammar); grammar_jump:
        `SchedulerConfig.grammar_jump` (a forced run as one draft item).
        firp_k: FIRP chains of this many rows from identity maps after the exit layer (0: none); a subclass
        may replace their drafts (`firp_drafts`)."""
        self.stages = list(stages)
        cfg = stages[0].config
        self.engine = Engine(SchedulerConfig(
            num_stages=len(stages), max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            eos_token_ids=cfg.eos_token_ids, speculate=predictor is not None, draft_tree=draft_tree,
            grammar_drafts=grammar_drafts, grammar_jump=grammar_jump, firp_k=firp_k),
            predictor, record_timeline=False, grammar_vocab=grammar_vocab)
        exit_layer = stages[0].layer_range.stop - 1 if exit_layer is None else exit_layer
        head = exit_head_for(stages[-1]) if predictor is not None and predictor.needs_exit_head else None
        self.executors = []
        max_scratch = scratch_positions(draft_tree, self.engine.scheduler.config.max_inflight)  # as the load spec's
        for m in stages:
            here = predictor is not None and exit_layer in m.layer_range
            firp = dict(firp_layer=exit_layer, firp_maps=FirpMaps(cfg.hidden_size, firp_k).eval()
                        if exit_layer in m.layer_range else None) if firp_k else {}
            self.executors.append(StageExecutor(m, m.new_kv_cache(max_num_seqs=max_num_seqs, max_model_len=max_model_len),
                                                exit_layer=exit_layer if here else None,
                                                exit_head=head if here else None, max_scratch=max_scratch, **firp))
        self.queues: list[collections.deque] = [collections.deque() for _ in stages]
        self.outputs: dict[int, list[int]] = collections.defaultdict(list)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], *,
                 max_steps: int = 100_000) -> list[list[int]]:
        """Token ids generated for each prompt (all submitted at once; params: one for all or one each)."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        self._take(self.engine.step([Submit(seq_id=i, prompt_ids=tuple(p), params=per_prompt[i])
                                     for i, p in enumerate(prompts)]))
        for _ in range(max_steps):
            if not self.engine.has_unfinished and not any(self.queues):
                return [self.outputs.get(i, []) for i in range(len(prompts))]
            self._take(self.engine.step(self._step()))
        raise AssertionError(f"the in-process pipeline did not finish in {max_steps} steps")

    def _take(self, out: StepOutput) -> None:
        """Queue the engine's releases (first) and micro-batches for stage 0; record its commits."""
        for commit in out.commits:
            self.outputs[commit.seq_id].extend(commit.token_ids)
        if out.releases:
            self.queues[0].append(("release", [(r.seq_id, r.slot) for r in out.releases]))
        for batch in out.sends:
            tensors = forward_tensors(batch)
            self.queues[0].append(("batch", [it.without_tokens() for it in batch], tensors["x"],
                                   tensors.get("prompt_next"), None))

    def _step(self) -> list:
        """Every stage runs the head of its queue (last stage first); returns the engine events."""
        events = []
        for j in reversed(range(len(self.stages))):
            if not self.queues[j]:
                continue
            entry = self.queues[j].popleft()
            if entry[0] == "release":
                seq_ids, slots = zip(*entry[1], strict=True)
                self.executors[j].release(list(seq_ids), list(slots))
                if j + 1 < len(self.stages):
                    self.queues[j + 1].append(entry)
                continue
            _, items, x, prompt_next, pseudo = entry
            # (an all-stale batch still travels on, empty: as stage_loop.py)
            out = self.executors[j].run(items, x, pseudo, prompt_next=prompt_next)
            if self.executors[j].exit_layer is not None and any(it.kind != ItemKind.PREFILL for it in out.items):
                tokens, probs = out.exit_tokens, out.exit_probs
                guesses = exit_guesses(tokens, probs, len(out.items))
                events.append(ExitPassed(items=tuple(out.items), guesses=tuple(guesses)))
            if j + 1 < len(self.stages):
                hidden = out.hidden if out.hidden is not None else torch.empty(0)
                self.queues[j + 1].append(("batch", out.items, hidden, out.prompt_next, out.pseudo))
            else:
                token_ids = out.token_ids if out.token_ids is not None else torch.empty(0, dtype=torch.int64)
                firp = None if out.firp_tokens is None else self.firp_drafts(out.items, out.firp_tokens)
                events.append(Result(items=tuple(out.items), token_ids=token_ids, logits=out.logits,
                                     prompt_logprobs=out.prompt_logprobs, firp_tokens=firp))
        return events

    def firp_drafts(self, items: Sequence, firp_tokens: torch.Tensor) -> torch.Tensor:
        """The FIRP drafts a result carries (the model's pseudo-row argmax: `firp_tokens`, [sum of items'
        num_pseudo]); a test's subclass may propose its own (same shape)."""
        return firp_tokens
