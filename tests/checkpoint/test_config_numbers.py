"""Numbers in checkpoint configs (dspark_rt/checkpoint/): a non-finite float (JSON NaN, Infinity)
in any field of a target or drafter config.json is refused at load with a CheckpointError that
names the file and the field; so are huge and wrong-typed values (tests/checkpoint/test_fuzz_loaders.py)."""
import json
import math
import shutil
from pathlib import Path

import pytest

import dspark_rt
from dspark_rt import Decoder
from dspark_rt.checkpoint import CheckpointError
from dspark_rt.checkpoint.config import TargetConfig
from dspark_rt.checkpoint.drafter_config import DrafterConfig

from tests.support import packagings as pk

PRETRAINED = Path(dspark_rt.__file__).parent / "pretrained"
BAD = [math.nan, math.inf, -math.inf]


def _config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _refused(load, d, field):
    with pytest.raises(CheckpointError) as e:
        load(d)
    assert "cfg.json" in str(e.value) and f"'{field}'" in str(e.value), str(e.value)


@pytest.mark.parametrize("value", BAD, ids=str)
@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps"])
def test_target_config_refuses_nonfinite(tiny_target, field, value):
    d = {**_config(tiny_target), field: value}
    _refused(lambda d: TargetConfig.from_dict(d, "cfg.json"), d, field)


@pytest.mark.parametrize("value", BAD, ids=str)
@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps", "input_embedding_scale",
                                   "output_multiplier"])
def test_drafter_config_refuses_nonfinite(tiny_drafters, field, value):
    d = {**_config(tiny_drafters("vanilla", 4)), field: value}
    _refused(lambda d: DrafterConfig.from_dict(d, "cfg.json"), d, field)


@pytest.mark.parametrize("value", BAD, ids=str)
def test_drafter_config_refuses_nonfinite_sts_temperature(tiny_drafters, value):
    d = {**_config(tiny_drafters("vanilla", 4)), "sts_temperatures": [1.0, value, 1.0, 1.0]}
    _refused(lambda d: DrafterConfig.from_dict(d, "cfg.json"), d, "sts_temperatures")


@pytest.mark.parametrize("value", BAD, ids=str)
@pytest.mark.parametrize("field", ["output_multiplier", "final_logit_softcapping", "rope_theta"])
def test_dflash2_config_refuses_nonfinite(tmp_path, tiny_target, field, value):
    d = _config(pk.dflash2(tmp_path / "d2", tiny_target))
    d.update({field: value}) if field in d or field == "rope_theta" else d["dflash_config"].update({field: value})
    _refused(lambda d: DrafterConfig.from_dict(d, "cfg.json", allow_dflash2=True), d, field)


@pytest.mark.parametrize("value", BAD, ids=str)
def test_rope_scaling_factor_refuses_nonfinite(tiny_target, value):
    d = {**_config(tiny_target), "rope_scaling": {"rope_type": "linear", "factor": value}}
    _refused(lambda d: TargetConfig.from_dict(d, "cfg.json"), d, "factor")


@pytest.mark.skipif(not (PRETRAINED / "dspark").is_dir(), reason="no shipped pair")
@pytest.mark.parametrize("which", ["target", "dspark"])
def test_shipped_pair_with_nan_rope_theta_is_refused(tmp_path, which):
    """The issue's report: rope_theta NaN in the shipped drafter's (or target's) config.json
    loaded without a word; now the load names the file and the field."""
    for name in ("target", "dspark"):
        shutil.copytree(PRETRAINED / name, tmp_path / name)
    cfg = tmp_path / which / "config.json"
    d = json.loads(cfg.read_text())
    d["rope_theta"] = math.nan
    cfg.write_text(json.dumps(d))  # writes NaN, as Python's json reads it
    with pytest.raises(CheckpointError) as e:
        Decoder.from_pretrained(tmp_path / "target", tmp_path / "dspark", mode="dspark")
    assert str(cfg) in str(e.value) and "'rope_theta'" in str(e.value), str(e.value)
