"""Re-planning under drift, ``bench_multimodel.py --drift`` (issue 61): does an auto server that
re-plans from the load it observes beat one that keeps the placement it chose at start, when the
hot model changes half-way?

The regime (found by simulation first, see docs/guides/many-models.md): 3 models on 2 devices,
each device holding two whole models but not three pp=2 first stages (``drift_budget``: the
embeddings make a first stage 77 % of a model, so no pipeline holds every model), an SLO of a few
single-request latencies. Auto then places whole models: for "m0 hot" (Zipf-like ``skew``, the
first model hot) it gives m0 a device of its own and m1, m2 the other; when m2 becomes the hot one,
the placement kept from the start leaves it sharing a device, and a re-plan gives it one.

What this module owns:

- the two-phase seeded trace (``two_phase_trace``): the first half at the Zipf-like shares with m0
  hot, the second with the order reversed (m2 hot), each model a Gamma process of CV ``cv``;
- the simulator's prediction of both arms (``predict_arms``): "fixed" keeps the start's placement;
  "replan" re-plans every ``interval_s`` from the last ``look_back_s`` of arrivals, as the server does
  (``search.replan``, ``min_gain``, ``min_requests``), each segment between changes simulated on the
  placement then in force (every ``window_s`` window simulated on its own: no queue carried over);
- the measured side's bookkeeping: each request's outcome (met its SLO, missed it: late, 429 or
  504, or failed: a 5xx other than 504, a connection error, anything else), attainment per half and
  per window, the server's placement history mapped onto trace time (``replans``);
- the driver (``run_drift``: ``--pairs`` pairs of servers on the same trace, fixed and re-planning
  in alternating order, A B B A ..., both told the first half's workload), the JSON entry
  (``"drift"``: every pair, and over the pairs the second-half gain, the first-half control, the
  failures and the re-plan searches' cost), the table and the plot (``multimodel-drift.png``:
  attainment per window, every run and the arms' means, measured and predicted, the switch and the
  re-plans marked).

    python benchmarks/bench_multimodel.py --drift --drift-rate 29 --json /tmp/drift.json --plots /tmp   # ~15 min, 2 cores
    python benchmarks/bench_multimodel.py --drift --quick --pairs 1 --json /tmp/drift.json --plots /tmp   # ~5 min: a smoke
    python -m pytest tests/benchmarks/test_multimodel_drift.py -q
"""

from __future__ import annotations

import bisect
import itertools
import json
import statistics
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multimodel_paired import run_order
from multimodel_report import json_header

from shardserve.partitioner.placement.cost_profile import cost_profiles
from shardserve.partitioner.placement.latency import MeasuredLatency, ModelProfile
from shardserve.partitioner.placement.layout import MIB, Placement
from shardserve.partitioner.placement.search import replan
from shardserve.partitioner.placement.simulator import SimConfig, simulate
from shardserve.partitioner.placement.workload import ArrivalSpec, Trace, Workload, look_back

ARMS = ("fixed", "replan")
MIN_GAIN, MIN_REQUESTS = 0.02, 50  # the server's re-plan thresholds (serving/config.py PlacementConfig)


# ------------------------------------------------------------------------------------ the trace
def shares(names: Sequence[str], rate: float, skew: float) -> dict[str, float]:
    """``rate`` req/s shared Zipf-like: the k-th of ``names`` (from 1) in proportion to ``1 / k**skew``
    (as ``serve --workload-skew`` and ``workload.steady``)."""
    weights = [1.0 / (k + 1) ** skew for k in range(len(names))]
    return {m: rate * w / sum(weights) for m, w in zip(names, weights, strict=True)}


def two_phase_trace(
    names: Sequence[str], *, rate: float, cv: float, skew: float, half_s: float, seed: int
) -> Trace:
    """``2 * half_s`` seconds: the first half at ``shares(names)`` (the first model hot), the second at
    ``shares(reversed(names))`` (the last model hot); the same total ``rate``, one seeded generator."""
    first, second = shares(names, rate, skew), shares(list(reversed(names)), rate, skew)
    specs = [ArrivalSpec(m, first[m], cv, 0.0, half_s) for m in names]
    specs += [ArrivalSpec(m, second[m], cv, half_s, 2 * half_s) for m in names]
    return Workload(tuple(specs), duration_s=2 * half_s, seed=seed).trace()


def cut(trace: Trace, t0: float, t1: float) -> Trace:
    """The requests of ``[t0, t1)``, their times from ``t0``, over ``t1 - t0`` seconds."""
    times = [t for t, _ in trace.requests]
    lo, hi = bisect.bisect_left(times, t0), bisect.bisect_left(times, t1)
    return Trace(tuple((t - t0, m) for t, m in trace.requests[lo:hi]), duration_s=t1 - t0)


def edges(duration_s: float, window_s: float) -> list[float]:
    """Window boundaries from 0 to ``duration_s`` (the last window may be shorter)."""
    n = int(duration_s / window_s + 1e-9)
    out = [round(k * window_s, 9) for k in range(n + 1)]
    return out if out[-1] >= duration_s - 1e-9 else [*out, duration_s]


# ------------------------------------------------------------------------------- the outcome
@dataclass(frozen=True)
class Tally:
    """Requests of a span and what became of them."""

    requests: int = 0
    good: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.requests + other.requests, self.good + other.good)

    @property
    def attainment(self) -> float | None:
        return round(self.good / self.requests, 6) if self.requests else None


def outcome(status: int, latency_s: float, slo_s: float) -> str:
    """``good`` (200 within the SLO), ``slo_miss`` (200 late, 429 refused or 504 expired: what an SLO
    costs), or a failure: ``5xx`` (other than 504), ``connection`` (no answer), ``other`` (e.g. 404)."""
    if status == 200:
        return "good" if latency_s <= slo_s else "slo_miss"
    if status in (429, 504):
        return "slo_miss"
    if status == 0:
        return "connection"
    return "5xx" if 500 <= status < 600 else "other"


def measured_side(
    sent: Sequence[Any], *, slo_s: float, half_s: float, window_s: float, switch_margin_s: float = 10.0
) -> dict[str, Any]:
    """A measured arm from its replayed requests (``loadtest.replay.Sent``: due_s, status, latency_s):
    attainment per half and per window, the outcome counts, and the failures within
    ``switch_margin_s`` of the switch."""
    bounds = edges(2 * half_s, window_s)
    windows = [Tally() for _ in bounds[:-1]]
    halves = [Tally(), Tally()]
    counts = {k: 0 for k in ("good", "slo_miss", "5xx", "connection", "other")}
    at_switch = 0
    for s in sent:
        kind = outcome(s.status, s.latency_s, slo_s)
        counts[kind] += 1
        one = Tally(1, int(kind == "good"))
        halves[int(s.due_s >= half_s)] += one
        w = min(max(bisect.bisect_right(bounds, s.due_s) - 1, 0), len(windows) - 1)
        windows[w] += one
        if kind in ("5xx", "connection", "other") and abs(s.due_s - half_s) <= switch_margin_s:
            at_switch += 1
    failed = counts["5xx"] + counts["connection"] + counts["other"]
    return {
        "requests": len(sent),
        "attainment": Tally(len(sent), counts["good"]).attainment,
        "half_attainment": [h.attainment for h in halves],
        "window_attainment": [w.attainment for w in windows],
        "outcomes": counts,
        "failed": failed,
        "failed_at_switch": at_switch,
    }


def replans(history: Sequence[Mapping[str, Any]], *, trace_start_wall: float) -> list[dict[str, Any]]:
    """The placements rolled after the start (the server's ``/ui/status`` placement history, each
    ``{"time": wall clock, "placement", "attainment", "reason"}``), each with its time on the trace's
    clock (negative: before the trace)."""
    return [
        {
            "t_s": round(h["time"] - trace_start_wall, 2),
            "placement": h["placement"],
            "predicted_attainment": h.get("attainment"),
            "reason": h.get("reason"),
        }
        for h in history[1:]
    ]


# ------------------------------------------------------------------------------- the prediction
@dataclass(frozen=True)
class Planner:
    """What a re-plan is given, as the server's ``PlacedModels`` gives it: the profiles (stage times
    as measured), the devices and their memory, each model's SLO as the server computes it (its
    ``--slo-scale`` times the profile's single-request latency) and the scheduler's knobs."""

    profiles: Sequence[ModelProfile]
    num_devices: int
    device_memory_bytes: int
    server_slo_s: Mapping[str, float]
    config: SimConfig

    def replan(self, trace: Trace, current: Placement) -> Placement | None:
        """The placement a re-plan on ``trace`` rolls (None: it keeps ``current``)."""
        if len(trace.requests) < MIN_REQUESTS:
            return None
        choice = replan(
            trace,
            self.profiles,
            current=current,
            num_devices=self.num_devices,
            device_memory_bytes=self.device_memory_bytes,
            slo_s=self.server_slo_s,
            config=self.config,
            min_gain=MIN_GAIN,
        )
        return None if choice.policy == "current" else choice.placement


def predict_arms(
    trace: Trace,
    start: Placement,
    *,
    half_s: float,
    window_s: float,
    interval_s: float,
    look_back_s: float,
    planner: Planner,
    profiles: Sequence[ModelProfile],
    slo_s: float,
) -> dict[str, dict[str, Any]]:
    """Both arms as the simulator predicts them on ``trace`` (``profiles``: the stage times at the
    server's pace; ``slo_s``: the requests' SLO): "fixed" on ``start`` throughout, "replan" re-planning
    at every multiple of ``interval_s`` (see module doc). Per arm: attainment per half and per window,
    and the re-plans (trace time, placement)."""
    changes: list[tuple[float, Placement]] = [(0.0, start)]
    t = interval_s
    while t < trace.duration_s - 1e-9:
        new = planner.replan(look_back(trace.requests, now=t, window_s=look_back_s), changes[-1][1])
        if new is not None and new != changes[-1][1]:
            changes.append((round(t, 6), new))
        t += interval_s
    out = {}
    for arm, plan in (("fixed", [(0.0, start)]), ("replan", changes)):
        bounds = edges(trace.duration_s, window_s)
        cuts = sorted({*bounds, half_s, *(c for c, _ in plan)})
        windows = [Tally() for _ in bounds[:-1]]
        halves = [Tally(), Tally()]
        for a, b in itertools.pairwise(cuts):
            if b - a < 1e-6:
                continue
            placement = [p for c, p in plan if c <= a + 1e-9][-1]
            part = cut(trace, a, b)
            got = Tally(len(part.requests), 0)
            if part.requests:
                res = simulate(placement, profiles, part, slo_s=slo_s, config=planner.config)
                got = Tally(res.overall.requests, res.overall.good)
            halves[int(a >= half_s - 1e-9)] += got
            windows[min(bisect.bisect_right(bounds, a + 1e-9) - 1, len(windows) - 1)] += got
        out[arm] = {
            "attainment": (halves[0] + halves[1]).attainment,
            "half_attainment": [h.attainment for h in halves],
            "window_attainment": [w.attainment for w in windows],
            "replans": [{"t_s": c, "placement": p.describe()} for c, p in plan[1:]],
        }
    return out


# ------------------------------------------------------------------------------- the report
def half_points(measured: Mapping[str, Mapping[str, Any]], half: int) -> float | None:
    """Replan minus fixed in half ``half`` (0, 1), in points (None: an arm has no requests there)."""
    a, b = (measured.get(arm, {}).get("half_attainment", [None, None])[half] for arm in ARMS)
    return None if a is None or b is None else round(100 * (b - a), 2)


def pair_entry(
    *,
    order: Sequence[str],
    measured: Mapping[str, Mapping[str, Any]],
    predicted: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """One pair of runs: the order they ran in, per arm what was measured and what the simulator
    predicted; ``gain_points``: replan minus fixed in the second half, measured and predicted;
    ``first_half_points``: the same in the first half (the control: both arms hold the start's
    placement until the first re-plan, so this is the VM's drift between the runs plus what
    re-planning itself costs)."""
    return {
        "order": list(order),
        "arms": {
            arm: {"measured": dict(measured.get(arm, {})), "predicted": dict(predicted[arm])} for arm in ARMS
        },
        "gain_points": {"measured": half_points(measured, 1), "predicted": half_points(predicted, 1)},
        "first_half_points": {"measured": half_points(measured, 0), "predicted": half_points(predicted, 0)},
    }


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Per pair, their mean and spread (max - min); None where a pair had no value."""
    got = [v for v in values if v is not None]
    return {
        "per_pair": list(values),
        "mean": round(statistics.fmean(got), 2) if got else None,
        "spread": round(max(got) - min(got), 2) if got else None,
    }


def drift_entry(*, settings: Mapping[str, Any], pairs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON ``"drift"`` entry: the settings, every pair (``pair_entry``), and over the pairs the
    second-half gain and the first-half control (measured and predicted: per pair, mean, spread),
    the failed requests per arm (all, within 10 s of the switch) and the re-plan searches' cost."""

    def over(key: str, side: str) -> dict[str, Any]:
        return spread([p[key][side] for p in pairs])

    def total(arm: str, key: str) -> int:
        return sum(int(p["arms"][arm]["measured"].get(key, 0)) for p in pairs)

    searches = [p["arms"]["replan"]["measured"].get("searches") or {} for p in pairs]
    count = sum(int(x.get("count", 0)) for x in searches)
    seconds = sum(float(x.get("seconds", 0.0)) for x in searches)
    return {
        **settings,
        "pairs": [dict(p) for p in pairs],
        "gain_points": {side: over("gain_points", side) for side in ("measured", "predicted")},
        "first_half_points": {side: over("first_half_points", side) for side in ("measured", "predicted")},
        "failed": {arm: total(arm, "failed") for arm in ARMS},
        "failed_at_switch": {arm: total(arm, "failed_at_switch") for arm in ARMS},
        "replan_searches": {
            "count": count,
            "mean_ms": round(1e3 * seconds / count, 1) if count else None,
        },
    }


def drift_table(entry: Mapping[str, Any]) -> str:
    """One line per run (pair, arm, in the order run): attainment of each half, measured and
    predicted, failures and re-plans; then the gain and the control over the pairs."""

    def f(x: float | None) -> str:
        return "  -  " if x is None else f"{x:.3f}"

    lines = [
        f"{'pair':>4} {'arm':<7} {'1st half':>8} {'(pred)':>7} {'2nd half':>8} {'(pred)':>7} {'failed':>6} "
        f"{'at switch':>9}  re-plans (s on the trace: placement)"
    ]
    for k, pair in enumerate(entry["pairs"]):
        for arm in pair["order"]:
            m, p = pair["arms"][arm]["measured"], pair["arms"][arm]["predicted"]
            mh = m.get("half_attainment", [None, None])
            rp = "; ".join(f"{r['t_s']:g}: {r['placement']}" for r in m.get("replans", [])) or "-"
            lines.append(
                f"{k + 1:>4} {arm:<7} {f(mh[0]):>8} {f(p['half_attainment'][0]):>7} {f(mh[1]):>8} "
                f"{f(p['half_attainment'][1]):>7} {m.get('failed', 0):>6} {m.get('failed_at_switch', 0):>9}  {rp}"
            )

    def points(x: Mapping[str, Any]) -> str:
        per = " ".join("-" if v is None else f"{v:+.1f}" for v in x["per_pair"])
        return per if x["mean"] is None else f"{per} (mean {x['mean']:+.1f}, spread {x['spread']:.1f})"

    g, c, s = entry["gain_points"], entry["first_half_points"], entry["replan_searches"]
    lines.append(f"2nd-half gain of re-planning per pair: measured {points(g['measured'])}; "
                 f"predicted {points(g['predicted'])}")  # fmt: skip
    lines.append(f"1st half (the control: same placement until the first re-plan): {points(c['measured'])}")
    lines.append(f"failed requests {entry['failed']}, within 10 s of the switch {entry['failed_at_switch']}; "
                 f"re-plan searches {s['count']}, {s['mean_ms']} ms each")  # fmt: skip
    return "\n".join(lines)


def plot_drift(entry: Mapping[str, Any], path: Path) -> None:
    """Attainment per window over the trace, both arms: each run measured (thin), the mean of the
    runs measured (solid) and predicted (dashed); the switch (grey) and each measured re-plan (the
    replan arm's colour) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w, half = entry["window_s"], entry["half_s"]

    def mean(rows: Sequence[Sequence[float | None]]) -> list[float]:
        cols = [[v for v in col if v is not None] for col in zip(*rows, strict=True)]
        return [statistics.fmean(c) if c else float("nan") for c in cols]

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for k, arm in enumerate(ARMS):
        sides = [p["arms"][arm] for p in entry["pairs"]]
        runs = [s["measured"]["window_attainment"] for s in sides if s["measured"].get("window_attainment")]
        xs = [w * (i + 0.5) for i in range(len(sides[0]["predicted"]["window_attainment"]))]
        for ys in runs:
            ax.plot(
                xs, [float("nan") if y is None else y for y in ys], "-", color=f"C{k}", lw=0.7, alpha=0.35
            )
        if runs:
            ax.plot(xs, mean(runs), "-o", color=f"C{k}", ms=4, label=f"{arm} measured ({len(runs)} runs)")
        ax.plot(xs, mean([s["predicted"]["window_attainment"] for s in sides]), "--", color=f"C{k}",
                alpha=0.7, label=f"{arm} predicted")  # fmt: skip
        for s in sides:
            for r in s["measured"].get("replans", []):
                ax.axvline(r["t_s"], color=f"C{k}", lw=0.6, ls=":")
    ax.axvline(half, color="grey", lw=1.2, label="switch: m2 hot")
    ax.set(xlabel="time on the trace (s)", ylabel=f"SLO attainment per {w:g} s window", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title(
        f"{entry['models']} models, 2 devices: m0 hot, then m2 hot ({entry['rate']:g} req/s, skew "
        f"{entry['skew']:g}, CV {entry['cv']:g}, SLO {entry['slo_scale']:g}x), {len(entry['pairs'])} pairs",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_drift(
    entry: dict[str, Any],
    args: Any,
    info: dict[str, Any],
    *,
    single: float,
    memory: int,
    measured: MeasuredLatency,
) -> int:
    """The drift run's table, JSON (``"drift"``) and plot."""
    print(
        f"\n{info['cpu']}, dtype {args.dtype}; {args.models} models, 2 devices of {memory / MIB:.0f} MiB; "
        f"single-request latency {1e3 * single:.1f} ms; {entry['half_s']:g} s + {entry['half_s']:g} s"
    )
    print(drift_table(entry))
    if args.json is not None:
        out = {**json_header(args, info, single=single, memory=memory, measured=measured), "drift": entry}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    if args.plots is not None:
        plot_drift(entry, args.plots / "multimodel-drift.png")
    return 0


# ------------------------------------------------------------------------------- the driver
def drift_budget(config: Any, *, dtype_bytes: int, max_batch_size: int) -> int:
    """Memory per device for the drift regime: two whole models of ``config``'s shape (and a
    twentieth) plus a micro-batch's activations: less than three pp=2 first stages (each ~77 % of a
    model), so no pipeline holds every model and auto places whole models."""
    (profile,), _, _ = cost_profiles(
        {"m": config}, devices=2, seq_len=384, max_batch_size=max_batch_size, dtype_bytes=dtype_bytes
    )
    whole = profile.weight_bytes(1, 1, 0)
    return profile.activation_bytes + 2 * whole + whole // 20 + MIB


def with_replan(cmd: Sequence[str], interval_s: float, look_back_s: float) -> list[str]:
    """``cmd`` (serve arguments) re-planning every ``interval_s`` over ``look_back_s`` (0: never)."""
    out = list(cmd)
    for flag, value in (("--replan-interval-s", interval_s), ("--replan-look-back-s", look_back_s)):
        if flag in out:
            out[out.index(flag) + 1] = f"{value:g}"
        else:
            out += [flag, f"{value:g}"]
    return out


def placement_status(url: str) -> dict[str, Any]:
    """The server's placement as ``/ui/status`` shows it (``history``, ``searches``, ...)."""
    with urllib.request.urlopen(url + "/ui/status", timeout=10) as resp:
        return dict(json.loads(resp.read())["placement"])


Serve = Callable[[list[str]], Any]  # serve arguments -> a context manager yielding a server (.url)


def run_drift(
    args: Any,
    *,
    names: list[str],
    base_cmd: list[str],
    serve: Serve,
    replay_trace: Callable[[str, Trace, float], list[Any]],
    placement_of: Callable[[str], Placement],
    pace_of: Callable[[str, Placement], tuple[int, float]],
    profiles_at: Callable[[dict[int, float]], list[ModelProfile]],
    planner: Planner,
    slo_s: float,
    status_of: Callable[[str], dict[str, Any]] = placement_status,
) -> dict[str, Any]:
    """``args.pairs`` pairs of runs on one seeded two-phase trace, in alternating order (fixed then
    replan, replan then fixed, ...: a steady drift of the VM's speed favours neither arm), each run a
    fresh ``--placement auto`` server told the first half's workload and warmed with 5 s of it. Each
    pair's prediction is scaled by its fixed run's pace just before the trace (the re-planning run is
    not probed before: a probe's burst would be in its look-back); every run's pace after its trace
    is recorded (``pace_after``), and the re-planning server's search count and time."""
    trace = two_phase_trace(names, rate=args.drift_rate, cv=args.drift_cv, skew=args.drift_skew,
                            half_s=args.drift_half_s, seed=args.seed)  # fmt: skip
    warm = Workload(
        tuple(
            ArrivalSpec(m, r, args.drift_cv)
            for m, r in shares(names, args.drift_rate, args.drift_skew).items()
        ),
        duration_s=5.0,
        seed=999,
    ).trace()
    workload = ["--workload-rate", f"{args.drift_rate:g}", "--workload-cv", f"{args.drift_cv:g}",
                "--workload-skew", f"{args.drift_skew:g}", "--slo-scale", f"{args.drift_slo_scale:g}"]  # fmt: skip
    cmds = {
        "fixed": with_replan(base_cmd + workload, 0, args.replan_look_back_s),
        "replan": with_replan(base_cmd + workload, args.replan_interval_s, args.replan_look_back_s),
    }
    runs: list[dict[str, dict[str, Any]]] = [{} for _ in range(args.pairs)]
    starts: list[tuple[Placement, tuple[int, float]]] = []  # per pair: fixed's placement and pace
    for k, side in enumerate(run_order(args.pairs)):
        arm = ARMS[side]
        with serve(cmds[arm]) as srv:
            replay_trace(srv.url, warm, slo_s)
            placement = placement_of(srv.url)
            if arm == "fixed":
                starts.append((placement, pace_of(srv.url, placement)))
            wall = time.time() + 0.05  # replay's start: its first request is due 50 ms after the call
            sent = replay_trace(srv.url, trace, slo_s)
            status = status_of(srv.url)
            after = pace_of(srv.url, placement_of(srv.url))  # the VM's speed after the trace
        got = measured_side(sent, slo_s=slo_s, half_s=args.drift_half_s, window_s=args.window_s)
        got["start_placement"] = placement.describe()
        got["replans"] = replans(status.get("history", []), trace_start_wall=wall)
        got["searches"] = status.get("searches")
        got["pace_after"] = round(after[1], 3)
        runs[k // 2][arm] = got
        print(f"pair {k // 2 + 1} {arm}: halves {got['half_attainment']} failed {got['failed']} "
              f"re-plans {got['replans']} searches {got['searches']}", flush=True)  # fmt: skip
    pairs = []
    for k, (measured, (start, pace)) in enumerate(zip(runs, starts, strict=True)):
        predicted = predict_arms(
            trace,
            start,
            half_s=args.drift_half_s,
            window_s=args.window_s,
            interval_s=args.replan_interval_s,
            look_back_s=args.replan_look_back_s,
            planner=planner,
            profiles=profiles_at({pace[0]: pace[1]}),
            slo_s=slo_s,
        )
        pair = pair_entry(order=[ARMS[s] for s in run_order(args.pairs)[2 * k : 2 * k + 2]],
                          measured=measured, predicted=predicted)  # fmt: skip
        pair["pace"] = {"pp": pace[0], "factor": round(pace[1], 3)}
        pairs.append(pair)
    settings = {
        "models": len(names),
        "rate": args.drift_rate,
        "cv": args.drift_cv,
        "skew": args.drift_skew,
        "slo_scale": args.drift_slo_scale,
        "slo_ms": round(1e3 * slo_s, 2),
        "half_s": args.drift_half_s,
        "window_s": args.window_s,
        "seed": args.seed,
        "requests": len(trace.requests),
        "replan_interval_s": args.replan_interval_s,
        "replan_look_back_s": args.replan_look_back_s,
        "start_placement": starts[0][0].describe(),
    }
    return drift_entry(settings=settings, pairs=pairs)
