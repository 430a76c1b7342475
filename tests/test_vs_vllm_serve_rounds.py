"""``benchmarks/vs_vllm_serve.py --rounds``: the servers' order alternates between rounds,
and the verdict is the median of the rounds' own ratios, with their range."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import vs_vllm_serve


def _scenarios(ttft_ms: float, tpot_ms: float, tok_s: float) -> dict[str, Any]:
    one = {"mean_ttft_ms": ttft_ms, "median_ttft_ms": ttft_ms, "mean_tpot_ms": tpot_ms,
           "output_throughput": tok_s}  # fmt: skip
    return {"rate": dict(one), "saturation": dict(one), "serial": dict(one)}


def _round(vllm_tpot: float, kvstep_tpot: float) -> dict[str, Any]:
    vllm = _scenarios(100.0, vllm_tpot, 300.0)
    kvstep = _scenarios(50.0, kvstep_tpot, 450.0)
    return {"vllm": vllm, "kvstep": kvstep, "kvstep_vs_vllm": vs_vllm_serve.ratios(vllm, kvstep)}


def test_the_verdict_is_the_median_of_the_rounds_ratios() -> None:
    """Three rounds of TPOT 1.2x, 0.8x and 1.1x: median 1.1x, range 0.8-1.2x (not the ratio
    of the median TPOTs, which would pair runs from different rounds)."""
    rounds = [_round(12.0, 10.0), _round(8.0, 10.0), _round(16.5, 15.0)]
    summary = vs_vllm_serve.summarize(rounds)
    assert summary["rounds"] == rounds
    assert summary["kvstep_vs_vllm"]["tpot"] == pytest.approx(1.1)
    assert summary["kvstep_vs_vllm_range"]["tpot"] == pytest.approx([0.8, 1.2])
    assert summary["kvstep_vs_vllm"]["ttft"] == pytest.approx(2.0)
    assert summary["kvstep_vs_vllm"]["saturation_throughput"] == pytest.approx(1.5)


def test_rounds_that_measured_different_scenarios_are_refused() -> None:
    with_serial = _round(10.0, 10.0)
    without = _round(10.0, 10.0)
    for server in ("vllm", "kvstep"):
        del without[server]["serial"]
    without["kvstep_vs_vllm"] = vs_vllm_serve.ratios(without["vllm"], without["kvstep"])
    with pytest.raises(ValueError, match="different scenarios"):
        vs_vllm_serve.summarize([with_serial, without])
    with pytest.raises(ValueError, match="at least 1"):
        vs_vllm_serve.summarize([])


def test_the_servers_take_turns_going_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 1 starts vLLM first, round 2 kvstep, round 3 vLLM again: neither server always
    runs on the machine the other has just warmed (or slowed)."""
    started: list[str] = []

    def fake_server(server: str, *_: Any) -> dict[str, Any]:
        started.append(server)
        return _scenarios(100.0 if server == "vllm" else 50.0, 10.0, 300.0)

    monkeypatch.setattr(vs_vllm_serve, "run_server", fake_server)
    args = argparse.Namespace(rounds=3)
    run = vs_vllm_serve.run_dtype("python", Path("model"), "bfloat16", args)
    assert started == ["vllm", "kvstep", "kvstep", "vllm", "vllm", "kvstep"]
    assert [r["order"] for r in run["rounds"]] == [started[0:2], started[2:4], started[4:6]]
    assert run["dtype"] == "bfloat16" and run["kvstep_vs_vllm"]["ttft"] == pytest.approx(2.0)


def test_rounds_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        vs_vllm_serve.main(["--rounds", "0"])
    assert "--rounds 0: at least 1" in capsys.readouterr().err
