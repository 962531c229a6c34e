"""Documented path of tensor parallelism: ``runner.agreement`` (cross-rank step agreement) and
``testing.sharding`` (toy-model sharding), re-exported."""

from .testing.sharding import ToyMLP, make_kv_caches, shard_mlp, shard_toy_llama  # noqa: F401
from .runner.agreement import (  # noqa: F401
    DEFAULT_TIMEOUT_S,
    PeerCaptureError,
    capture_agreement,
    check_same_step,
    distributed,
    init_tensor_parallel,
    wait_collectives,
)
