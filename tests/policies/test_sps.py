"""Throughput profile: table lookup, cache key checks, foreign tables, measurement."""
import bisect
import json
import logging

import numpy as np
import pytest

from dspark_rt.policies import sps as sps_mod
from dspark_rt.policies.sps import (SPSProfile, check_profile, measure_profile, profile_key,
                           read_sglang_sps_table, write_sglang_sps_table)

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
    # floor (SGLang's lookup): the last measured point at or below B, the first value below it
    fl = SPSProfile([2, 8, 16, 64], p.rounds_per_s, interp="floor")
    assert [fl(b) for b in (1, 2, 7, 8, 15, 16, 63, 64)] == [100, 100, 100, 90, 90, 95, 95, 40]
    with pytest.raises(ValueError, match="interp"):
        SPSProfile([1], [1.0], interp="nearest")
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
        with caplog.at_level(logging.WARNING, logger="dspark_rt.policies.sps"):
            bad = check_profile(cached, {**now, field: value}, gpu=GPU)
        assert bad.profile is None and bad.reprofile and field in bad.reasons[0]
        assert field in caplog.text


def test_clock_change_rescales_or_reprofiles(caplog):
    key = profile_key("m", "bf16", max_batch=8, max_tokens=64, gpu=GPU)
    cached = SPSProfile([1, 64], [10.0, 5.0], key)
    slow = {**GPU, "sm_clock_mhz": 990}
    with caplog.at_level(logging.WARNING, logger="dspark_rt.policies.sps"):
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


# SGLang's DSpark SPS cost table (sglang .../dspark_components/dspark_sps.py, SpsCostTable):
# probed verify-forward token counts, decode steps per second at each, the largest B served.
SGLANG_TABLE = {"sample_batch_tokens": [4, 12, 24, 48],
                "sample_steps_per_sec": [210.0, 205.5, 150.0, 98.25], "max_batch_tokens": 96}


def sglang_lookup(table, B):
    """SGLang's lookup: the last probe <= B, clamped to the first probe below it."""
    edges = table["sample_batch_tokens"]
    i = max(0, min(bisect.bisect_right(edges, B) - 1, len(edges) - 1))
    return table["sample_steps_per_sec"][i]


def _write_json(path, obj):
    path.write_text(json.dumps(obj))
    return path


@pytest.mark.parametrize("table", [
    SGLANG_TABLE,
    {**SGLANG_TABLE, "max_batch_tokens": 48},                    # max at the last probe
    {"sample_batch_tokens": [1], "sample_steps_per_sec": [3], "max_batch_tokens": 1},
    {**SGLANG_TABLE, "note": "profiled at bs 1..8"},             # unknown fields are ignored
])
def test_reads_sglang_sps_table(tmp_path, table):
    path = _write_json(tmp_path / "sps.json", table)
    p = read_sglang_sps_table(path, key={"model": "m"})
    assert p.interp == "floor" and p.key == {"model": "m"}
    assert p.max_tokens == table["max_batch_tokens"]
    assert [p(b) for b in range(1, p.max_tokens + 1)] == \
        [sglang_lookup(table, b) for b in range(1, p.max_tokens + 1)]
    assert SPSProfile.load(path) == SPSProfile(p.tokens, p.rounds_per_s, {}, "floor")


def test_sglang_sps_round_trip(tmp_path):
    src = _write_json(tmp_path / "sps.json", SGLANG_TABLE)
    out = write_sglang_sps_table(read_sglang_sps_table(src), tmp_path / "back.json")
    assert json.loads(out.read_text()) == SGLANG_TABLE
    # a profile of ours (linear, step) is written at every B, so SGLang reads our SPS(B) exactly
    for p in (jagged(), SPSProfile([2, 8, 16, 64], [100.0, 90.0, 95.0, 40.0])):
        d = json.loads(write_sglang_sps_table(p, tmp_path / "ours.json").read_text())
        assert d["max_batch_tokens"] == 64
        assert [sglang_lookup(d, b) for b in range(1, 65)] == [p(b) for b in range(1, 65)]
        back = SPSProfile.load(tmp_path / "ours.json")
        assert [back(b) for b in range(1, 65)] == [p(b) for b in range(1, 65)]


@pytest.mark.parametrize("change,field", [
    ({"sample_batch_tokens": None}, "sample_batch_tokens"),       # None: field removed
    ({"sample_steps_per_sec": None}, "sample_steps_per_sec"),
    ({"max_batch_tokens": None}, "max_batch_tokens"),
    ({"sample_batch_tokens": [4, 12, 12, 48]}, "sample_batch_tokens"),
    ({"sample_batch_tokens": [12, 4, 24, 48]}, "sample_batch_tokens"),
    ({"sample_batch_tokens": [0, 12, 24, 48]}, "sample_batch_tokens"),
    ({"sample_batch_tokens": [4.0, 12, 24, 48]}, "sample_batch_tokens"),
    ({"sample_batch_tokens": [4, 12, 24]}, "sample_steps_per_sec"),
    ({"sample_batch_tokens": []}, "sample_batch_tokens"),
    ({"sample_batch_tokens": "4,12"}, "sample_batch_tokens"),
    ({"sample_steps_per_sec": [210.0, 0.0, 150.0, 98.25]}, "sample_steps_per_sec"),
    ({"sample_steps_per_sec": [210.0, -1.0, 150.0, 98.25]}, "sample_steps_per_sec"),
    ({"sample_steps_per_sec": [210.0, "fast", 150.0, 98.25]}, "sample_steps_per_sec"),
    ({"max_batch_tokens": 40}, "max_batch_tokens"),
    ({"max_batch_tokens": 96.0}, "max_batch_tokens"),
    ({"max_batch_tokens": True}, "max_batch_tokens"),
])
def test_rejects_malformed_sglang_sps_table(tmp_path, change, field):
    table = {k: v for k, v in {**SGLANG_TABLE, **change}.items() if v is not None}
    path = _write_json(tmp_path / "bad.json", table)
    for read in (read_sglang_sps_table, SPSProfile.load):
        with pytest.raises(ValueError, match=field) as e:
            read(path)
        assert str(path) in str(e.value)


@pytest.mark.parametrize("change,field", [
    ({"max_batch_tokens": 10 ** 10}, "max_batch_tokens"),  # was: a 74.5 GiB allocation
    ({"max_batch_tokens": 2 ** 63}, "max_batch_tokens"),   # was: loads, every generate raises
    ({"sample_batch_tokens": [4, 12, 24, 2 ** 40]}, "sample_batch_tokens"),
    ({"sample_steps_per_sec": [210.0, 1e300, 150.0, 98.25]}, "sample_steps_per_sec"),
    ({"sample_steps_per_sec": [210.0, float("inf"), 150.0, 98.25]}, "sample_steps_per_sec"),
])
def test_sglang_table_numbers_are_bounded(tmp_path, change, field):
    """Every number is bounded where it is read (sps.MAX_TOKENS, sps.MAX_RATE): the error names
    the file and the field, and nothing of the table's size is allocated."""
    path = _write_json(tmp_path / "big.json", {**SGLANG_TABLE, **change})
    for read in (read_sglang_sps_table, SPSProfile.load):
        with pytest.raises(ValueError, match=field) as e:
            read(path)
        assert str(path) in str(e.value)


@pytest.mark.parametrize("table", [[[1, 100.0], [10 ** 10, 50.0]], [[1, 100.0], [2 ** 63, 50.0]],
                                   [[1, 100.0], [1e10, 50.0]], [[float("inf"), 1.0]],
                                   [[float("nan"), 1.0]], [[1, float("inf")]], [[1, 1e300]],
                                   [[1, "fast"]], [[1]], [1, 2], "1:100", [[True, 1.0]]])
def test_own_table_numbers_are_bounded(tmp_path, table):
    """Our format (and so a cached profile) is read the same way: field 'table' named."""
    path = _write_json(tmp_path / "ours.json", {"format": sps_mod.FORMAT, "version": 1, "key": {},
                                                "interp": "linear", "table": table})
    with pytest.raises(ValueError, match="'table'") as e:
        SPSProfile.load(path)
    assert str(path) in str(e.value)
    with pytest.raises(ValueError):
        SPSProfile([1, sps_mod.MAX_TOKENS + 1], [1.0, 1.0])


@pytest.mark.parametrize("field,value", [("interp", ["linear"]), ("interp", "cubic"), ("key", [1, 2]),
                                         ("key", 3)])
def test_own_table_fields_are_checked(tmp_path, field, value):
    d = {"format": sps_mod.FORMAT, "version": 1, "key": {}, "interp": "linear",
         "table": [[1, 100.0], [8, 90.0]], field: value}
    path = _write_json(tmp_path / "ours.json", d)
    with pytest.raises(ValueError, match=f"'{field}'") as e:
        SPSProfile.load(path)
    assert str(path) in str(e.value)


def test_sglang_additive_table_is_refused(tmp_path):
    path = _write_json(tmp_path / "add.json", {
        "bias_seconds": 0.004, "bs_probes": [1, 8], "alpha_seconds": [0.0, 0.001],
        "m_probes": [1, 64], "theta_seconds": [0.0, 0.002]})
    for read in (read_sglang_sps_table, SPSProfile.load):
        with pytest.raises(ValueError, match="additive cost table.*bias_seconds") as e:
            read(path)
        assert str(path) in str(e.value) and "sample_batch_tokens" in str(e.value)


@pytest.mark.parametrize("name,text", [
    ("a.json", json.dumps({"1": 100.0, "8": 90.0})),            # the formats once guessed
    ("b.json", json.dumps([[1, 100.0], [8, 90.0]])),
    ("c.json", json.dumps({"sps": {"1": 100.0, "8": 90.0}})),
    ("d.csv", "batch_tokens,rounds_per_second\n1,100\n8,90\n"),
])
def test_unsupported_tables_name_the_supported_formats(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match="supported") as e:
        SPSProfile.load(path)
    assert str(path) in str(e.value) and "sample_steps_per_sec" in str(e.value)


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
    assert sorted(calls[:8]) == sorted([64, 1, 16, 17] * 2) and len(synced) == len(calls)
    passes = [sorted(calls[i : i + 4]) for i in range(0, len(calls) - len(calls) % 4, 4)]
    assert all(p == [1, 16, 17, 64] for p in passes)  # interleaved: every pass times every B
    assert calls.count(64) >= 2 + 3
    p = measure_profile(lambda B: None, [1, 2], seconds_budget=0.0, progress=True)
    assert p.tokens == [1, 2]


def test_monotone_fit_irons_out_dips():
    from dspark_rt.policies.sps import SPSProfile
    p = SPSProfile([1, 2, 4, 8, 16], [100.0, 50.0, 80.0, 40.0, 45.0]).monotone()
    seconds = [1 / v for v in p.rounds_per_s]
    assert all(a <= b + 1e-15 for a, b in zip(seconds, seconds[1:]))
    assert p.rounds_per_s[0] == 100.0 and p.tokens == [1, 2, 4, 8, 16]
    # pooled where the measurement dipped: 2 and 4 share their mean seconds
    assert abs(seconds[1] - (1 / 50 + 1 / 80) / 2) < 1e-15 and seconds[1] == seconds[2]
    already = SPSProfile([1, 2, 3], [9.0, 8.0, 7.0])
    assert already.monotone().rounds_per_s == already.rounds_per_s
