"""Random-weight target / DSpark drafter pairs of real model shapes, built in device memory.

Nothing can be downloaded where the benchmarks run, so system throughput at Qwen3-8B scale is
measured on random weights of Qwen3-8B's exact shapes (with synthetic acceptance, see
dspark_rt.testing.synthetic). Weights are N(0, 0.02^2), norm weights 1; generated on the device, so an
8B model costs seconds, not minutes of host init.
"""
import torch

from ..checkpoint.tensors import drafter_specs, target_specs
from ..checkpoint.config import TargetConfig
from ..checkpoint.drafter_config import DrafterConfig
from ..checkpoint.drafter_tensors import adapt
from ..models.drafter import Drafter
from ..models.qwen3 import Qwen3Model

# Qwen/Qwen3-8B config.json (the fields the runtime reads)
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 40960,
            "tie_word_embeddings": False, "eos_token_id": 151645, "hidden_act": "silu"}
# A DeepSpec DSpark drafter for it: 5 Qwen3 layers of the target's width, 5 target layers of
# features, gamma 7, vanilla Markov head of rank 256, confidence head with the Markov feature.
DSPARK_8B = dict(QWEN3_8B, architectures=["Qwen3DSparkModel"], num_hidden_layers=5,
                 num_target_layers=36, block_size=7, target_layer_ids=[1, 9, 17, 25, 33],
                 mask_token_id=151669, markov_rank=256, markov_head_type="vanilla",
                 enable_confidence_head=True, confidence_head_with_markov=True)
# Qwen/Qwen3-0.6B config.json (tied embeddings, 28 layers of width 1024): the CPU benchmark's
# target, where a forward over 8 tokens costs about as much as over one.
QWEN3_06B = dict(QWEN3_8B, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True)
# A drafter sized as the DSpark paper's: 5 layers of the target's width reading 5 target layers,
# vanilla Markov head of rank 256 over the full vocabulary, confidence head.
DSPARK_06B = dict(DSPARK_8B, **{k: QWEN3_06B[k] for k in ("hidden_size", "intermediate_size",
                                                         "num_attention_heads", "num_key_value_heads")},
                  num_target_layers=28, target_layer_ids=[1, 7, 13, 19, 25])
# The same structure at toy size: checks the benchmark path on a CPU in seconds.
TINY = dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
            eos_token_id=510)
DSPARK_TINY = dict(DSPARK_8B, **{k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                      "num_attention_heads", "num_key_value_heads",
                                                      "head_dim", "max_position_embeddings",
                                                      "eos_token_id")},
                   num_hidden_layers=1, num_target_layers=4, target_layer_ids=[0, 2],
                   mask_token_id=511, markov_rank=16)
SHAPES = {"qwen3-8b": (QWEN3_8B, DSPARK_8B), "qwen3-0.6b": (QWEN3_06B, DSPARK_06B),
          "tiny": (TINY, DSPARK_TINY)}


def _random(specs: dict, dtype, device, gen) -> dict:
    out = {}
    for name, shape in specs.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            out[name] = t.normal_(0.0, 0.02, generator=gen)
    return out


def random_pair(shape: str, dtype=torch.bfloat16, device="cuda", seed: int = 0,
                block_size: int | None = None):
    """(target, drafter) of SHAPES[shape] with random weights; block_size overrides gamma."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    tdict, ddict = SHAPES[shape]
    if block_size is not None:
        ddict = dict(ddict, block_size=block_size)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    tcfg = TargetConfig.from_dict(tdict, f"random:{shape}/config.json")
    target = Qwen3Model.from_tensors(tcfg, _random(target_specs(tcfg)[0], dtype, device, gen))
    dcfg = DrafterConfig.from_dict(ddict, f"random:{shape}-dspark/config.json")
    dcfg.check_target(tcfg)
    # through the loader's rewrite, as a checkpoint would go (a bias-free confidence head, etc.)
    dcfg, tensors = adapt(dcfg, _random(drafter_specs(dcfg)[0], dtype, device, gen), target)
    drafter = Drafter.from_tensors(dcfg, tensors, target)
    return target, drafter
