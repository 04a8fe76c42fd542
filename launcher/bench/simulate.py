"""`speedpipe simulate`: sweep the discrete-event simulator, optionally calibrated on a bench run.

Owns the command: flags, the sweep (stages x acceptance x concurrency x link latency), the check of
a calibrated cost model against every measured configuration of a `bench` results.json
(predicted vs measured tokens/s), and the outputs under --out: simulate.json (strict JSON: an
unlimited --link-bandwidth-bytes-per-s is null, and so is the realised acceptance of a
configuration that verified no draft), simulate.csv and plots (useful/busy utilisation and tokens/s
over stages; tokens/s over link latency when several are swept; predicted vs measured with
--calibrate). The simulation itself is pipeline/engine/simulator.py; the fit is
pipeline/measure/calibrate.py; a results.json's runs are read by launcher/bench/run_records.py.
Speculating configurations pause under load as `launch` does: `--speculative-disable-by-batch-size`,
default stages + 1 ([Note: speculation under load] in pipeline/engine/row_budget.py); each row
reports its limit and `spec_disabled_steps`. A measured run is simulated without the limit (bench
names its modes, and a named mode never pauses).
Must not: start pipelines.

[Note: requested and realised alpha]
`--alpha A` is the probability of the Bernoulli draw that makes each proposed draft right
(pipeline/measure/sim_acceptance.py). The acceptance α of ARCHITECTURE.md §1 is accepted / verified
drafts, and a run's realised α differs from A by chance: a run of 128 tokens on 2 stages verifies
126 drafts, so one standard deviation is 0.045 at A = 0.5, and seed 0 realises 0.39 there (49 of
126; over seeds 0..39 the mean is 0.51: the draws are unbiased). A draft squashed behind an
earlier wrong one uses up a draw without being verified, which changes which draws count. Every
configuration draws from the same seed, so their deviations are alike. Every output says which is
which: simulate.json's and simulate.csv's `alpha_requested` (A) and `alpha_realised` (with
`accepted_drafts` / `verified_drafts`), simulate.json's `alpha_realised` per A (pooled over its
configurations: `realised_alpha`), a line per A on stderr, and the plots' legends ("α requested
0.5, realised 0.44 (pooled; 0.39-0.50 per point)": over the curve's points). Compare the
closed form S / (α·e + (1−α)·S) at the realised α.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import statistics
import sys
from pathlib import Path

from launcher.bench.run_records import load_bench_runs
from launcher.cli.options import DTYPE_HELP, dtype_arg
from launcher.cli.output_paths import check_output_dir, dumps_strict
from pipeline.engine.row_budget import check_disable_by_batch_size, default_disable_by_batch_size
from pipeline.engine.simulator import (
    Bernoulli,
    CostModel,
    DraftsAt,
    FirpReplay,
    Replay,
    SimConfig,
    Simulator,
)
from pipeline.measure.calibrate import Calibration, calibrate, draft_outcomes, draft_positions, firp_chains
from pipeline.measure.calibrate_tables import run_load_factor
from pipeline.measure.row_cost import RowCostTable
from pipeline.run_config import RunConfig


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    """Flags of `speedpipe simulate`."""
    g = p.add_argument_group("sweep")
    g.add_argument("--stages", default="1,2,4,8,16,32,64", help="comma list of stage counts (default 1..64)")
    g.add_argument("--alpha", default="none,0.5,0.9,1", help="comma list of requested acceptance rates in [0, 1] "
                   "for speculating runs: each draft is right with this probability, and the α a run realises "
                   "(accepted / verified drafts) is reported beside it; 'none' = plain decode (default none,0.5,0.9,1)")
    g.add_argument("--concurrency", default="1", help="comma list of sequences run at once (default 1)")
    g.add_argument("--link-latency-s", default="0", help="comma list of per-hop latencies in seconds; with --calibrate, added to the measured "
                   "hand-over time (default 0)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens per sequence (default 32)")
    g.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per sequence (default 16)")
    g.add_argument("--out", default="simulate-out", help="output folder (default ./simulate-out)")
    g.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    g.add_argument("--seed", type=int, default=0, help="seed of the Bernoulli acceptance draws")
    g.add_argument("--speculative-disable-by-batch-size", type=int, metavar="N",
                   help="as launch's: speculating configurations send no new drafts while N or more "
                   "sequences run (default: stages + 1, as --speculate auto; N above --concurrency: never)")
    k = p.add_argument_group("calibration (a measured cost model instead of the synthetic one)")
    k.add_argument("--calibrate", metavar="RESULTS_JSON", help="fit the cost model from a `bench` results.json "
                   "(its runs' timelines from the timelines.json beside it, else from its runs/ folder) "
                   "and report predicted vs measured tokens/s of each of its configurations")
    k.add_argument("--row-cost", default="none", metavar="none|file:PATH", help="with --calibrate: a "
                   "tests/benchmarks/row_cost.py report whose table (--dtype's mode) prices the row counts the "
                   "measured runs did not have (default none: interpolated between them)")
    k.add_argument("--dtype", default="float32", type=dtype_arg, metavar="DTYPE",
                   help=f"with --row-cost: the runs' dtype, {DTYPE_HELP} (default float32)")
    k.add_argument("--replay", action="store_true", help="with --calibrate: draft at every chance, replaying "
                   "each run's verified draft outcomes in order (default: draft where the run drafted, as it did)")
    c = p.add_argument_group("synthetic cost model (without --calibrate; --model-ms, --stage-overhead-ms or --coordinator-ms > 0)")
    c.add_argument("--model-ms", type=float, default=60.0, help="whole-model compute per token row, ms (default 60)")
    c.add_argument("--stage-overhead-ms", type=float, default=0.5, help="fixed cost per stage per micro-batch, ms")
    c.add_argument("--coordinator-ms", type=float, default=1.0, help="coordinator turnaround per result, ms")
    c.add_argument("--predictor-ms", type=float, default=0.0, help="exit head cost on stage 0, ms")
    h = p.add_argument_group("links (with or without --calibrate)")
    h.add_argument("--link-bandwidth-bytes-per-s", type=float, default=float("inf"),
                   help="per-hop bandwidth for hidden states (default: unlimited; null in simulate.json)")
    h.add_argument("--bytes-per-token", type=int, default=576 * 4,
                   help="hidden-state bytes per token row on a hop (default 2304: SmolLM2-135M, float32)")


MAX_SIM_TOKENS = 1_000_000  # per sequence; --max-new-tokens and --prompt-len
# The flags of `simulate` by their argparse dest, as simulate.json's "settings" records them.
SETTINGS = ("stages", "alpha", "concurrency", "link_latency_s", "max_new_tokens", "prompt_len", "out", "no_plots",
            "seed", "calibrate", "row_cost", "dtype", "replay", "model_ms", "stage_overhead_ms", "coordinator_ms",
            "predictor_ms", "link_bandwidth_bytes_per_s", "bytes_per_token",
            "speculative_disable_by_batch_size")


def _list(flag: str, text: str, cast, *, lo: float, hi: float = float("inf"), allow=()) -> list:
    out = []
    for raw in (v.strip() for v in text.split(",")):
        if not raw:
            continue
        if raw in allow:
            out.append(raw)
            continue
        try:
            v = cast(raw)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {raw!r} is not a number") from None
        if not lo <= v <= hi:
            raise ValueError(f"{flag} {text!r}: {raw} is outside [{lo:g}, {hi:g}]")
        out.append(v)
    if not out:
        raise ValueError(f"{flag} is empty")
    return out


def row_shape_arg(args: argparse.Namespace) -> RowCostTable | None:
    """The table of `--row-cost file:PATH` for --dtype's mode, or None. Raises ValueError."""
    if args.row_cost == "none":
        return None
    if not args.row_cost.startswith("file:"):
        raise ValueError(f"--row-cost must be none or file:PATH, got {args.row_cost!r}")
    path = args.row_cost[len("file:"):]
    try:
        return RowCostTable.load(path, RunConfig(dtype=args.dtype).row_cost_mode)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--row-cost {args.row_cost}: {exc}") from None


def predict_run(cal: Calibration, run: dict, *, replay: bool = False, seed: int = 0, at_run_load: bool = False) -> float:
    """Simulated tokens/s of one measured run: same stages, prompt lengths (from its prefill items),
    tokens per sequence, speculation and acceptance (SPEED's drafts where it drafted, right where
    they were, `DraftsAt`, or with `replay` its verified outcomes in order at every chance; FIRP's
    chains as recorded, `FirpReplay`); at_run_load: compute costs scaled by the run's own load (`run_load_factor`)."""
    prompt_lens = {}
    for s in run["timeline"]["slices"]:
        for it in s["items"]:
            if it["kind"] == "prefill":
                prompt_lens[it["seq_id"]] = it["positions"][1]
    lens = tuple(prompt_lens[k] for k in sorted(prompt_lens)) or (16,) * run["concurrency"]
    spec = run["speculate"] in ("speed", "speed+firp")
    stats = run["stats"]
    acceptance = None
    if spec:
        outcomes = draft_outcomes(run["timeline"])
        if replay:
            # no recorded outcomes: the run's rate (null when it verified no draft: none accepted)
            acceptance = Replay(outcomes) if outcomes else Bernoulli(stats["acceptance_rate"] or 0.0, seed=seed)
        else:  # where it drafted, and whether each was right (DraftsAt)
            acceptance = DraftsAt(draft_positions(run["timeline"]))
    firp_k = 0
    if "firp" in run["speculate"]:  # the chain length the run used: its longest FIRP item's drafts
        firp_k = max((it["positions"][1] - it["positions"][0] - 1 for s in run["timeline"]["slices"]
                      for it in s["items"] if it["kind"] == "firp"), default=0)
    firp_alpha = stats.get("firp_accepted", 0) / stats["firp_verified"] if stats.get("firp_verified") else 0.0
    # per sequence, in prompt order; FIRP alone: with SPEED drafts in between, an item's successor
    # need not say how many of its FIRP drafts were accepted
    chains = firp_chains(run["timeline"]) if firp_k > 0 and run["speculate"] == "firp" else []
    cfg = SimConfig(num_stages=run["num_stages"], prompt_lens=lens, max_new_tokens=max(run["num_tokens"]),
                    speculate=spec, exit_head=run.get("exit_head", True), firp_k=max(0, firp_k), firp_alpha=firp_alpha)
    cost = cal.cost_model(run["num_stages"])
    if at_run_load and cal.stage_tables:
        cost = cost.scaled(run_load_factor(run["timeline"], cal.stage_tables[run["num_stages"]],
                                           contention=cal.contention))
    return Simulator(cfg, cost, acceptance=acceptance, firp_replay=FirpReplay(chains) if any(chains) else None,
                     record_timeline=False).run().tokens_per_s


def check_calibration(cal: Calibration, runs: list[dict], *, replay: bool = False, seed: int = 0) -> list[dict]:
    """Per measured configuration: median measured and predicted tokens/s over its runs, and the
    error; also predicted at each run's own load (`at_run_load_*`: [Note: table calibration] in
    pipeline/measure/calibrate.py) and the runs' median load."""
    by_cfg: dict[str, list[dict]] = {}
    for r in runs:
        by_cfg.setdefault(r["config"], []).append(r)
    rows = []
    for name, rs in by_cfg.items():
        measured = statistics.median(r["stats"]["tokens_per_s"] for r in rs)
        predicted = statistics.median(predict_run(cal, r, replay=replay, seed=seed) for r in rs)
        at_load = statistics.median(r["stats"]["tokens_per_s"] / predict_run(cal, r, replay=replay, seed=seed,
                                                                              at_run_load=True) for r in rs)
        loads = ([run_load_factor(r["timeline"], cal.stage_tables[r["num_stages"]], contention=cal.contention)
                  for r in rs] if cal.stage_tables else [1.0])
        rows.append({"config": name, "measured_tokens_per_s": round(measured, 3),
                     "predicted_tokens_per_s": round(predicted, 3), "error": round(predicted / measured - 1, 4),
                     "at_run_load_error": round(1 / at_load - 1, 4), "run_load": round(statistics.median(loads), 3)})
    return rows


def synthetic_cost(args: argparse.Namespace, num_stages: int, latency_s: float) -> CostModel:
    """Even split of --model-ms over the stages plus --stage-overhead-ms each."""
    stage_s = args.model_ms / 1e3 / num_stages + args.stage_overhead_ms / 1e3
    return CostModel.uniform(num_stages=num_stages, stage_s=stage_s, per_token_s=0.02 * stage_s,
                             hop_latency_s=latency_s, coordinator_s=args.coordinator_ms / 1e3,
                             predictor_s=args.predictor_ms / 1e3)


def simulate_point(args: argparse.Namespace, cal: Calibration | None, *, num_stages: int, alpha: float | str,
                   concurrency: int, latency_s: float) -> dict:
    """One simulated configuration of the sweep (alpha "none" = plain decode): tokens/s, mean busy,
    useful and bubble fractions over the stages, and [Note: requested and realised alpha]:
    `alpha_requested` (the Bernoulli draw's probability, "none" for plain decode) beside
    `alpha_realised` (accepted / verified drafts of the simulated run; None where no draft was
    verified, as `launch --json` reports its acceptance) and the two counts it is made of; a
    speculating one's `speculative_disable_by_batch_size` (the flag, default stages + 1; None for
    plain decode) and `spec_disabled_steps` (micro-batches it sent paused, as `launch --json`'s)."""
    cost = cal.cost_model(num_stages) if cal else synthetic_cost(args, num_stages, latency_s)
    if cal and latency_s:  # extra link latency on top of the measured hand-over
        cost = dataclasses.replace(cost, hop_latency_s=cost.hop_latency_s + latency_s)
    cost = dataclasses.replace(cost, hop_bandwidth_bytes_per_s=args.link_bandwidth_bytes_per_s,
                               bytes_per_token=args.bytes_per_token)
    limit = args.speculative_disable_by_batch_size
    if alpha == "none":
        limit = None
    elif limit is None:
        limit = default_disable_by_batch_size(num_stages)
    cfg = SimConfig(num_stages=num_stages, concurrency=concurrency, prompt_len=args.prompt_len,
                    max_new_tokens=args.max_new_tokens, speculate=alpha != "none",
                    speculative_disable_by_batch_size=limit)
    res = Simulator(cfg, cost, acceptance=None if alpha == "none" else Bernoulli(alpha, seed=args.seed)).run()
    fr = res.timeline.fractions(0, round(res.wall_s * 1e9))
    return {"stages": num_stages, "alpha_requested": alpha, "concurrency": concurrency, "link_latency_s": latency_s,
            "tokens_per_s": round(res.tokens_per_s, 3),
            "busy_fraction": round(statistics.mean(f.busy for f in fr), 4),
            "useful_fraction": round(statistics.mean(f.useful for f in fr), 4),
            "bubble_fraction": round(statistics.mean(f.idle for f in fr), 4),
            "alpha_realised": round(res.acceptance_rate, 4) if res.verified else None,
            "accepted_drafts": res.accepted, "verified_drafts": res.verified,
            "speculative_disable_by_batch_size": limit, "spec_disabled_steps": res.spec_disabled_steps}


def realised_alpha(rows: list[dict]) -> dict:
    """Per requested acceptance of the speculating `rows` (simulate_point's): the realised α pooled
    over them (all accepted over all verified drafts; None without a verified draft) and the
    lowest and highest realised α of a single row that verified a draft.
    {requested: {"pooled", "min", "max", "rows", "verified_rows"}}."""
    out = {}
    for a in dict.fromkeys(r["alpha_requested"] for r in rows if r["alpha_requested"] != "none"):
        mine = [r for r in rows if r["alpha_requested"] == a]
        verified = sum(r["verified_drafts"] for r in mine)
        each = [r["alpha_realised"] for r in mine if r["alpha_realised"] is not None]
        out[a] = {"pooled": round(sum(r["accepted_drafts"] for r in mine) / verified, 4) if verified else None,
                  "min": min(each, default=None), "max": max(each, default=None), "rows": len(mine),
                  "verified_rows": len(each)}
    return out


def alpha_label(alpha: float | str, realised: dict) -> str:
    """A sweep curve's name: the requested α and, beside it, the realised α pooled over the curve's
    points (`realised_alpha` of those rows) with their range."""
    if alpha == "none":
        return "plain (no speculation)"
    r = realised[alpha]
    if r["pooled"] is None:
        return f"SPEED, α requested {alpha:g} (no draft verified)"
    spread = f"; {r['min']:.2f}-{r['max']:.2f} per point" if r["rows"] > 1 and r["min"] != r["max"] else ""
    return f"SPEED, α requested {alpha:g}, realised {r['pooled']:.2f} (pooled{spread})"


def idle_limit_note(limit: int | None, *, alphas: list, stages: list[int], concurrency: list[int]) -> str | None:
    """Why a given `--speculative-disable-by-batch-size` acts on no configuration of the sweep, as
    `launch` notes an idle flag (launcher/cli/flag_notes.py): no configuration speculates (`--alpha
    none` only, or one stage only), or the limit is above every `--concurrency`; None when it may act."""
    if limit is None:
        return None
    if all(a == "none" for a in alphas) or max(stages) < 2:
        return ("--speculative-disable-by-batch-size has no effect: no configuration speculates "
                "(--alpha none only, or --stages 1 only)")
    if limit > max(concurrency):
        return (f"--speculative-disable-by-batch-size {limit} has no effect: above every --concurrency "
                f"(at most {max(concurrency)} streams), no step pauses")
    return None


def _check_costs(args: argparse.Namespace) -> None:
    """The per-pass costs (milliseconds): each >= 0 and finite, and not all of the pass costs 0 without
    --calibrate. Raises ValueError naming the flag."""
    for flag in ("--model-ms", "--stage-overhead-ms", "--coordinator-ms", "--predictor-ms"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not 0 <= value < math.inf:  # also NaN
            raise ValueError(f"{flag} must be a number of milliseconds >= 0, got {value:g}")
    costs = (args.model_ms, args.stage_overhead_ms, args.coordinator_ms, args.predictor_ms)
    if not args.calibrate and max(costs[:3]) == 0:  # (--predictor-ms prices drafts only)
        raise ValueError("--model-ms, --stage-overhead-ms and --coordinator-ms are all 0: a pipeline whose passes "
                         "cost no time has no tokens/s (give one of them > 0)")


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the sweep (and the calibration check); returns 0. Raises ValueError (exit 2) for bad flags."""
    stages = _list("--stages", args.stages, int, lo=1, hi=256)
    alphas = _list("--alpha", args.alpha, float, lo=0.0, hi=1.0, allow=("none",))
    concurrency = _list("--concurrency", args.concurrency, int, lo=1, hi=1024)
    latencies = _list("--link-latency-s", args.link_latency_s, float, lo=0.0, hi=60.0)
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--prompt-len", args.prompt_len)):
        if not 1 <= value <= MAX_SIM_TOKENS:  # each token is simulated: 10^8 ran for minutes
            raise ValueError(f"{flag} must be in [1, {MAX_SIM_TOKENS}], got {value}")
    check_disable_by_batch_size(args.speculative_disable_by_batch_size)  # launch's check and words
    if not args.link_bandwidth_bytes_per_s > 0 or not args.bytes_per_token >= 0:  # also NaN (inf: no limit)
        raise ValueError(f"--link-bandwidth-bytes-per-s must be a number > 0 (got {args.link_bandwidth_bytes_per_s:g}) "
                         f"and --bytes-per-token >= 0 (got {args.bytes_per_token:g})")
    _check_costs(args)
    row_shape = row_shape_arg(args)  # checked with or without --calibrate
    if not args.calibrate and (args.replay or row_shape is not None):
        flag = "--replay" if args.replay else "--row-cost"
        raise ValueError(f"{flag} needs --calibrate RESULTS_JSON (it applies to the measured runs)")
    check_output_dir("--out", args.out)
    if not args.no_plots:
        from launcher.bench.plots import _pyplot
        _pyplot()  # fail now, not after the sweep, if matplotlib is missing (the runtime image has none)
    cal, checks = None, []
    if args.calibrate:
        runs = load_bench_runs(args.calibrate)
        cal = calibrate(runs, row_shape=row_shape)
        checks = check_calibration(cal, runs, replay=args.replay, seed=args.seed)
    if (note := idle_limit_note(args.speculative_disable_by_batch_size, alphas=alphas, stages=stages,
                                concurrency=concurrency)) is not None:
        print(f"[speedpipe] simulate: note: {note}", file=sys.stderr)
    rows = [simulate_point(args, cal, num_stages=st, alpha=a, concurrency=c, latency_s=lat)
            for st in stages for a in alphas if a == "none" or st >= 2 for c in concurrency for lat in latencies]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plots = [] if args.no_plots else write_sim_plots(rows, checks, out)
    settings = {k: getattr(args, k) for k in SETTINGS}  # unlimited bandwidth (inf) is written as null
    realised = {f"{a:g}": r for a, r in realised_alpha(rows).items()}  # JSON keys: "0.5", "1"
    (out / "simulate.json").write_text(dumps_strict({"settings": settings, "calibration": cal.to_json() if cal else None,
                                                     "calibration_check": checks, "alpha_realised": realised,
                                                     "sweep": rows, "plots": plots}, indent=1, default=str))
    with (out / "simulate.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")  # (csv's default is \r\n)
        w.writeheader()
        w.writerows(rows)
    for row in checks:
        print(f"{row['config']:<24} measured {row['measured_tokens_per_s']:8.2f} tokens/s, predicted "
              f"{row['predicted_tokens_per_s']:8.2f} ({row['error']:+.1%}); at each run's load "
              f"(median {row['run_load']:.2f}x) {row['at_run_load_error']:+.1%}")
    for a, r in realised.items():  # [Note: requested and realised alpha]
        print(f"[speedpipe] simulate: α requested {a}, realised {'-' if r['pooled'] is None else r['pooled']} "
              f"(accepted / verified drafts pooled over the {r['verified_rows']} of its {r['rows']} configurations "
              f"that verified any; per configuration {r['min']}..{r['max']})",
              file=sys.stderr)
    print(f"[speedpipe] simulate: {len(rows)} simulated configurations in {out}/simulate.json, simulate.csv"
          + (", plots/*.png" if plots else ""), file=sys.stderr)
    return 0


def write_sim_plots(rows: list[dict], checks: list[dict], out: Path) -> list[str]:
    """Utilisation and tokens/s over stages (one line per acceptance, first concurrency and latency),
    tokens/s over link latency (if several), predicted vs measured (with --calibrate)."""
    from launcher.bench import plots

    made = []
    c0, l0 = rows[0]["concurrency"], rows[0]["link_latency_s"]
    base = [r for r in rows if r["concurrency"] == c0 and r["link_latency_s"] == l0]
    alphas = list(dict.fromkeys(r["alpha_requested"] for r in base))

    def series(rs, key, x="stages"):  # one curve per requested α, named with its realised α over rs
        realised = realised_alpha(rs)
        return {alpha_label(a, realised): ([r[x] for r in rs if r["alpha_requested"] == a],
                                           [r[key] for r in rs if r["alpha_requested"] == a])
                for a in alphas if any(r["alpha_requested"] == a for r in rs)}

    made.append(plots.sweep_lines(series(base, "useful_fraction"), out / "plots" / "sim_utilisation.png",
                                  xlabel="stages", ylabel="useful fraction (mean over stages)", logx=True,
                                  ylim=(0, 1.05), title=f"simulated useful utilisation, concurrency {c0}"))
    made.append(plots.sweep_lines(series(base, "tokens_per_s"), out / "plots" / "sim_tokens_per_s.png",
                                  xlabel="stages", ylabel="tokens/s", logx=True,
                                  title=f"simulated tokens/s, concurrency {c0}, link latency {l0:g} s"))
    lats = sorted({r["link_latency_s"] for r in rows})
    if len(lats) > 1:
        s_max = max(r["stages"] for r in rows)
        rs = [r for r in rows if r["concurrency"] == c0 and r["stages"] == s_max]
        made.append(plots.sweep_lines(series(rs, "tokens_per_s", "link_latency_s"), out / "plots" / "sim_latency.png",
                                      xlabel="link latency per hop (s)", ylabel="tokens/s",
                                      title=f"simulated tokens/s over link latency, {s_max} stages"))
    if checks:
        made.append(plots.measured_vs_predicted(checks, out / "plots" / "sim_calibration.png"))
    return [str(Path(p).relative_to(out)) for p in made]
