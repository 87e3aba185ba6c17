"""Throughput profile: table lookup, cache key checks, foreign tables, measurement."""
import json
import logging

import numpy as np
import pytest

from dspark_rt import sps as sps_mod
from dspark_rt.sps import SPSProfile, check_profile, measure_profile, profile_key, read_sglang_table

GPU = {"name": "NVIDIA H200", "uuid": "GPU-1234", "driver": "560.35", "sm_clock_mhz": 1980,
       "throttle_reasons": []}


def jagged():
    return SPSProfile([1, 8, 16, 64], [100.0, 90.0, 95.0, 40.0], interp="step")


def test_lookup_step_and_linear():
    p = jagged()
    assert p.max_tokens == 64
    # step: the next measured point at or above B; the first value below the first point
    assert [p(b) for b in (1, 2, 8, 9, 16, 17, 64)] == [100, 90, 90, 95, 95, 40, 40]
    np.testing.assert_array_equal(p(np.array([1, 8, 9])), [100.0, 90.0, 95.0])
    lin = SPSProfile(p.tokens, p.rounds_per_s)  # linear is the default
    assert lin(12) == pytest.approx(92.5) and lin(8) == 90.0 and lin(40) == pytest.approx(67.5)
    for bad in (0, 65):
        with pytest.raises(ValueError):
            p(bad)
    assert p.dense().shape == (65,) and p.dense(16)[9] == 95.0
    with pytest.raises(ValueError):
        p.dense(65)


@pytest.mark.parametrize("tokens,values", [([], []), ([2, 2], [1.0, 1.0]), ([3, 1], [1.0, 1.0]),
                                           ([0, 1], [1.0, 1.0]), ([1], [0.0]), ([1], [float("nan")]),
                                           ([1, 2], [1.0])])
def test_rejects_bad_tables(tokens, values):
    with pytest.raises(ValueError):
        SPSProfile(tokens, values)


def test_save_load_round_trip(tmp_path):
    key = profile_key("Qwen3-8B", "bfloat16", max_batch=64, max_tokens=64, gpu=GPU)
    p = SPSProfile.from_pairs({64: 40.0, 1: 100.0, 16: 95.0, 8: 90.0}, key, interp="step")
    back = SPSProfile.load(p.save(tmp_path / "sps.json"))
    assert back == p and back.key["gpu_uuid"] == "GPU-1234" and back.key["sm_clock_mhz"] == 1980
    (tmp_path / "x.json").write_text(json.dumps({"1": 3.0}))
    with pytest.raises(ValueError):
        SPSProfile.load(tmp_path / "x.json")


def test_key_without_gpu_and_mismatch(caplog):
    key = profile_key("m", "float32", max_batch=8, max_tokens=64, gpu={})
    assert key["gpu_name"] is None and key["model"] == "m"
    cached = SPSProfile([1, 64], [10.0, 5.0],
                        profile_key("m", "bfloat16", max_batch=8, max_tokens=64, gpu=GPU))
    now = profile_key("m", "bfloat16", max_batch=8, max_tokens=64, gpu=GPU)
    ok = check_profile(cached, now, gpu=GPU)
    assert ok.profile is cached and not ok.reprofile and not ok.reasons
    for field, value in [("gpu_uuid", "GPU-9"), ("driver", "570.1"), ("model", "other"),
                         ("dtype", "float16"), ("max_batch", 16)]:
        with caplog.at_level(logging.WARNING, logger="dspark_rt.sps"):
            bad = check_profile(cached, {**now, field: value}, gpu=GPU)
        assert bad.profile is None and bad.reprofile and field in bad.reasons[0]
        assert field in caplog.text


def test_clock_change_rescales_or_reprofiles(caplog):
    key = profile_key("m", "bf16", max_batch=8, max_tokens=64, gpu=GPU)
    cached = SPSProfile([1, 64], [10.0, 5.0], key)
    slow = {**GPU, "sm_clock_mhz": 990}
    with caplog.at_level(logging.WARNING, logger="dspark_rt.sps"):
        res = check_profile(cached, key, gpu=slow)
    assert res.profile.rounds_per_s == [5.0, 2.5] and res.profile.key["sm_clock_mhz"] == 990
    assert not res.reprofile and "rescaled" in caplog.text
    assert cached.rounds_per_s == [10.0, 5.0]  # the cached table is left alone
    res = check_profile(cached, key, gpu=slow, rescale=False)
    assert res.profile is cached and res.reprofile
    # within tolerance: nothing happens
    assert not check_profile(cached, key, gpu={**GPU, "sm_clock_mhz": 1950}).reasons
    throttled = check_profile(cached, key, gpu={**GPU, "throttle_reasons": ["hw_thermal"]})
    assert throttled.profile is cached and throttled.reprofile and "hw_thermal" in throttled.reasons[0]


def test_gpu_state_without_gpu():
    # no GPU / no NVML here is the normal CPU case: None, never an exception
    state = sps_mod.gpu_state()
    assert state is None or "sm_clock_mhz" in state


@pytest.mark.parametrize("name,text,unit", [
    ("a.json", json.dumps({"1": 100.0, "8": 90.0, "64": 40.0}), "auto"),
    ("b.json", json.dumps([[1, 100.0], [8, 90.0], [64, 40.0]]), "auto"),
    ("c.json", json.dumps({"sps": {"1": 100.0, "8": 90.0, "64": 40.0}}), "auto"),
    ("d.json", json.dumps([{"batch_tokens": 1, "latency_s": 0.01}, {"batch_tokens": 8, "latency_s": 1 / 90},
                           {"batch_tokens": 64, "latency_s": 0.025}]), "auto"),
    ("e.csv", "batch_tokens,rounds_per_second\n1,100\n8,90\n64,40\n", "auto"),
    ("f.txt", "# measured\n1 0.01\n8\t0.011111111111111\n\n64 0.025\n", "auto"),
    ("g.csv", "tokens, latency_ms\n64, 25\n1, 10\n8, 11.111111111111\n", "auto"),
    ("h.txt", "1 10\n8 11.111111111111\n64 25\n", "ms"),
])
def test_reads_sglang_tables(tmp_path, name, text, unit):
    path = tmp_path / name
    path.write_text(text)
    p = read_sglang_table(path, unit=unit)
    assert p.tokens == [1, 8, 64]
    np.testing.assert_allclose(p.rounds_per_s, [100.0, 90.0, 40.0], rtol=1e-9)


def test_sglang_table_errors(tmp_path):
    (tmp_path / "e.txt").write_text("# nothing\n")
    with pytest.raises(ValueError):
        read_sglang_table(tmp_path / "e.txt")
    (tmp_path / "u.txt").write_text("1 2\n")
    with pytest.raises(ValueError):
        read_sglang_table(tmp_path / "u.txt", unit="furlongs")


def test_measure_profile_on_fake_step(monkeypatch):
    clock = {"t": 0.0}
    calls = []

    def step(B):  # a round costs 1 ms + 10 us per tile of 16 tokens, on a fake clock
        calls.append(B)
        clock["t"] += 1e-3 + 1e-5 * -(-B // 16)

    monkeypatch.setattr(sps_mod.time, "perf_counter", lambda: clock["t"])
    synced = []
    p = measure_profile(step, [64, 1, 16, 17], seconds_budget=0.04, progress=False,
                        sync=lambda: synced.append(1), key={"model": "fake"})
    assert p.tokens == [1, 16, 17, 64] and p.key == {"model": "fake"}
    np.testing.assert_allclose(p.rounds_per_s, [1 / 1.01e-3, 1 / 1.01e-3, 1 / 1.02e-3, 1 / 1.04e-3])
    assert calls[:2] == [1, 1] and len(synced) == len(calls)  # warm-up first, sync after each
    assert calls.count(64) >= 2 + 3
    p = measure_profile(lambda B: None, [1, 2], seconds_budget=0.0, progress=True)
    assert p.tokens == [1, 2]
