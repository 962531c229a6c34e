"""Documented path of ``piecewise_backend.testing.moe`` (the toy MoE): a re-export."""

from .testing.moe import Attention, MoE, ToyMoE, rms_norm  # noqa: F401
