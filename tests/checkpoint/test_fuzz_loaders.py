"""Bounded fuzz of the file loaders: a valid config.json (target; drafter in DeepSpec, z-lab and
speculators packagings), SPS table (ours, SGLang's) or calibration (ours, SGLang's) with one
field, or one field inside a nested object, replaced by hostile JSON. Loading succeeds or raises
the loader's documented error naming the file: CheckpointError for configs, ValueError for SPS
tables and calibrations; never another exception type, never a huge allocation."""
import copy
import json
from importlib.resources import files

import pytest
from hypothesis import given, strategies as st

from dspark_rt.checkpoint import CheckpointError, DrafterConfig, TargetConfig
from dspark_rt.policies.sps import SPSProfile, read_sglang_sps_table
from dspark_rt.policies.sts import STSResult, read_sglang_sts, read_temperatures
from tests.support.fuzz_support import FUZZ, NASTY, VALUE

PRETRAINED = files("dspark_rt") / "pretrained"


def _json(name):
    return json.loads((PRETRAINED / name / "config.json").read_text())


def _drafters():
    deepspec = _json("dspark")
    nested = {k: v for k, v in deepspec.items() if k not in ("target_layer_ids", "mask_token_id",
                                                             "block_size", "num_target_layers")}
    zlab = {**nested, "architectures": ["DFlashDraftModel"], "markov_rank": 0,
            "enable_confidence_head": False,
            "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 1, 2], "block_size": 7}}
    layer = {k: deepspec[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                      "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "head_dim", "max_position_embeddings")}
    speculators = {"architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark",
                   "transformer_layer_config": layer, "aux_hidden_state_layer_ids": [1, 2, 3],
                   "block_size": 7, "mask_token_id": 3, "markov_rank": 128,
                   "markov_head_type": "vanilla", "enable_confidence_head": True,
                   "confidence_head_with_markov": True, "sample_from_anchor": True,
                   "speculators_config": {"proposal_methods": [{"speculative_tokens": 7}]}}
    return {"deepspec": deepspec, "zlab": zlab, "speculators": speculators}


def _drafter(path):
    DrafterConfig.from_json(path)
    DrafterConfig.from_json(path, allow_dflash2=True)


# (valid document, loader, its error type); extra: field names a fuzz may add
CASES = {
    "target": (_json("target"), TargetConfig.from_json, CheckpointError),
    **{f"drafter_{k}": (d, _drafter, CheckpointError) for k, d in _drafters().items()},
    "sps": ({"format": "dspark_rt.sps", "version": 1, "key": {"model": "m"}, "interp": "linear",
             "table": [[1, 900.0], [8, 400.0], [64, 90.0]]}, SPSProfile.load, ValueError),
    "sps_sglang": ({"sample_batch_tokens": [1, 8, 64], "sample_steps_per_sec": [900.0, 400, 90.0],
                    "max_batch_tokens": 128}, lambda p: (SPSProfile.load(p), read_sglang_sps_table(p)),
                   ValueError),
    "sts": ({"format": "dspark_rt.sts", "version": 1, "temperatures": [1.0, 1.5],
             "biases": [0.1, -0.2], "survival_table": [[0.1, 0.5, 0.9], [0.0, 0.2, 0.3]],
             "report": [], "metadata": {"logit_range": [-8.0, 8.0], "n_rounds": 10}},
            lambda p: (STSResult.load(p).calibration(), read_temperatures(p)), ValueError),
    "sts_sglang": ({"temperatures": [1.0, 1.5], "dataset": "d", "num_samples": 3,
                    "ece_before": [0.1, 0.2], "ece_after": [0.05, 0.1]},
                   lambda p: (read_sglang_sts(p), read_temperatures(p)), ValueError),
}
EXTRA = ["layer_types", "rope_scaling", "rope_parameters", "architectures", "model_type",
         "use_sliding_window", "sliding_window", "max_window_layers", "partial_rotary_factor",
         "draft_vocab_size", "sts_temperatures", "dflash_config", "dspark_config",
         "speculators_config", "sample_from_anchor", "is_causal", "final_logit_softcapping",
         "selector_top_k", "conv_group_size", "bias_seconds", "type", "rope_type", "factor",
         "proposal_methods", "original_max_position_embeddings", "low_freq_factor"]


def _paths(doc, extra=True):
    """Every place a fuzzed value may go: (key,) at the top, (key, inner) inside an object,
    (key, index) inside a list; extra: also the EXTRA names inside the objects."""
    out = [(k,) for k in list(doc) + EXTRA]
    for k, v in doc.items():
        if isinstance(v, dict):
            out += [(k, i) for i in list(v) + (EXTRA if extra else [])]
        if isinstance(v, list) and v:
            out += [(k, i) for i in range(len(v))]
    return out


def _load(tmp_path, case, path, value):
    doc, load, error = CASES[case]
    doc = copy.deepcopy(doc)
    where = doc
    for key in path[:-1]:
        where = where[key]
    if value is _DROP:
        if isinstance(where, dict):
            where.pop(path[-1], None)
    else:
        where[path[-1]] = value
    f = tmp_path / "config.json"
    f.write_text(json.dumps(doc))  # NaN / Infinity as Python's json writes (and reads) them
    try:
        load(str(f))
    except error as e:
        assert type(e) in (error, CheckpointError), f"{type(e).__name__}: {e}"
        assert str(f) in str(e), f"the error does not name the file: {e}"


_DROP = object()


@pytest.mark.parametrize("case", sorted(CASES))
def test_valid_documents_load(tmp_path, case):
    doc, load, _ = CASES[case]
    (tmp_path / "config.json").write_text(json.dumps(doc))
    load(str(tmp_path / "config.json"))


@FUZZ
@given(data=st.data())
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_field_fuzzed(tmp_path, case, data):
    path = data.draw(st.sampled_from(_paths(CASES[case][0])), label="path")
    value = data.draw(VALUE | st.just(_DROP), label="value")
    _load(tmp_path, case, path, value)


# the kinds of NASTY a loader tells apart (all of them: ~2x the time for no new branch)
LOADER_NASTY = [float("nan"), float("inf"), 10**400, 10**18, -1, True, 1.5, "x", [], {},
                [[[[["deep"]]]]], _DROP]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_field_meets_the_nasty_values(tmp_path, case):
    for path in _paths(CASES[case][0], extra=False):
        for value in LOADER_NASTY:
            _load(tmp_path, case, path, value)


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 50_000,
                                 b"\xff\xfe{}", b'{"table": "\xe9"}'])
@pytest.mark.parametrize("case", sorted(CASES))
def test_unreadable_files(tmp_path, case, raw):
    """Nesting past the recursion limit, bytes that are not UTF-8: the loader's error."""
    _, load, error = CASES[case]
    f = tmp_path / "config.json"
    f.write_bytes(raw)
    with pytest.raises(error) as e:
        load(str(f))
    assert type(e.value) in (error, CheckpointError) and str(f) in str(e.value), e.value
