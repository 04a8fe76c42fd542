"""Numbers of tests/benchmarks/core_speed.py: tokens/s of one measurement, spreads over repeats,
the paired target ratios ([Note: which ratio decides] in core_speed.py) and the stdout table.
Must not: start processes or measure (core_speed_drivers.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


# -- statistics ------------------------------------------------------------------------------------
def measurement(reply: dict) -> dict:
    """Tokens/s of one measurement ([Note: how the numbers are taken] in core_speed.py)."""
    reqs = reply["requests"]
    tokens = sum(r["num_tokens"] for r in reqs)
    decode_s = max(r["finish_s"] for r in reqs) - min(r["first_token_s"] for r in reqs)
    e2e_s = max(r["finish_s"] for r in reqs) - min(r["submit_s"] for r in reqs)
    out = {
        "decode_tokens_per_s": (tokens - len(reqs)) / decode_s,
        "e2e_tokens_per_s": tokens / e2e_s,
        "ttft_s": max(r["first_token_s"] - r["submit_s"] for r in reqs),
        "generated_tokens": tokens,
        "per_request_decode_tokens_per_s": [(r["num_tokens"] - 1) / (r["finish_s"] - r["first_token_s"])
                                            for r in reqs],
    }
    if reply["stages"]:  # speedpipe: per-stage forward time and CPU use of every process, over e2e_s
        out["stages"] = [{"busy_fraction": s["busy_ns"] / s["wall_ns"] if s["wall_ns"] else 0.0,
                          "busy_ms_per_item": s["busy_ns"] / 1e6 / max(1, s["items_processed"]),
                          "cpu_fraction": s["cpu_s"] / e2e_s, "items_processed": s["items_processed"]}
                         for s in reply["stages"]]
        out["coordinator_cpu_fraction"] = reply["coordinator_cpu_s"] / e2e_s
    return out


def spread(samples: Sequence[float]) -> dict:
    """median, min, max and the samples, rounded for the report."""
    return {"median": round(statistics.median(samples), 4), "min": round(min(samples), 4),
            "max": round(max(samples), 4), "samples": [round(s, 4) for s in samples]}


def summarize(runs: dict[str, list[dict]], bench_configs: Sequence, targets: Sequence) -> tuple[dict, dict]:
    """Per-configuration spreads and the target ratios ([Note: which ratio decides]).

    bench_configs: core_speed.BenchConfig's (key, label, num_prompts); targets: core_speed.Target's
    (num, den, claim, minimum); runs: per config key, one `measurement` (plus its foreign_cpu_fraction
    and attempts) per repeat."""
    configs = {}
    for cfg in bench_configs:
        ms = runs[cfg.key]
        entry = {"label": cfg.label, "num_prompts": cfg.num_prompts,
                 "decode_tokens_per_s": spread([m["decode_tokens_per_s"] for m in ms]),
                 "e2e_tokens_per_s": spread([m["e2e_tokens_per_s"] for m in ms]),
                 "ttft_s": spread([m["ttft_s"] for m in ms]),
                 "foreign_cpu_fraction": spread([m["foreign_cpu_fraction"] for m in ms]),
                 "discarded_attempts": sum(m["attempts"] - 1 for m in ms)}
        if "stages" in ms[0]:
            entry["stages"] = [{k: spread([m["stages"][i][k] for m in ms])
                                for k in ("busy_fraction", "busy_ms_per_item", "cpu_fraction")}
                               for i in range(len(ms[0]["stages"]))]
            entry["coordinator_cpu_fraction"] = spread([m["coordinator_cpu_fraction"] for m in ms])
        configs[cfg.key] = entry
    def paired(t, metric: str) -> list[float]:
        return [n[metric] / d[metric] for n, d in zip(runs[t.num], runs[t.den], strict=True)]

    ratios = {}
    for t in targets:
        decode = paired(t, "decode_tokens_per_s")
        value = statistics.median(decode)
        of_medians = configs[t.num]["decode_tokens_per_s"]["median"] / configs[t.den]["decode_tokens_per_s"]["median"]
        ratios[f"{t.num}/{t.den}"] = {
            "claim": t.claim, "value": round(value, 4), "target": t.minimum, "pass": value >= t.minimum,
            "paired": [round(p, 4) for p in decode], "ratio_of_medians": round(of_medians, 4),
            "e2e_value": round(statistics.median(paired(t, "e2e_tokens_per_s")), 4)}
    return configs, ratios


def format_report(configs: dict, ratios: dict, *, max_new_tokens: int, repeats: int, max_foreign: float) -> str:
    """The stdout table: per-configuration medians [min-max], target ratios, per-stage busy time."""
    lines = [f"core_speed: {max_new_tokens} new tokens, {repeats} repeat(s), medians [min-max]",
             f"{'cfg':<8}{'decode tok/s':>26}{'e2e tok/s':>26}{'TTFT ms':>10}{'foreign':>9}  configuration"]
    for key, c in configs.items():
        d, e = c["decode_tokens_per_s"], c["e2e_tokens_per_s"]
        lines.append(f"{key:<8}{d['median']:>9.2f} [{d['min']:>6.2f}-{d['max']:>6.2f}]"
                     f"{e['median']:>9.2f} [{e['min']:>6.2f}-{e['max']:>6.2f}]"
                     f"{c['ttft_s']['median'] * 1e3:>10.0f}{c['foreign_cpu_fraction']['max']:>9.0%}  {c['label']}")
    lines.append("target ratios: median over repeats of the paired decode tokens/s ratio [per repeat]; "
                 "ratio of the medians; same for e2e")
    for name, r in ratios.items():
        paired = ", ".join(f"{p:.3f}" for p in r["paired"])
        lines.append(f"  {name}  {r['value']:.3f} >= {r['target']:.2f}  {'PASS' if r['pass'] else 'FAIL'}"
                     f"  [{paired}]  of medians {r['ratio_of_medians']:.3f}  e2e {r['e2e_value']:.3f}  ({r['claim']})")
    lines.append("speedpipe processes (medians): forward busy share of stage wall, ms per forward, CPU share of e2e")
    for key, c in configs.items():
        if "stages" in c:
            busy = ", ".join(f"stage {i}: busy {s['busy_fraction']['median']:.0%}, "
                             f"{s['busy_ms_per_item']['median']:.1f} ms/item, CPU {s['cpu_fraction']['median']:.0%}"
                             for i, s in enumerate(c["stages"]))
            lines.append(f"  {key}: {busy}; coordinator CPU {c['coordinator_cpu_fraction']['median']:.0%}")
    worst = max(c["foreign_cpu_fraction"]["max"] for c in configs.values())
    if worst > max_foreign:
        lines.append(f"WARNING: other jobs used up to {worst:.0%} of the machine's CPU during a measurement "
                     f"('foreign' column, max over repeats): ratios are unreliable; rerun on a quiet machine")
    return "\n".join(lines)
