"""Documented path of ``piecewise_backend.models.moe`` (the toy MoE): a re-export."""

from .models.moe import Attention, MoE, ToyMoE, rms_norm  # noqa: F401
