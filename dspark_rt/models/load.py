"""One door for drafter folders: a DFlash2DraftModel checkpoint becomes a DFlash2Drafter, any
other supported packaging a Drafter (checkpoint/drafter_formats.py names them)."""
from ..checkpoint.drafter_config import DrafterConfig
from .dflash2 import DFlash2Drafter
from .drafter import Drafter

__all__ = ["load_drafter"]


def load_drafter(path: str, target, dtype=None, device=None) -> Drafter:
    cls = DFlash2Drafter if DrafterConfig.from_json(path, allow_dflash2=True).dflash2 else Drafter
    return cls.from_pretrained(path, target, dtype=dtype, device=device)
