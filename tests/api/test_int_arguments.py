"""Integer arguments of the public constructors refuse bools (True is an int to Python, so
`tensor_parallel_size=True` used to run as 1) and non-integers, naming the argument."""
import numpy as np
import pytest

from dspark_rt import Decoder
from dspark_rt.policies import AsyncScheduler, AutoPolicy, OnlineCalibration, SyncScheduler
from dspark_rt.policies.sps import SPSProfile

SPS = SPSProfile.from_pairs({B: 1000.0 / (1.0 + B / 4.0) for B in range(1, 65)})


@pytest.mark.parametrize("kwargs,name", [
    (dict(tensor_parallel_size=True), "tensor_parallel_size"),
    (dict(tensor_parallel_size=1.0), "tensor_parallel_size"),
    (dict(page_size=True), "page_size"),
])
def test_decoder_refuses_bools_for_ints(tiny_target, kwargs, name):
    with pytest.raises(ValueError, match=name):
        Decoder.from_pretrained(tiny_target, **kwargs)


def test_decoder_takes_numpy_ints(tiny_target):
    dec = Decoder.from_pretrained(tiny_target, tensor_parallel_size=np.int64(1), page_size=np.int64(8))
    assert dec.runner.page_size == 8 and dec.tensor_parallel is None


@pytest.mark.parametrize("make,name", [
    (lambda v: SyncScheduler(SPS, max_tokens=v), "max_tokens"),
    (lambda v: AsyncScheduler(SPS, max_tokens=v), "max_tokens"),
    (lambda v: AutoPolicy(SPS, SPS, max_tokens=v), "max_tokens"),
    (lambda v: AutoPolicy(SPS, SPS, explore_every=v), "explore_every"),
    (lambda v: OnlineCalibration(None, v), "gamma"),
    (lambda v: OnlineCalibration(None, 4, refit_every=v), "refit_every"),
    (lambda v: OnlineCalibration(None, 4, min_labels=v), "min_labels"),
])
@pytest.mark.parametrize("value", [True, 2.5])
def test_policies_refuse_bools_for_ints(make, name, value):
    with pytest.raises(ValueError, match=name):
        make(value)
    make(np.int64(2))  # numpy ints are ints
