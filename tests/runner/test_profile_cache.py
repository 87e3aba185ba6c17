"""The SPS profile cache ($DSPARK_CACHE_DIR) when it cannot be used: the measured profile is
served anyway, with one warning naming the folder, never an OSError."""
import logging

import pytest

from dspark_rt import Decoder, SamplingParams
from dspark_rt.runner import profiling

KW = dict(B_values=[1, 2, 4], seconds=0.05, max_batch=2, context_len=16, progress=False)


@pytest.fixture(scope="module")
def dec(tiny_target, tiny_drafters):
    return Decoder.from_pretrained(tiny_target, tiny_drafters("vanilla", 4))


def _under_a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    return f / "cache"


def _read_only(tmp_path, monkeypatch):
    """A folder the profile cannot be written to (chmod does not stop root: the write fails
    as it would there)."""
    def save(self, path):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(profiling.SPSProfile, "save", save)
    return tmp_path / "ro"


@pytest.mark.parametrize("make", [_under_a_file, _read_only])
def test_unusable_cache_dir_warns_once_and_serves(dec, tmp_path, monkeypatch, caplog, make):
    cache = make(tmp_path) if make is _under_a_file else make(tmp_path, monkeypatch)
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(cache))
    with caplog.at_level(logging.WARNING, logger=profiling.__name__):
        first = profiling.load_or_profile(dec.runner, **KW)
        second = profiling.load_or_profile(dec.runner, **KW)  # measured again, not warned again
    assert first.key == second.key and first.rounds_per_s
    warnings = [r.getMessage() for r in caplog.records if "DSPARK_CACHE_DIR" in r.getMessage()]
    assert len(warnings) == 1 and str(cache) in warnings[0], caplog.text


def test_sync_policy_with_unusable_cache_dir(tiny_target, tiny_drafters, tmp_path, monkeypatch):
    """The policies that profile (sync here) build and decode with the cache unusable."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(_under_a_file(tmp_path)))
    real = profiling.profile_runners
    monkeypatch.setattr(profiling, "profile_runners",  # a short measurement
                        lambda items, *a, **k: real(items, [1, 2, 4], 0.05, 16, 2, False, False))
    d = Decoder.from_pretrained(tiny_target, tiny_drafters("vanilla", 4), policy="sync")
    out = d.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].token_ids) == 4
