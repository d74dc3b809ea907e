"""The harness's clocks and the ops track: headline and eager clocks, the peers'
layouts (with stand-in kernels on the CPU), gates before timing, both orders."""

import sys
import types

import pytest
import torch
import yaml

from pipeline_util import REPO

from common import cases, measure, records  # noqa: E402
import kernels  # noqa: E402
import track_ops  # noqa: E402


def test_cpu_measure_reports_the_eager_clock_and_says_why_no_sm_clock():
    f = measure.measure(lambda: torch.ones(4).sum(), reps=5, warmup=1, device="cpu")
    assert f["clock"] == "eager:perf_counter" and f["device"] is None
    assert f["samples_ms"] == f["eager"]["samples_ms"] and len(f["samples_ms"]) == 5
    assert f["eager"]["p10_ms"] <= f["eager"]["median_ms"] <= f["eager"]["p95_ms"]
    assert f["sm_clock"] == {"reason": "no GPU"}
    assert measure.Clocks("cpu").lock() == {"locked": False, "mhz": None, "reason": "no GPU"}
    records.validate(records.new_record("ops", "cpu-smoke", "c-1", **f))


def test_sm_clock_span_flags_slowdowns_and_clock_drops():
    c = measure.Clocks("cpu")
    c.reason = None
    assert c.span({"sm_mhz": 1980, "reasons": 0}, {"sm_mhz": 1975, "reasons": 0})["throttled"] is False
    assert c.span({"sm_mhz": 1980, "reasons": 0}, {"sm_mhz": 1500, "reasons": 0})["throttled"] is True
    assert c.span({"sm_mhz": 1980, "reasons": 0}, {"sm_mhz": 1980, "reasons": 0x20})["throttled"] is True
    # a neighbour: the samples' compute-process counts and load averages (older samples lack them)
    s = c.span({"sm_mhz": 1980, "reasons": 0, "gpu_processes": 1, "load1": 0.5},
               {"sm_mhz": 1980, "reasons": 0, "gpu_processes": 2, "load1": 3.0})
    assert s["shared_gpu"] is True and s["gpu_processes_max"] == 2 and s["host_load1_max"] == 3.0 and s["host_cpus"] >= 1
    s = c.span({"sm_mhz": 1980, "reasons": 0, "gpu_processes": 1}, {"sm_mhz": 1980, "reasons": 0})
    assert s["shared_gpu"] is False and s["gpu_processes_max"] == 1
    assert c.span({"sm_mhz": 1980, "reasons": 0}, {"sm_mhz": 1980, "reasons": 0})["shared_gpu"] is False


@pytest.mark.parametrize("eager_ms, device_ms, headline", [
    (2.3, 0.5, "device"),      # host-heavy: eager over SHORT_MS, device time short
    (0.3, 0.1, "device"),
    (30.0, 20.0, "eager"),     # long on the device too: device time kept beside
    (80.0, None, "eager"),     # over DEVICE_CLOCK_MAX_MS: no device clock
])
def test_the_device_time_decides_the_headline(monkeypatch, eager_ms, device_ms, headline):
    def fake_eager(fn, reps, warmup, dev, **kw):
        st = measure.summarize([eager_ms] * reps)
        return {"samples_ms": [eager_ms] * reps, **st, "peak_bytes": 0, "base_bytes": 0, "clock": "cuda_event",
                "reps_requested": reps, "warmup": warmup, "stopped_early": False, "host_ms": [0.01] * reps}

    def fake_device(fn, reps, calls, dev, graph=True):
        assert device_ms is not None, "the device clock was tried for work over DEVICE_CLOCK_MAX_MS"
        return {"samples_ms": [device_ms] * reps, **measure.summarize([device_ms] * reps), "method": "cuda_graph",
                "calls_per_sample": calls, "graph_error": None}

    monkeypatch.setattr(measure, "time_fn", fake_eager)
    monkeypatch.setattr(measure, "device_time", fake_device)
    f = measure.measure(lambda: None, reps=4, warmup=1, device="cuda", count=False, warm_ms=0)
    assert f["eager"]["median_ms"] == eager_ms
    assert (f["device"] or {}).get("median_ms") == device_ms
    assert f["clock"] == ("device:cuda_graph" if headline == "device" else "eager:cuda_event")
    assert f["stats"]["median_ms"] == (device_ms if headline == "device" else eager_ms)


@pytest.mark.cuda
def test_short_work_gets_the_device_clock_by_graph_replay_or_back_to_back_launches():
    x = torch.randn(1 << 20, device="cuda")
    f = measure.measure(lambda: x.mul_(1.0), reps=20, warmup=3, device="cuda")
    assert f["clock"] == "device:cuda_graph" and f["device"]["calls_per_sample"] > 1
    assert f["device"]["calls_per_sample"] == measure.graph_calls(f["device"]["pilot_ms"])   # sized by the pilot
    assert f["device"]["median_ms"] < f["eager"]["median_ms"] and f["sm_clock"] is not None

    def synced():                                       # a host sync cannot be captured
        x.mul_(1.0)
        torch.cuda.synchronize()
    f = measure.measure(synced, reps=5, warmup=2, device="cuda")
    assert f["clock"] == "device:back_to_back" and f["device"]["graph_error"]
    assert torch.randn(4, device="cuda").isfinite().all()   # the failed capture left the generator usable


def _fake_fla(x, g, cu_seqlens=None):
    """h_t = exp(g_t) h_{t-1} + x_t restarted at every cu_seqlens bound (fla's contract)."""
    bounds = set(cu_seqlens.tolist())
    h, ys = torch.zeros_like(x[:, 0], dtype=torch.float32), []
    for t in range(x.shape[1]):
        h = x[:, t].float() + (0 if t in bounds else g[:, t].exp() * h)
        ys.append(h)
    return torch.stack(ys, 1).to(x.dtype), h


def _fake_accelerated(forget, inputs):
    """accelerated-scan's contract: [B, C, T] layout, h_t = f_t h_{t-1} + x_t."""
    h, ys = torch.zeros_like(inputs[..., 0]), []
    for t in range(inputs.shape[-1]):
        h = forget[..., t] * h + inputs[..., t]
        ys.append(h)
    return torch.stack(ys, -1)


def _fake_peers(monkeypatch):
    fla, ops, hgrn = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.hgrn"))
    hgrn.fused_recurrent_hgrn = _fake_fla
    fla.ops, ops.hgrn = ops, hgrn
    for mod in (fla, ops, hgrn):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(sys.modules, "accelerated_scan.scalar", types.SimpleNamespace(scan=_fake_accelerated))


@pytest.mark.parametrize("name", ["fla_fused_recurrent_hgrn", "accelerated_scan_triton"])
def test_peer_layouts_resets_and_gradients_match_the_reference(monkeypatch, name):
    _fake_peers(monkeypatch)
    a, b, pos = cases.op_inputs("scan", 4, 21, 6, torch.float64, "cpu", requires_grad=True, resets=True)[:3]
    assert bool((pos[:, 1:] == 0).any()) and not bool((pos[:, 0] == 0).all())   # mid-row resets, continuations
    with pytest.raises(measure.Skip, match="CPU"):
        cases.Peer(name, a, b, pos)
    peer = cases.Peer(name, a, b, pos, grad=True, allow_cpu=True)
    y_ref = kernels.scan(a, b, pos, backend="reference")[0]
    go = torch.randn_like(y_ref)
    ga_ref, gb_ref = torch.autograd.grad(y_ref, [a, b], go)
    peer.set_grad_out(go)
    assert cases.rel_err(peer.output(), y_ref) < 1e-6          # fla keeps its log-gates in FP32
    ga, gb = peer.grads()
    assert cases.rel_err(gb, gb_ref) < 1e-6
    assert cases.rel_err(ga, ga_ref.masked_fill((pos == 0)[..., None], 0)) < 1e-6


def _settings(**over):
    s = yaml.safe_load((REPO / "config.yaml").read_text())["profiles"]["cpu-smoke"]["ops"]
    s = {**s, "ops": ["scan", "rglru_layer"], "modes": ["fwd_bwd"], "T": 9,
         "decode": {**s["decode"], "ops": ["rglru"]}}
    return {**s, **over}


def test_ops_track_gates_then_times_every_variant_in_both_orders(tmp_path):
    recs = track_ops.track(_settings(), "cpu-smoke", tmp_path / "d", tmp_path / "ops.jsonl", 1e9)
    ids = {r["config_id"]: r for r in recs}
    assert all(r["status"] == "ok" for r in recs), [r["error"] for r in recs if r["status"] != "ok"]
    layer = [r for r in recs if r["op"] == "rglru_layer"]
    assert {(r["variant"], r["order"]) for r in layer} == {(v, o) for v in ("ours", "peer:recurrentgemma")
                                                           for o in ("AB", "BA")}
    step = [r for r in recs if r["op"] == "rglru_step"]
    assert {r["variant"] for r in step} == {"ours", "peer:recurrentgemma"}
    for r in recs:
        assert r["gate"]["passed"] and r["gate"]["max_rel_err"]["output"] < 1e-4
        assert r["floor_bytes"] > 0 and r["floor_ms"] == pytest.approx(r["floor_bytes"] / 1e9 * 1e3)
        assert r["eager"]["samples_ms"] and r["clock"].startswith("eager:")
    assert any(k.startswith("grad_") for k in layer[0]["gate"]["max_rel_err"])
    # the layer and the step have the preset's gate blocks (not its attention heads)
    from kernels.models import HawkConfig
    assert {r["shapes"]["blocks"] for r in layer + step} == {HawkConfig.preset("tiny").gate_blocks}
    assert "ops-scan-tiny-B2-D96-T9-fwd_bwd-ours-AB" in ids        # peers skipped on the CPU, ours timed
    # short calls: the host's time on an idle device beside the profile
    profiled = [r for r in recs if "host_profile" in r["eager"]]
    assert profiled and all(r["eager"]["host_drained_ms"] > 0 for r in profiled)
    assert records.read_jsonl(tmp_path / "ops.jsonl") == recs


def test_a_failed_gate_records_no_timing(tmp_path):
    s = _settings(ops=["scan"], decode=None, check_tolerance=1e-300)
    recs = track_ops.track(s, "cpu-smoke", tmp_path / "d", tmp_path / "o.jsonl", None)
    assert [r["order"] for r in recs] == ["AB", "BA"]
    for rec in recs:
        assert rec["status"] == "failed" and "inexact" in rec["error"]
        assert rec["samples_ms"] == [] and rec["stats"] is None and "eager" not in rec


def test_peers_are_gated_in_fp32_and_their_track_dtype_error_is_recorded(tmp_path):
    """The official layer's own BF16 arithmetic is not held to our kernels' tolerance:
    its gate checks the wiring in FP32, its BF16 error is recorded beside."""
    s = _settings(ops=["rglru_layer"], dtype="bfloat16", check_tolerance=3e-2)
    recs = track_ops.track(s, "cpu-smoke", tmp_path / "d", tmp_path / "o.jsonl", None)
    assert recs and all(r["status"] == "ok" for r in recs), [r["error"] for r in recs if r["status"] != "ok"]
    for r in recs:
        g = r["gate"]
        if r["peer"]:
            assert (g["dtype"], g["tolerance"], g["timed_dtype"]) == ("float32", track_ops.PEER_GATE_TOL, "bfloat16")
            assert max(g["max_rel_err"].values()) < 1e-4 < max(g["timed_dtype_rel_err"].values())
            assert set(g["max_rel_err"]) == set(g["timed_dtype_rel_err"])
            assert len(g["max_rel_err"]) > (2 if r["op"] == "rglru_layer" else 1)      # gradients gated too
        else:
            assert g["dtype"] == "bfloat16" and "timed_dtype_rel_err" not in g
    assert {r["op"] for r in recs if r["peer"]} == {"rglru_layer", "rglru_step"}
    import aggregate

    df = aggregate.flatten(recs)
    text, plots = aggregate.stage_tables(df), aggregate.stage_plots(df, tmp_path / "plots")
    assert "timed_dtype_err" in text and "float32 " in text and "bfloat16 " in text and plots == ["ops.png"]
    view = aggregate.ops_view(df[df["status"] == "ok"])
    rows = [line for line in view.splitlines() if line.startswith("| rglru_layer ")]
    assert any("| ours " in line and line.split("|")[-2].strip() == "1" for line in rows), view   # ours over ours
    assert any("| peer:recurrentgemma " in line for line in rows) and " / " in view   # the peer beside it, AB / BA
    assert "| 9 " in view and "9.0" not in view
    # the host's time inside the eager calls, per record and beside the eager median
    assert all(r["eager"]["host_median_ms"] > 0 and len(r["eager"]["host_samples_ms"]) == r["eager"]["n"] for r in recs)
    assert "host_ms" in view.splitlines()[2]


def test_a_miswired_peer_fails_its_fp32_gate(tmp_path, monkeypatch):
    _fake_peers(monkeypatch)
    real = cases.Peer.output
    monkeypatch.setattr(cases.Peer, "CPU_SKIP", {})
    monkeypatch.setattr(cases.Peer, "output", lambda self: real(self).roll(1, 1))   # off by one step
    s = _settings(ops=["scan"], modes=["fwd"], decode=None, dtype="bfloat16", check_tolerance=3e-2,
                  scan_peers=["accelerated_scan_triton"])
    recs = {r["variant"]: r for r in track_ops.track(s, "cpu-smoke", tmp_path / "d", tmp_path / "o.jsonl", None)}
    assert recs["ours"]["status"] == "ok"
    err = recs["peer:accelerated_scan_triton"]["error"]
    assert recs["peer:accelerated_scan_triton"]["status"] == "failed" and "tolerance 1.0e-04" in err
