"""vLLM's engine arguments by name on Decoder.from_pretrained and LLM: each one changes what it
says (the context, the batch, the step's tokens, the KV pool, the drafts verified) and leaves
the greedy output equal to the unconstrained run's; bad values and unknown names are refused by
name, before anything loads."""
import pytest

from dspark_rt import LLM, Decoder, SamplingParams, engine_args
from dspark_rt.engine_args import EngineArgs

PROMPTS = [[5, 6, 7], [11], [20, 21, 22, 23, 24, 25], [40, 41] * 20, [3, 1, 4, 1, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def drafter(tiny_drafters):
    return tiny_drafters("gated", 4)  # gamma 4


@pytest.fixture(scope="module")
def ref(tiny_target):
    """Plain greedy decoding, unconstrained: what every constrained run must still emit."""
    dec = Decoder.from_pretrained(tiny_target, mode="ar")
    return [o.token_ids for o in dec.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _tokens(dec, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in dec.generate(prompts, params, use_tqdm=False)]


def test_unknown_keyword_is_a_type_error_naming_it_before_loading(tiny_target, drafter, monkeypatch):
    from dspark_rt.models import qwen3
    monkeypatch.setattr(qwen3.Qwen3Model, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("loaded the models first")))
    with pytest.raises(TypeError, match="trust_remote_code"):
        Decoder.from_pretrained(tiny_target, drafter, trust_remote_code=True)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        Decoder.from_pretrained(tiny_target, drafter, gpu_memory_utilization=1.5)


@pytest.mark.parametrize("name,value", [
    ("max_model_len", 0), ("max_model_len", 2.5), ("max_num_seqs", 0), ("max_num_seqs", True),
    ("max_num_batched_tokens", -1), ("num_speculative_tokens", 0), ("gpu_memory_utilization", 0),
    ("gpu_memory_utilization", "0.9"), ("enforce_eager", 1),
])
def test_bad_values_name_the_argument(name, value):
    with pytest.raises(ValueError, match=name):
        EngineArgs(**{name: value})


def test_max_model_len_caps_the_context(tiny_target, drafter, ref):
    dec = Decoder.from_pretrained(tiny_target, drafter, max_model_len=64)
    assert dec.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len"):
        dec.generate([[1] * 64], GREEDY, use_tqdm=False)
    # max_tokens=None: until the context ends, which is now 64 tokens
    long = dec.generate([[40, 41] * 20], SamplingParams(temperature=0, max_tokens=None,
                                                        ignore_eos=True), use_tqdm=False)[0]
    assert long.finish_reason == "length" and 40 + len(long.token_ids) in (63, 64)
    plain = Decoder.from_pretrained(tiny_target, mode="ar")
    full = plain.generate([[40, 41] * 20], SamplingParams(temperature=0, max_tokens=30,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert long.token_ids == full.token_ids[: len(long.token_ids)]
    assert _tokens(dec) == ref
    with pytest.raises(ValueError, match=r"max_model_len must lie in \[2, 512\]"):
        Decoder.from_pretrained(tiny_target, drafter, max_model_len=513)


def test_max_num_seqs_bounds_the_running_batch(tiny_target, drafter, ref):
    dec = Decoder.from_pretrained(tiny_target, drafter, max_num_seqs=2)
    seen = []
    step = dec.engine.step

    def counted():
        seen.append(dec.engine.num_running)
        return step()
    dec.engine.step = counted
    assert _tokens(dec) == ref
    assert max(seen) == 2 and dec.engine.scheduler.max_num_seqs == 2


def test_max_num_batched_tokens_bounds_every_step(tiny_target, drafter, ref, monkeypatch):
    from dspark_rt.engine.scheduler import RequestScheduler
    sizes = []
    schedule = RequestScheduler.schedule

    def counted(self):
        out = schedule(self)
        sizes.append(out.num_batched_tokens)
        return out
    monkeypatch.setattr(RequestScheduler, "schedule", counted)
    dec = Decoder.from_pretrained(tiny_target, drafter, max_num_batched_tokens=12)
    assert _tokens(dec) == ref
    # the 40-token prompt is prefilled in chunks of at most 12 tokens, mixed with rounds
    assert sizes and max(sizes) == 12 and dec.engine.scheduler.chunk_size == 12
    with pytest.raises(ValueError, match=r"max_num_batched_tokens .* 1 \+ gamma = 5"):
        Decoder.from_pretrained(tiny_target, drafter, max_num_batched_tokens=4)


def test_num_speculative_tokens_caps_the_drafts_verified(tiny_target, drafter, ref):
    dec = Decoder.from_pretrained(tiny_target, drafter, mode="dspark", policy="fixed",
                                  num_speculative_tokens=2)
    outs = dec.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    for o in outs:
        m = o.metrics
        assert m.gamma == 4 and m.verified_by_position[2:] == [0, 0]
        assert m.verified_by_position[1] > 0  # the cap, not a shorter chain, stopped them
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be at most .* \(4"):
        Decoder.from_pretrained(tiny_target, drafter, num_speculative_tokens=5)
    with pytest.raises(ValueError, match="num_speculative_tokens=1 needs a drafter"):
        Decoder.from_pretrained(tiny_target, mode="ar", num_speculative_tokens=1)


def test_gpu_memory_utilization_caps_the_kv_pool(tiny_target, drafter, ref, monkeypatch):
    """The pool may take utilization x total - what is in use; a batch needing more pages runs
    in it with preemption, emitting what it emits unconstrained."""
    probe = Decoder.from_pretrained(tiny_target, drafter)
    per_page = engine_args.page_bytes(probe.runner)
    total, used = 1000 * per_page, 500 * per_page
    monkeypatch.setattr(engine_args, "device_memory", lambda dev: (total - used, total))
    dec = Decoder.from_pretrained(tiny_target, drafter, gpu_memory_utilization=0.512)
    assert dec.limits.max_num_pages == 12  # 512 - 500 pages
    many = PROMPTS * 3
    assert dec.engine.pages_needed([dec.engine.make_request(p, GREEDY) for p in many]) > 12
    assert _tokens(dec, many) == ref * 3
    assert dec.engine.num_pages == 12
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5: .* in use"):
        Decoder.from_pretrained(tiny_target, drafter, gpu_memory_utilization=0.5)


def test_device_memory_reads_the_host():
    free, total = engine_args.device_memory("cpu")
    assert 0 < free <= total


def test_enforce_eager_drops_the_cuda_graphs():
    class Runner:  # what apply() reads of a runner that captured graphs (CUDA only)
        max_len, gamma, mode, graphs = 512, 4, "dspark", object()
    r = Runner()
    EngineArgs(enforce_eager=False).apply(r)
    assert r.graphs is not None
    EngineArgs(enforce_eager=True).apply(r)
    assert r.graphs is None


def test_llm_takes_vllms_speculative_config(tiny_target, drafter, ref):
    llm = LLM(model=tiny_target, speculative_config={"model": drafter, "num_speculative_tokens": 3},
              seed=0, tensor_parallel_size=1, enforce_eager=True, max_num_seqs=4)
    assert isinstance(llm, Decoder) and llm.runner.drafter is not None
    assert llm.limits.num_speculative_tokens == 3 and llm.limits.max_num_seqs == 4
    assert _tokens(llm) == ref
    assert LLM(tiny_target).mode == "ar"
    with pytest.raises(ValueError, match="'draft_tensor_parallel_size' is not served"):
        LLM(tiny_target, speculative_config={"model": drafter, "draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="method must be one of"):
        LLM(tiny_target, speculative_config={"model": drafter, "method": "eagle3"})
