"""The CUDA double's rules (tests/cuda_double.py), checked on the double and, marked cuda, on a GPU.

Each rule is run twice with the same steps: on the double here, and on a real GPU by
scripts/gpu_check.sh, in a process of their own (they leave the allocator as CUDA does after
a failure). If a GPU twin fails, the double is wrong about that rule: fix the double first,
then the platform (tests/test_cuda_platform.py).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from piecewise_backend.platforms import cuda as cuda_platform
from tests import cuda_double


@pytest.fixture
def fake(monkeypatch):
    return cuda_double.install(monkeypatch)


# ---------------------------------------------------------------- on the double


def test_double_rule_dead_pool_cannot_be_captured_into(fake):
    pool, s = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        fake.malloc(1 << 20)  # a block of the pool outlives the graph
        fake.launch()
        g.capture_end()
    g.reset()
    with torch.cuda.stream(s), pytest.raises(RuntimeError, match="use_count"):
        torch.cuda.CUDAGraph().capture_begin(pool=pool)


def test_double_rule_invalidated_capture_keeps_routing_until_ended(fake):
    pool, s = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            fake.host_sync()
        with pytest.raises(RuntimeError):
            g.capture_end()
    g.reset()
    assert not torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(s), pytest.raises(RuntimeError, match="already recording"):
        torch.cuda.CUDAGraph().capture_begin(pool=pool)
    with pytest.raises(RuntimeError, match="captures_underway.empty"):
        torch.cuda.empty_cache()
    torch._C._cuda_endAllocateToPool(0, pool)
    torch.cuda.empty_cache()


def test_double_rule_another_threads_sync_invalidates_a_capture(fake):
    s, errors = torch.cuda.Stream(), []

    def sync():
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            errors.append(e)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=torch.cuda.graph_pool_handle())
        fake.launch()
        t = threading.Thread(target=sync)
        t.start()
        t.join()
        with pytest.raises(RuntimeError):
            g.capture_end()
    assert errors and "capturing" in str(errors[0])


def test_double_rule_an_empty_capture_warns(fake):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g.capture_begin(pool=torch.cuda.graph_pool_handle())
        g.capture_end()
    assert any(cuda_platform._EMPTY_WARNING in str(c.message) for c in caught)


# ---------------------------------------------------------------- on a real GPU


@pytest.mark.cuda
def test_gpu_rule_dead_pool_cannot_be_captured_into():
    pool, s = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    a = torch.randn(64, 64, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        kept = a @ a  # a block of the pool outlives the graph
        g.capture_end()
    g.reset()  # the pool's last use
    with torch.cuda.stream(s), pytest.raises(RuntimeError, match="use_count"):
        torch.cuda.CUDAGraph().capture_begin(pool=pool)
    del kept


@pytest.mark.cuda
def test_gpu_rule_invalidated_capture_keeps_routing_until_ended():
    pool, s = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    x = torch.randn(8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            x.sum().item()
        with pytest.raises(RuntimeError):
            g.capture_end()
    g.reset()
    assert not torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(s), pytest.raises(RuntimeError, match="already recording"):
        torch.cuda.CUDAGraph().capture_begin(pool=pool)
    with pytest.raises(RuntimeError, match="captures_underway"):
        torch.cuda.empty_cache()
    torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)  # what the platform does
    torch.cuda.empty_cache()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g2.capture_begin(pool=torch.cuda.graph_pool_handle())
        y = x * 2
        g2.capture_end()
    g2.replay()
    torch.testing.assert_close(y, x * 2)


@pytest.mark.cuda
def test_gpu_rule_another_threads_sync_invalidates_a_capture():
    pool, s, x, errors = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), torch.randn(8, device="cuda"), []

    def sync():
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            errors.append(e)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        x.mul_(2)
        t = threading.Thread(target=sync)
        t.start()
        t.join(60)
        with pytest.raises(RuntimeError):
            g.capture_end()
    assert errors and "capturing" in str(errors[0])
    g.reset()
    torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)


@pytest.mark.cuda
def test_gpu_rule_an_empty_capture_warns():
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g.capture_begin(pool=torch.cuda.graph_pool_handle())
        g.capture_end()
    assert any(cuda_platform._EMPTY_WARNING in str(c.message) for c in caught)
