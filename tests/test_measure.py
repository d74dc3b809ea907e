"""The measuring method shared by the tune and track stages: statistics, run
orders, selection, counted calls, failure capture and the resumable runner."""

import json
import os
import statistics
import time

import pytest
import torch

from pipeline_util import SCRIPTS  # noqa: F401  (puts workflow/scripts on sys.path)

from common import cases, measure, records  # noqa: E402
from kernels.ops import accounting  # noqa: E402


def test_percentiles_and_summary_on_known_samples():
    s = [float(v) for v in range(1, 11)]                 # 1 .. 10
    assert measure.percentile(s, 10) == pytest.approx(1.9)
    assert measure.percentile(s, 95) == pytest.approx(9.55)
    assert measure.percentile(list(reversed(s)), 50) == pytest.approx(5.5)
    st = measure.summarize([3.0, 1.0, 2.0])
    assert (st["n"], st["p10_ms"], st["median_ms"], st["min_ms"]) == (3, pytest.approx(1.2), 2.0, 1.0)
    assert measure.summarize([4.0])["p95_ms"] == 4.0
    with pytest.raises(ValueError, match="at least one sample"):
        measure.percentile([], 50)


def test_time_fn_counts_and_keeps_raw_samples():
    calls = []
    out = measure.time_fn(lambda: calls.append(1), reps=7, warmup=2, device="cpu")
    assert len(calls) == 9 and len(out["samples_ms"]) == 7 and out["n"] == 7
    assert out["clock"] == "perf_counter" and out["stopped_early"] is False
    assert out["p10_ms"] <= out["median_ms"] <= out["p95_ms"]
    with pytest.raises(ValueError, match="reps"):
        measure.time_fn(lambda: None, reps=0, device="cpu")


def test_time_fn_budget_stops_after_min_reps():
    out = measure.time_fn(lambda: time.sleep(0.02), reps=50, warmup=0, device="cpu", budget_s=0.05, min_reps=3)
    assert out["stopped_early"] is True
    assert 3 <= out["n"] < 50 and out["reps_requested"] == 50


def test_eager_clock_keeps_the_host_time_inside_each_call():
    """`host_ms`: the host's time inside each eager call, one per sample; measure() records
    the samples and their median beside the eager clock."""
    out = measure.time_fn(lambda: time.sleep(0.003), reps=4, warmup=0, device="cpu")
    assert len(out["host_ms"]) == out["n"] == 4 and all(2.5 < h < 50 for h in out["host_ms"])
    t = measure.measure(lambda: time.sleep(0.002), reps=3, warmup=1, device="cpu", count=False)
    assert len(t["eager"]["host_samples_ms"]) == 3
    assert t["eager"]["host_median_ms"] == statistics.median(t["eager"]["host_samples_ms"]) > 1.5


def test_the_device_clock_graph_size_does_not_depend_on_the_host():
    """Calls per replayed graph: a power of two from the pilot's device ms per call, so that
    calls of 4.6 and 5.2 us (one kernel on two hosts) replay the same graph."""
    assert measure.graph_calls(0.0046) == measure.graph_calls(0.0052) == 256
    assert measure.graph_calls(0.012) == 128 and measure.graph_calls(0.3) == 4
    assert measure.graph_calls(measure.DEVICE_WINDOW_MS) == measure.graph_calls(5 * measure.DEVICE_WINDOW_MS) == 1
    assert measure.graph_calls(1e-6) == measure.graph_calls(0.0) == measure.MAX_GRAPH_CALLS == 256


def test_time_trajectory_reads_every_checkpoint_from_one_run():
    seen = []
    out = measure.time_trajectory(lambda i: seen.append(i), [5, 2, 5], device="cpu", before=lambda: seen.append("p"))
    assert seen == ["p", 0, 1, 2, 3, 4]                   # prompt first, then one run of 5 steps
    assert out["checkpoints"] == [2, 5]
    c = out["cumulative_ms"]
    assert len(c) == 2 and 0 <= c[0] <= c[1]
    assert sum(out["interval_ms"]) == pytest.approx(c[1])
    with pytest.raises(ValueError, match="checkpoints"):
        measure.time_trajectory(lambda i: None, [0], device="cpu")


def test_time_trajectory_warmup_runs_untimed_steps_from_a_fresh_prefill():
    seen = []

    def slow_first(i):
        seen.append(i)
        if len(seen) == 1:           # one-time work (compile / graph capture) on the very first step
            time.sleep(0.2)

    out = measure.time_trajectory(slow_first, [3], device="cpu", before=lambda: seen.append("p"), warmup=2)
    # prefill, two untimed steps, prefill again, then the timed trajectory of 3 steps
    assert seen == ["p", 0, 1, "p", 0, 1, 2]
    assert out["warmup_steps"] == 2
    assert out["cumulative_ms"][-1] < 150          # the one-time 200 ms stayed in the warm-up
    with pytest.raises(ValueError, match="warmup"):
        measure.time_trajectory(lambda i: None, [1], device="cpu", warmup=-1)


def test_orders_run_each_comparison_both_ways():
    ab, ba = ["samu", "rglru"], ["rglru", "samu"]
    assert measure.orders(ab) == [("AB", ab, "samu"), ("AB", ab, "rglru"), ("BA", ba, "rglru"), ("BA", ba, "samu")]
    assert measure.orders(["a", "b", "c"])[3] == ("BA", ["c", "b", "a"], "c")
    assert measure.orders(["a"]) == [("AB", ["a"], "a")]
    assert measure.orders(ab, keep=["AB"]) == measure.orders(ab)[:2]


def test_measure_counts_one_call_then_times_fresh_calls():
    calls = []

    def fn():
        calls.append(1)
        accounting.record("k", 100, 40)

    m = measure.measure(fn, reps=4, warmup=3, device="cpu", warm_ms=0)
    # warm-up: 2 plain calls + the counted call (its last), then 4 timed calls
    assert len(calls) == 3 + 4
    lg = m["logical"]
    assert (lg["bytes_read"], lg["bytes_written"], lg["launches"]) == (100, 40, 1)
    assert lg["launches_method"] == "launcher accounting" and "logical" in lg["basis"]
    assert m["stats"]["n"] == 4
    rec = records.new_record("scan", "cpu-smoke", "t-1", **m)
    records.validate(json.loads(json.dumps(rec)))


def test_count_kernels_reads_profiler_events():
    class E:
        def __init__(self, name, dev, us):
            self.name, self.device_type = name, dev
            self.time_range = type("R", (), {"elapsed_us": lambda _: us})()

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = [E("k1", cuda, 3.0), E("k1", cuda, 5.0), E("Memcpy DtoD", cuda, 2.0), E("Memset (Device)", cuda, 1.0),
          E("aten::add", cpu, 50.0)]
    got = measure.count_kernels(ev)
    assert (got["kernels"], got["memcpy"], got["memset"], got["by_name"]) == (2, 1, 1, {"k1": 2})
    assert got["us_by_name"] == {"k1": 8.0} and got["device_us"] == 11.0


@pytest.mark.parametrize("exc,status,sticky", [
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom", False),
    (RuntimeError("CUDA error: out of memory"), "oom", False),
    (RuntimeError("triton launch failed: bad block size"), "failed", False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "failed", True),
    (ValueError("expected block_d a power of two, got 48"), "failed", False),
])
def test_capture_turns_failures_into_outcomes(exc, status, sticky):
    def boom():
        raise exc

    out = measure.capture(boom, "cpu")
    assert out.status == status and not out.ok
    assert out.error["type"] == type(exc).__name__ and out.error["sticky"] is sticky
    assert str(exc)[:20] in out.error["message"]
    assert measure.capture(lambda: 3, "cpu").value == 3


def test_capture_lets_skip_and_interrupts_through():
    def skip():
        raise measure.Skip("peer not installed")

    with pytest.raises(measure.Skip):
        measure.capture(skip, "cpu")


def _runner(tmp_path, **kw):
    return measure.Runner("scan", "cpu-smoke", tmp_path / "records.d", device="cpu", **kw)


def _ok_fields():
    return measure.measure(lambda: None, reps=3, warmup=1, device="cpu")


def test_runner_records_resumes_and_redoes_truncated(tmp_path):
    r = _runner(tmp_path)
    r.run("a-1", _ok_fields, shapes={"B": 1}, mixer="rglru", backend="serial", order="AB")

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    rec = r.run("a-2", oom, shapes={"B": 9}, mixer="samu", backend="chunk", order="AB")
    assert rec["status"] == "oom" and "out of memory" in rec["error"] and rec["samples_ms"] == []
    out = r.finish(tmp_path / "records.jsonl")
    assert [x["config_id"] for x in out] == ["a-1", "a-2"]
    assert len(records.read_jsonl(tmp_path / "records.jsonl")) == 2

    (tmp_path / "records.d" / "a-1.json").write_text('{"schema": 1, "config')     # torn write
    calls = []

    def again():
        calls.append(1)
        return _ok_fields()

    r2 = _runner(tmp_path)
    r2.run("a-1", again, shapes={"B": 1}, mixer="rglru", backend="serial", order="AB")
    r2.run("a-2", again, shapes={"B": 9}, mixer="samu", backend="chunk", order="AB")
    assert calls == [1]                                  # only the truncated one is measured again
    assert r2.get("a-2")["status"] == "oom"
    with pytest.raises(ValueError, match="planned twice"):
        r2.run("a-1", again)


def test_runner_budget_and_skip_leave_no_record(tmp_path):
    r = _runner(tmp_path, budget_s=1e-9)
    time.sleep(0.01)
    assert r.run("late", _ok_fields) is None and r.skipped == ["late"]

    def skip():
        raise measure.Skip("fla not installed")

    r2 = _runner(tmp_path)
    assert r2.run("peer", skip) is None
    assert not (tmp_path / "records.d" / "peer.json").exists()
    assert r2.finish(tmp_path / "out.jsonl") == []


def test_runner_restarts_after_a_poisoning_failure(tmp_path):
    restarts = []
    r = _runner(tmp_path, restart=lambda: restarts.append(1))

    def poisoned():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    rec = r.run("bad", poisoned, backend="chunk")
    assert rec["status"] == "failed" and restarts == [1]
    assert (tmp_path / "records.d" / "bad.json").exists()        # recorded before the restart
    r.run("plain", lambda: (_ for _ in ()).throw(RuntimeError("bad shape")), backend="serial")
    assert restarts == [1]


def test_run_group_records_all_or_none(tmp_path):
    r = _runner(tmp_path)
    ids = ["t-N4", "t-N8"]
    fields = {c: {"order": "AB"} for c in ids}
    got = r.run_group(ids, lambda: {c: {**_ok_fields(), "generated_tokens": int(c[3:])} for c in ids}, fields)
    assert [got[c]["generated_tokens"] for c in ids] == [4, 8]

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    ids2 = ["u-N4", "u-N8"]
    got2 = r.run_group(ids2, oom, {c: {} for c in ids2})
    assert {got2[c]["status"] for c in ids2} == {"oom"}
    calls = []
    r2 = _runner(tmp_path)
    r2.run_group(ids, lambda: calls.append(1), fields)
    assert calls == []


def test_gates_decide_which_backends_are_exact():
    gates = {"passed": True, "checks": [
        {"check": "backend/rglru/output", "op": "rglru", "backend": "serial", "passed": True},
        {"check": "backend/rglru/output", "op": "rglru", "backend": "chunk", "chunk_size": 8, "passed": True},
        {"check": "backend/rglru/grad", "op": "rglru", "backend": "chunk", "chunk_size": 16, "passed": False},
        {"check": "backend/samu/output", "op": "samu", "backend": "serial", "passed": True},
        {"check": "griffin_official/logits", "passed": True},
    ]}
    assert cases.gated_backends(gates) == {"rglru": {"serial"}, "samu": {"serial"}}
    names = ["reference", "serial", "chunk", "assoc_bf16"]
    assert cases.exact_backend_names("rglru", names, gates) == ["serial"]
    assert cases.exact_backend_names("rglru", names, {"checks": []}, ["*bf16*"]) == ["reference", "serial", "chunk"]
    assert cases.gated_backends({"checks": [{"check": "x", "passed": True}]}) is None


def test_probe_figures_are_found_wherever_the_probe_puts_them():
    env = {"gpu": None, "measured": {"copy_bandwidth_bytes_per_s": 4.2e12, "matmul_bf16_flop_per_s": 7.4e14},
           "counters": {"counters_available": False, "reason": "ERR_NVGPUCTRPERM: restricted"}}
    assert measure.copy_bandwidth(env) == 4.2e12 and measure.matmul_rate(env) == 7.4e14
    assert measure.counters_available(env) == (False, "ERR_NVGPUCTRPERM: restricted")
    assert measure.copy_bandwidth({}) is None


NCU_CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","lts__t_bytes.sum","sm__warps_active.avg.pct_of_peak_sustained_active"
"","","","","","byte","byte","byte","%"
"0","1","python","h","void at::native::spin_kernel(long)","0","0","0","1"
"1","1","python","h","scan_fwd_kernel","1,000","500","2000","50"
"2","1","python","h","scan_fwd_kernel","1,000","500","2000","70"
"3","1","python","h","void at::native::spin_kernel(long)","0","0","0","1"
"4","1","python","h","chunk_kernel","10","n/a","20","30"
"5","1","python","h","void at::native::spin_kernel(long)","0","0","0","1"
'''


def test_ncu_csv_is_split_per_configuration():
    groups = measure.ncu_groups(NCU_CSV)
    assert [g["kernels"] for g in groups] == [2, 1, 0]
    a, b = groups[:2]
    assert (a["dram_bytes_read"], a["dram_bytes_written"], a["l2_bytes"]) == (2000.0, 1000.0, 4000.0)
    assert a["achieved_occupancy_pct_mean"] == pytest.approx(60.0) and a["source"] == "ncu"
    assert b["dram_bytes_written"] is None and b["kernels"] == 1


def test_tensor_bytes_walks_caches():
    class Cache:
        def __init__(self):
            self.layers = [(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.complex64))]

    assert measure.tensor_bytes(Cache()) == 2 * 3 * 4 + 2 * 4 * 8


def test_ncu_pass_keeps_the_calls_between_marker_pairs(tmp_path):
    csv_text = "\n".join([
        '"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","lts__t_bytes.sum",'
        '"sm__warps_active.avg.pct_of_peak_sustained_active"',
        '"0","setup_kernel","7","7","7","7"',
        '"1","void at::native::spin_kernel(long)","0","0","0","0"',
        '"2","call_a","100","50","300","40"',
        '"3","void at::native::spin_kernel(long)","0","0","0","0"',
        '"4","setup_kernel","9","9","9","9"',
        '"5","void at::native::spin_kernel(long)","0","0","0","0"',
        '"6","call_b","1","2","3","4"',
        '"7","void at::native::spin_kernel(long)","0","0","0","0"',
    ])
    fake = tmp_path / "ncu"
    fake.write_text(f"#!/bin/sh\ncat <<'CSV'\n{csv_text}\nCSV\n")
    fake.chmod(0o755)
    got = measure.ncu_counters(["python", "worker.py"], 2, ncu=str(fake))
    assert [g["dram_bytes_read"] for g in got] == [100.0, 1.0] and [g["kernels"] for g in got] == [1, 1]
    assert measure.ncu_counters(["python", "worker.py"], 3, ncu=str(fake)) is None
    assert measure.ncu_counters(["x"], 1, ncu=str(tmp_path / "missing")) is None


def test_runner_leaves_the_clocks_alone_unless_the_profile_asks(tmp_path, monkeypatch):
    tried = []
    monkeypatch.setattr(measure.Clocks, "lock", lambda self: tried.append(1) or {"locked": True})
    runner = measure.Runner("t", "cpu-smoke", tmp_path, None, "cpu")
    assert tried == [] and runner.clock_lock["locked"] is False
    assert "lock_clocks" in runner.clock_lock["reason"]
    assert measure.Runner("t", "cpu-smoke", tmp_path, None, "cpu", lock_clocks=True).clock_lock == {"locked": True}
    assert tried == [1]


def test_a_short_call_runs_back_to_back_before_the_eager_clock():
    """Calls under `warm_ms` run for that long before the eager clock (the host path of a
    short call reaches its steady speed only after tens of milliseconds); a call over it
    does not run again, and warm_ms=0 (FSDP's ranks) keeps the call count fixed."""
    n = [0]

    def call(sleep):
        def f():
            n[0] += 1
            time.sleep(sleep)
        return f
    t = measure.measure(call(0.001), reps=3, warmup=1, device="cpu", count=False, warm_ms=40.0)
    assert 40.0 <= t["eager"]["warm_ms"] < 200 and n[0] >= 1 + 20 + 3
    for warm_ms, sleep in ((0.0, 0.001), (5.0, 0.01)):
        n[0] = 0
        t = measure.measure(call(sleep), reps=3, warmup=2, device="cpu", count=False, warm_ms=warm_ms)
        assert n[0] == 2 + 3 and t["eager"]["warm_ms"] == 0.0


def test_the_probe_records_the_host_cost_of_the_smallest_launches_on_a_gpu_only():
    import aggregate
    import probe
    assert probe.host_launch("cpu", 5) is None
    env = {"measured": {"device": "cuda", "copy_bandwidth_bytes_per_s": 4e12, "matmul_bf16_flop_per_s": 8e14,
                        "host_launch": {"calls": {"triton_launcher": {"host_median_us": 7.25},
                                                  "torch_add": {"host_median_us": 4.0}}, "teardown_cupti": "1"}}}
    text = aggregate.probe_section(env)
    assert "triton_launcher 7.2 us, torch_add 4.0 us (TEARDOWN_CUPTI=1;" in text
    assert "smallest launches" not in aggregate.probe_section({"measured": {"host_launch": None}})


def test_a_short_call_is_profiled_on_the_host_after_its_clocks():
    def helper():
        return sum(range(200))

    def call():
        helper()
        helper()

    t = measure.measure(call, reps=3, warmup=1, device="cpu", count=False, warm_ms=0, profile_calls=10)
    rows = {r["function"].split("(")[-1].rstrip(")"): r for r in t["eager"]["host_profile"]}
    assert rows["helper"]["calls"] == 2 and rows["helper"]["own_us"] > 0
    assert rows["helper"]["cum_us"] >= rows["helper"]["own_us"]
    assert "host_profile" not in measure.measure(call, reps=3, warmup=1, device="cpu", count=False, warm_ms=0)["eager"]
    # beside the profile, the host time of calls started on an idle device (at most HOST_WAIT_CALLS)
    assert t["eager"]["host_drained_calls"] == 10 and 0 < t["eager"]["host_drained_ms"] < 50
    assert "allocator_per_call" not in t["eager"] and "syncs" not in t["eager"]      # CUDA only
    slow = measure.measure(lambda: time.sleep(measure.SHORT_MS / 1e3 * 1.5), reps=2, warmup=1, device="cpu",
                           count=False, warm_ms=0, profile_calls=10)
    assert "host_profile" not in slow["eager"]      # a long call's eager clock is its headline

    import aggregate
    rec = {"stage": "ops", "order": "AB", "status": "ok", "op": "scan", "mode": "fwd", "variant": "ours",
           "shapes": {"B": 4, "T": 2048, "D": 2560}, "device": {"median_ms": 0.05},
           "eager": {"host_median_ms": 0.09, "host_profile": t["eager"]["host_profile"], "host_drained_ms": 0.0375,
                     "allocator_per_call": {"num_device_alloc": 0.5}, "syncs": {"count": 3, "first": []}}}
    text = aggregate.host_section([rec, {**rec, "order": "BA"}])
    assert text.count("| scan ") == 1 and "B4 T2048 D2560" in text and "(helper)" in text
    row = [c.strip() for c in next(line for line in text.splitlines() if line.startswith("| scan ")).split("|")]
    assert row[5:8] == ["0.09", "0.0375", "0.5"] and row[8] == "3"
    assert aggregate.host_section([{**rec, "eager": {}}]) == ""


@pytest.mark.cuda
def test_the_probe_times_the_smallest_launches_on_the_gpu():
    import probe
    out = probe.host_launch("cuda", 5)
    assert set(out["calls"]) == {"triton_launcher", "triton_jit", "torch_add", "triton_launcher_after_profiler"}
    for name, h in out["calls"].items():
        assert len(h["host_samples_ms"]) == 5 and 0 < h["host_median_us"] < 1e4, name
    assert out["teardown_cupti"] == os.environ.get("TEARDOWN_CUPTI")


@pytest.mark.cuda
def test_host_profiles_name_a_kernel_launch_on_the_gpu():
    x = torch.zeros(1 << 10, device="cuda")
    t = measure.measure(lambda: x.add_(1), reps=3, warmup=1, device="cuda", count=False, warm_ms=0,
                        profile_calls=5)
    assert t["eager"]["host_profile"] and all(r["calls"] > 0 for r in t["eager"]["host_profile"])


def test_host_waits_time_calls_started_on_an_idle_device():
    t = measure.host_waits(lambda: time.sleep(0.002), 5, device="cpu")
    assert t["host_drained_calls"] == 5 and 2.0 <= t["host_drained_ms"] < 50
    assert set(t) == {"host_drained_ms", "host_drained_calls"}


@pytest.mark.cuda
def test_host_waits_name_the_synchronisations_and_allocations_of_a_call():
    # quiet first: torch's first sync debug session also warns that the mode is a prototype, which is no sync
    x = torch.zeros(1 << 10, device="cuda")
    quiet = measure.host_waits(lambda: x.add_(1), 5, device="cuda")
    assert quiet["syncs"]["count"] == 0 and quiet["allocator_per_call"]["num_device_alloc"] == 0
    loud = measure.host_waits(lambda: x.sum().item(), 5, device="cuda")
    assert loud["syncs"]["count"] >= 1 and loud["syncs"]["first"]
    torch.cuda.empty_cache()
    fresh = measure.host_waits(lambda: torch.cuda.empty_cache() or torch.empty(1 << 26, device="cuda"), 3,
                               device="cuda")
    assert fresh["allocator_per_call"]["num_device_alloc"] >= 1
