"""Checkpoint I/O: what the runtime reads from a model folder, checked before any weight is
loaded. tensors.py (safetensors headers, tensor specs, loading, dtypes), config.py (target
configs and the shared field readers), drafter_formats.py / drafter_config.py (every drafter
packaging, parsed by its fields into one DrafterConfig), drafter_tensors.py (their tensors,
rewritten exactly into the layout the runner reads), tokenizer.py (tokenizer.json, chat
template, incremental detokenisation)."""
from .config import CheckpointError, TargetConfig, read_json
from .drafter_config import DrafterConfig
from .tensors import Checkpoint, drafter_specs, resolve_dtype, target_specs

__all__ = ["Checkpoint", "CheckpointError", "DrafterConfig", "TargetConfig", "drafter_specs",
           "read_json", "resolve_dtype", "target_specs"]
