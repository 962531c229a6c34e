"""Shared pytest setup: fresh Dynamo caches per test module, capture re-enabled after each test."""

from __future__ import annotations

import pytest
import torch

import piecewise_backend as pb

# Test models are tiny: on a 2-core CI machine, intra-op thread hand-off costs more than it saves.
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    # ToyLlama.forward is one code object for every test: without a reset, tests would
    # share Dynamo cache entries and hit recompile_limit.
    torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True)
def _capture_enabled():
    yield
    pb.set_capture_enabled(True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # not item.keywords: it holds directory names too
            item.add_marker(skip)
