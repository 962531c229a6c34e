"""A lazy engine whose idle-time capture (or the compile before it) fails: recorded once, said once, the
steps run eagerly with reason ``capture_failed``, every request is served, and ``capture_idle(retry_failed=True)``
tries again (issue 46 item 1). On the simulated platform; the CUDA capture failure itself is
tests/platforms/test_cuda_platform.py's."""

from __future__ import annotations

import pytest
import torch

import piecewise_backend as pb
from pbtest.helpers import load_file
from piecewise_backend import observability, serve
from piecewise_backend.runner import CaptureFailure

own = load_file("examples/own_model.py")
M = pb.CUDAGraphMode
PROMPTS = [[5, 7, 9], [3, 1, 4, 1, 5], [2, 7, 1, 8]]


@torch.library.custom_op("pb_test::reads_the_host", mutates_args=())
def reads_the_host(x: torch.Tensor) -> torch.Tensor:
    """Identity after a host read: fine eagerly and compiled, refused inside any capture."""
    x.sum().item()
    return x.clone()


@reads_the_host.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pb_test::untraceable", mutates_args=())
def untraceable(x: torch.Tensor) -> torch.Tensor:
    """Identity with no fake kernel: runs eagerly, Dynamo's trace of it raises."""
    return x.clone()


class Failing(torch.nn.Module):
    """examples/own_model.py's decoder whose captures fail (``stage="capture"``) or whose compile fails
    (``stage="compile"``: Dynamo's trace raises, an op without a fake kernel); eager steps give the decoder's outputs."""

    def __init__(self, stage: str):
        super().__init__()
        self.inner, self.stage = own.make_model(), stage

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, dense: bool = False) -> torch.Tensor:
        out = self.inner(input_ids, position_ids, dense)
        if self.stage == "compile":
            return untraceable(out)
        return reads_the_host(out) if self.stage == "capture" else out


def lazy_engine(model: Failing) -> serve.Engine:
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4], platform="simulated",
                                  compile_pieces="eager")
    return serve.Engine(model, config, kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=4,
                        max_model_len=48, block_size=4, lazy_capture=True, step_capture_budget_s=5.0,
                        enable_prefix_caching=False)  # a second generate of the same prompts runs the same steps


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    said: list[str] = []
    monkeypatch.setattr(observability.logger, "warning", lambda msg, *a: said.append(msg % a))
    return said


@pytest.mark.parametrize("stage", ["capture", "compile"])
def test_a_failed_lazy_capture_is_recorded_once_and_the_engine_keeps_serving(stage, warnings):
    engine = lazy_engine(Failing(stage))
    model = own.make_model()
    reference = [own.reference(model, p, 30) for p in PROMPTS]
    failures = pb.counters["capture_failures"]
    steps: list[serve.StepInfo] = []
    for _ in range(2):  # the old engine raised from every step once the first capture was tried
        assert engine.generate(PROMPTS, 30, on_step=steps.append) == reference
    recorded = engine.runner.capture_failures
    assert recorded and all(isinstance(f, CaptureFailure) and f.stage == stage for f in recorded)
    if stage == "compile":
        assert len(recorded) == 1 and "untraceable" in recorded[0].reason
    else:
        assert "not permitted when stream is capturing" in recorded[0].reason
    assert pb.counters["capture_failures"] - failures == len(recorded)  # each tried once, never retried
    assert len(warnings) == 1 and stage in warnings[0] and "retry_failed" in warnings[0], warnings
    assert engine.runner.demand == {}  # a failed key is not demand: the engine stops trying before each step
    late = steps[len(steps) // 2:]
    assert {s.mode for s in late} == {M.NONE} and {s.reason for s in late} == {"capture_failed"}


def test_capture_idle_retries_failed_captures_only_when_asked(warnings):
    failing = Failing("capture")
    engine = lazy_engine(failing)
    engine.generate(PROMPTS, 6)
    assert engine.runner.capture_idle(60.0) == []  # every key still demanded is tried: each fails
    failed = engine.runner.capture_failures
    assert len(failed) >= 2 and engine.runner.demand == {}
    failing.stage = "none"  # the cause is gone (the model no longer reads the host)
    assert engine.runner.capture_idle(60.0) == []  # not asked: nothing is tried
    captured = engine.capture_idle(60.0, retry_failed=True)
    assert set(captured) == {(f.mode, f.descriptor) for f in failed} and engine.runner.capture_failures == ()
    with pytest.raises(ValueError, match="retry_failed must be a bool, got 'yes'"):
        engine.capture_idle(1.0, retry_failed="yes")
