"""Structured output under speculation (DESIGN §6, constrained decoding): request parameters,
grammar matchers (xgrammar) and the per-round walk that masks every verify row."""
from .params import StructuredOutputsParams
from .walk import Constraints

__all__ = ["StructuredOutputsParams", "Constraints"]
