"""bench/paper_model.py: its arithmetic on one case computed by hand, and its table's shape."""
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "paper_model.py"


@pytest.fixture(scope="module")
def pm():
    spec = importlib.util.spec_from_file_location("paper_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_markov_after_by_hand(pm):
    """markov(R 1, gamma 1, V 1280, r 32, d 1024), after, worked out by hand (microseconds):
    sweep: 89,600 bytes (2.08e-2), 10 items x 190 + 264 blocks x 250 = 67,900 instructions /
    (132 x 4 x 1.755e9) = 7.3275e-2, 81,920 FLOPs (1.4e-4): issue-bound, 0.073275;
    sweep tail 0.25 + 0.325 + 0.25 = 0.825; step kernel 1 + 0.25 + 0.65 + 0.5 = 2.4;
    a step 0.073275 + 0.825 + 2.4 + 2 x 0.3 = 3.898275;
    head projection 1 + 1 slab x 0.65 + 4,096 bytes (0.000953) + 1.5 = 3.150953;
    call = 3.150953 + 2.4 + 1.5 + 3.898275 = 10.949228."""
    got = pm.markov(1, 1, "after", V=1280, r=32, d=1024) * 1e6
    assert got == pytest.approx(10.949228, abs=2e-6)


def test_phase_picks_the_slowest_ceiling(pm):
    # 4.3 MB: 1 us of HBM; 1,853,280 instructions: 2 us of issue; 3e8 FLOPs: 0.5 us of mma;
    # 4.3 MB with 16 KB an SM in flight: 4.3e6 x 0.65e-6 / (16,384 x 132) = 1.2924 us
    assert pm.phase(4.3e6) == pytest.approx(1e-6)
    assert pm.phase(4.3e6, 1_853_280, 3e8) == pytest.approx(2e-6)
    assert pm.phase(4.3e6, 0, 0, 16384) == pytest.approx(4.3e6 * 0.65e-6 / (16384 * 132))


def test_attention_after_by_hand(pm):
    """attention(R 1, ctx 1016, after): Qwen3-8B heads, 8 queries, worked out by hand (us).
    Plan: 1,024 keys = 16 tiles, 8 units (one per KV head) of 32 rows; the planner's score
    max(HBM ceil(8 x 128 / 264) = 4, 2 x waves x longest) + 8 x waves + S is 40 unsplit, 26 at
    S 2, 23 at S 3, 20 at S 4, 6 and 8: chunk 5 (S 4, the largest chunk of the best) -> items of
    4 tiles, 32 items, 1 wave, 1 block an SM.
    tile time 264 x 64 x 128 x 4 B / 4.3e12 = 2.011803; stream = max(floor 4,325,376 B =
    1.005901, a block's rate 4 x 2.011803 / 4 = 2.011803, mma 4 x 64 x 8 clk / 1.755e9 =
    1.166952) = 2.011803; the wave: item 0.25 + block table 0.25 + first tile 0.65 + last tile's
    mma 0.291738 = 1.441738; + ramp 1 + last stores 0.25: 4.703541;
    merge: ticket 0.5 + lse 0.25 + first partials 0.25 + 4 splits x 32 x 128 x 4 B / (64 x
    1.755e9 B/s) = 0.583476: 1.583476; total 6.287017.
    The goal shape, ctx 4096: 65 tiles, S 9 (the header's), items of 8 tiles; stream = max(floor
    3.939780, 8 x 2.011803 / 4 = 4.023606, mma 2.333904) = 4.023606; + the wave 1.441738 + 1.25:
    6.715344; merge: 0.5 + 0.25 + 0.25 + the partials of 12 splits (3 batches of 4: the last
    rereads split 8 three times) 1.750427 = 2.750427; total 9.465771."""
    assert pm.attention_plan(1, 1016, "after") == (8, 32, 16, 4)
    assert pm.attention(1, 1016, "after") * 1e6 == pytest.approx(6.287017, abs=2e-6)
    assert pm.attention(1, 4096, "after") * 1e6 == pytest.approx(9.465771, abs=2e-6)


def test_attention_planner_copy_is_the_cpp_planner(pm):
    """_chunk_python against _C.attn_split_chunk (csrc/attn_split.h): the goal shapes, entries
    without units, longest units past 1,024 tiles (the non-exhaustive candidates), and random
    batches; the two planners' splits at batch 1 over 4k keys are the kernel header's."""
    from dspark_rt import ops
    if "cpp" not in ops.available_backends():
        pytest.skip("C++ extension not built")
    from dspark_rt import _C
    cases = [([8], [65], 264), ([8], [513], 264), ([8] * 8, [65] * 8, 264), ([8] * 8, [513] * 8, 264),
             ([8], [16], 264), ([8] * 5, [64] * 5, 264), ([8] * 40, [64] * 40, 264), ([1, 0, 4], [1500, 10 ** 5, 30], 264),
             ([2, 8], [3000, 40], 66), ([1], [5000], 396), ([0, 0], [5, 7], 264), ([40], [3000], 264),
             ([16, 20], [2500, 2600], 264)]
    rng = random.Random(29)
    for _ in range(25):
        n = rng.randint(1, 6)
        cases.append(([rng.choice([0, 1, 2, 8]) for _ in range(n)],
                      [rng.randint(0, rng.choice([20, 700, 4000])) for _ in range(n)], rng.choice([66, 264, 528])))
    for units, tiles, target in cases:
        assert pm._chunk_python(units, tiles, target) == _C.attn_split_chunk(units, tiles, target), (units, tiles)
    assert [pm.attention_plan(1, 4096, w)[3] for w in ("before", "after")] == [33, 9]


def test_table(tmp_path):
    """Every kernel and goal shape has a row; no estimate beats its floor, and the redesign is
    never slower than today's kernels under the model's own assumptions."""
    out = tmp_path / "model.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], check=True, capture_output=True,
                         text=True)
    rows = json.loads(out.read_text())
    assert {r["op"] for r in rows} == {"markov_sample", "rejection_sample", "verify_attention"}
    assert len(rows) == 6 + 4 + 8 and res.stdout.count("\n") == len(rows) + 9  # 3 header lines an op
    for r in rows:
        assert r["floor_us"] <= r["after_us"] <= r["before_us"] + 1e-9, r
