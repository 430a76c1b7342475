"""Part 3's table (``benchmarks/disagg.py``): a row per layout and setup, and what the
processes' CPU figures say beside it."""

from __future__ import annotations

import math
from typing import Any

from _disagg_itl import MODES, SETUPS

__all__ = ["print_itl"]

GOAL = 1.5  # disaggregated p99 loaded / no-load, at most


def print_itl(result: dict[str, Any]) -> None:
    """Part 3's table: a row per layout and setup; the decode engine is the colocated
    server or the consumer, its CPU wait is per second it ran (no-load -> loaded)."""
    w = result["workload"]
    print(
        f"\n3. decode ITL, builtin:tiny: {w['streams']} streams x {w['stream_tokens']} "
        f"tokens; loaded = {w['long_tokens']}-token prompts (max_tokens "
        f"{w['long_max_tokens']}) at {w['rate']:g}/s; {w['rounds']} rounds each"
    )
    print(
        f"   {'setup':<24}{'no-load p50':>12}{'p99':>8}{'loaded p50':>12}{'p99':>8}"
        f"{'p99 ratio':>11}{'prompts':>9}{'rate/s':>8}{'prompt TTFT':>13}{'CPU wait':>14}"
    )
    layouts = {"": result["itl"], ", pinned": result.get("itl_pinned")}
    for suffix, rows in layouts.items():
        for setup in SETUPS if rows else ():
            row = rows[setup]
            idle, busy = row["no_load"], row["loaded"]
            engine = "colocated.colocated" if setup == "colocated" else "disaggregated.consumer"
            wait = [_wait(row["cpu"][mode][engine]) for mode in ("no_load", "loaded")]
            print(
                f"   {setup + suffix:<24}{_ms(idle['p50_s']):>12}{_ms(idle['p99_s']):>8}"
                f"{_ms(busy['p50_s']):>12}{_ms(busy['p99_s']):>8}"
                f"{row['p99_loaded_vs_no_load']:>10.2f}x"
                f"{busy['long_ok']:>5}/{busy['long_sent']:<3}{busy['long_rate_achieved']:>8.2f}"
                f"{_ms(busy['long_ttft_p50_s']):>13}{wait[0]:>8.2f}->{wait[1]:.2f}"
            )
            errors = idle["errors"] + busy["errors"]
            if errors:
                print(f"   {setup}{suffix} errors: {errors}")
            for mode, steps in row.get("decode_steps", {}).items():
                period, gap = steps["period_ms"], steps["gap_ms"]
                print(
                    f"     {mode:<8} decode engine step period p50 {period['p50']:.1f} p99 "
                    f"{period['p99']:.1f}, gap between steps p99 {gap['p99']:.1f}, by kind "
                    + ", ".join(
                        f"{kind} p99 {v['p99']:.1f} ({v['steps']})"
                        for kind, v in steps["period_ms_by_kind"].items()
                    )
                )
    if result.get("itl_pinned"):
        cpus = result["itl_pinned"]["cpus"]
        print(
            f"   pinned: producer on CPU {cpus['disaggregated.producer']}, consumer, proxy "
            f"and client on {cpus['disaggregated.consumer']}, colocated and its client on "
            f"{cpus['colocated.colocated']}"
        )
    for suffix, rows in layouts.items():
        if rows:
            idle = {
                setup: max(_idle(rows[other]["cpu"][mode], setup) for mode in MODES)
                for setup, other in zip(SETUPS, reversed(SETUPS), strict=True)
            }
            print(
                f"   {'pinned' if suffix else 'unpinned'}: idle beside the other setup's rounds, "
                f"the disaggregated processes still ran {idle['disaggregated']:.2f} of a core, "
                f"the colocated server {idle['colocated']:.2f}"
            )
    for suffix, rows in layouts.items():
        if rows:
            ratio = rows["disaggregated"]["p99_loaded_vs_no_load"]
            verdict = _goal(ratio <= GOAL)
            print(
                f"   disaggregated{suffix} p99 loaded / no-load = {ratio:.2f}x (goal <= 1.5x: "
                f"{verdict})"
            )
    print(
        f"   ms; prompts = long prompts answered/sent, at the rate achieved (at most "
        f"{w['long_inflight']} in flight); prompt TTFT = their p50; CPU wait = seconds the "
        f"decode engine's threads waited for a core per second they ran, no-load -> loaded"
    )


def _wait(cpu: dict[str, float]) -> float:
    return cpu["wait"] / cpu["run"] if cpu["run"] else float("nan")


def _idle(cpu: dict[str, dict[str, float]], setup: str) -> float:
    """Cores ``setup``'s processes ran while the other setup was measured."""
    return sum(v["run"] for name, v in cpu.items() if name.startswith(f"{setup}."))


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def _goal(ok: bool) -> str:
    return "met" if ok else "NOT met"
