"""bench/paper_model.py: its arithmetic on one case computed by hand, and its table's shape."""
import importlib.util
import json
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


def test_table(tmp_path):
    """Every kernel and goal shape has a row; no estimate beats its floor, and the redesign is
    never slower than today's kernels under the model's own assumptions."""
    out = tmp_path / "model.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], check=True, capture_output=True,
                         text=True)
    rows = json.loads(out.read_text())
    assert {r["op"] for r in rows} == {"markov_sample", "rejection_sample", "verify_attention"}
    assert len(rows) == 6 + 4 + 8 and res.stdout.count("\n") == len(rows) + 6
    for r in rows:
        assert r["floor_us"] <= r["after_us"] <= r["before_us"] + 1e-9, r
