"""Drafter configurations (DESIGN §3): a DeepSpec, speculators, SpecForge or z-lab `config.json`,
parsed by its fields (drafter_formats.py) into one DrafterConfig.

Every problem is a CheckpointError whose message names the file and the field, raised before any
weight is read.
"""
from dataclasses import dataclass

from .config import CheckpointError, TargetConfig, _config_path, read_json
from .drafter_formats import parse

__all__ = ["DrafterConfig"]


@dataclass(frozen=True)
class DrafterConfig:
    """A DSpark / DFlash drafter in any supported packaging (dspark_rt/drafter_formats.py), in
    DeepSpec's conventions. `format` names the packaging: "deepspec", "speculators",
    "specforge" or "zlab"."""
    source: str
    format: str
    model: TargetConfig  # the drafter's own decoder layers (Qwen3 layers, q/k norms)
    block_size: int
    target_layer_ids: tuple
    mask_token_id: int
    num_target_layers: int | None  # z-lab / speculators configs do not carry it
    markov_rank: int = 0
    head: str = "none"  # "none" | "vanilla" | "gated" | "rnn"
    confidence: bool = False
    confidence_markov: bool = False
    block_layout: str = "anchor_first"  # or "one_plus_n": slot j >= 1 predicts position p + j
    draft_vocab_size: int | None = None  # reduced draft vocabulary (d2t offsets), else None
    sts_temperatures: tuple | None = None  # STS temperatures shipped in the config
    causal_layers: tuple = ()  # per drafter layer: causal inside the block (z-lab sliding layers)
    sliding_window: int | None = None  # window of the sliding layers (None: no sliding layer)
    window_layers: tuple = ()  # per drafter layer: attends within sliding_window
    rope_interleave: bool = False  # q/k rows rotate in consecutive pairs (permuted at load)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    dflash2: dict | None = None  # DFlash2DraftModel fields (parsed only when asked for)

    @property
    def layout(self) -> str:
        return self.block_layout

    @property
    def gamma(self) -> int:
        """Drafts per round: anchor-first blocks predict from every slot, 1+N blocks skip slot 0."""
        return self.block_size if self.layout == "anchor_first" else self.block_size - 1

    # the drafter's own layer shapes, read through (for sizing its KV cache)
    hidden_size = property(lambda self: self.model.hidden_size)
    vocab_size = property(lambda self: self.model.vocab_size)
    num_hidden_layers = property(lambda self: self.model.num_hidden_layers)
    num_attention_heads = property(lambda self: self.model.num_attention_heads)
    num_key_value_heads = property(lambda self: self.model.num_key_value_heads)
    head_dim = property(lambda self: self.model.head_dim)

    @classmethod
    def from_json(cls, path: str, allow_dflash2: bool = False) -> "DrafterConfig":
        src = _config_path(path)
        return cls.from_dict(read_json(src), src, allow_dflash2)

    @classmethod
    def from_dict(cls, d: dict, src: str = "config.json",
                  allow_dflash2: bool = False) -> "DrafterConfig":
        f = parse(d, src, allow_dflash2)
        out = cls(source=src, format=f.packaging, model=f.model, block_size=f.block_size,
                  target_layer_ids=f.target_layer_ids, mask_token_id=f.mask_token_id,
                  num_target_layers=f.num_target_layers, markov_rank=f.markov_rank, head=f.head,
                  confidence=f.confidence, confidence_markov=f.confidence_markov,
                  block_layout=f.layout, draft_vocab_size=f.draft_vocab_size,
                  sts_temperatures=f.sts_temperatures, causal_layers=f.causal_layers,
                  sliding_window=f.sliding_window, window_layers=f.window_layers,
                  rope_interleave=f.rope_interleave,
                  input_embedding_scale=f.input_embedding_scale,
                  output_multiplier=f.output_multiplier, dflash2=f.dflash2)
        out._check_ranges(out.num_target_layers)
        return out

    def _check_ranges(self, n_target: int | None):
        for lid in self.target_layer_ids if n_target is not None else ():
            if not -1 <= lid < n_target - 1:
                raise CheckpointError(
                    f"{self.source}: field 'target_layer_ids' has layer id {lid} out of range: "
                    f"ids must satisfy -1 <= id < {n_target - 1} (num_target_layers={n_target}; "
                    "-1 is the embedding output, the final layer is not allowed)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(f"{self.source}: field 'mask_token_id' = {self.mask_token_id} "
                                  f"is outside the vocabulary (vocab_size={self.vocab_size})")

    def check_target(self, target: TargetConfig):
        """Cross-checks against the target the drafter will run with."""
        for key in ("vocab_size", "hidden_size"):
            mine, theirs = getattr(self.model, key), getattr(target, key)
            if mine != theirs:
                raise CheckpointError(f"{self.source}: field '{key}' = {mine} does not match the "
                                      f"target's {key} = {theirs} ({target.source})")
        if self.num_target_layers is not None and self.num_target_layers != target.num_hidden_layers:
            raise CheckpointError(
                f"{self.source}: field 'num_target_layers' = {self.num_target_layers} does not match "
                f"the target's num_hidden_layers = {target.num_hidden_layers} ({target.source})")
        self._check_ranges(target.num_hidden_layers)
