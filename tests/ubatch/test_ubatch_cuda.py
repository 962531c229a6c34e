"""Micro-batching on CUDA streams (ubatch_streams), run against the CPU double of torch.cuda
(tests/support/pbtest/cuda_double/fake.py): the FULL capture of a micro-batched step forks the communication stream
from the capture stream and joins it back, each half's compute waits for its own communication,
no thread launches outside the capture, and the threads' cuBLAS handles exist before it. The
``cuda``-marked twins run the same steps on a GPU."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.ubatch import streams as ubatch_streams
from piecewise_backend.ubatch import threads as ubatch_threads
from piecewise_backend.platforms import base as platforms_base
from piecewise_backend.platforms.cuda import platform as cuda_platform
from pbtest import cuda_double
from pbtest.cuda_double.fake import NOT_PERMITTED
from pbtest.helpers import end_failed_capture

FULL, NONE = pb.CUDAGraphMode.FULL, pb.CUDAGraphMode.NONE
CFG = pb.CompilationConfig(platform="cuda", compile_pieces="eager", use_ubatching=True, cudagraph_mode="FULL")


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])
    with cuda_double.installed() as fake:
        yield fake
        cuda_double.check_clean(fake)


def halves(x: torch.Tensor, cut: int) -> list[pb.UBatchSlice]:
    n = x.shape[0]
    return [pb.UBatchSlice((x[:cut],), {}, pb.BatchDescriptor(cut), {}, cut),
            pb.UBatchSlice((x[cut:],), {}, pb.BatchDescriptor(n - cut), {}, n - cut)]


class CommModel(torch.nn.Module):
    """What an expert-parallel layer does on a GPU, told to the double: compute, a collective in a
    ``dbo_comm`` region, a yield, then compute that reads the collective's result."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = layers
        self.streams: list[tuple[int, str, Any]] = []  # (half, where, current stream)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fake = cuda_double.current()
        i = pb.get_forward_context().ubatch_index
        for layer in range(self.layers):
            fake.gemm()
            fake.launch(writes=f"h{i}.{layer}")
            self.streams.append((i, "compute", torch.cuda.current_stream()))
            with pb.dbo_comm(x):
                fake.launch(reads=f"h{i}.{layer}", writes=f"a2a{i}.{layer}")
                self.streams.append((i, "comm", torch.cuda.current_stream()))
            pb.dbo_yield()
            fake.launch(reads=f"a2a{i}.{layer}")
        return x * 2


def _step(wrapper: Any, x: torch.Tensor, mode: pb.CUDAGraphMode) -> torch.Tensor:
    with pb.set_forward_context(mode, pb.BatchDescriptor(x.shape[0]), ubatch_slices=halves(x, 2)):
        return wrapper(x)


def _capture(config: pb.CompilationConfig = CFG) -> tuple[CommModel, Any, torch.Tensor]:
    model = CommModel()
    wrapper = pb.wrap_model(model, config)
    x = torch.arange(5.0)
    pb.mark_persistent(x)
    _step(wrapper, x, FULL)
    return model, wrapper, x


def test_full_capture_forks_the_comm_stream_from_the_capture_stream_and_joins_it_back(fake):
    model, wrapper, x = _capture()
    entry = wrapper.ubatch_entries[pb.BatchDescriptor(5)]
    graph = entry.graphs[0].graph if hasattr(entry, "graphs") else None
    capture_stream = cuda_platform.platform_for(0).stream
    compute = {s for _, where, s in model.streams if where == "compute"}
    comm = {s for _, where, s in model.streams if where == "comm"}
    assert compute == {capture_stream} and len(comm) == 1 and comm != compute  # every launch of both threads
    assert not next(iter(comm)).is_default and not fake.unjoined and not fake.invalidations
    assert fake.stray == [] and fake.races == []  # nothing outside the capture; each read after its producer
    assert {t.ident for t, _ in wrapper.threads._threads} <= set(fake.handles)  # both threads made theirs before it
    if graph is not None:
        assert graph.streams == compute | comm
    model.streams.clear()
    assert torch.equal(_step(wrapper, x, FULL), x * 2) and model.streams == []  # replayed, no thread ran


def test_eager_cuda_steps_run_comm_on_its_stream_and_each_half_waits_for_its_own(fake):
    model = CommModel()
    wrapper = pb.wrap_model(model, CFG.replace(cudagraph_mode="NONE"))
    x = torch.arange(4.0)
    assert torch.equal(_step(wrapper, x, NONE), x * 2)
    comm = {s for _, where, s in model.streams if where == "comm"}
    assert len(comm) == 1 and torch.cuda.default_stream() not in comm and fake.races == []


def test_simulated_steps_keep_no_streams_even_where_cuda_is_initialized(fake):
    model = CommModel()
    wrapper = pb.wrap_model(model, CFG.replace(platform="simulated"))
    x = torch.arange(5.0)
    pb.mark_persistent(x)
    _step(wrapper, x, FULL)
    assert {s for _, _, s in model.streams} == {torch.cuda.default_stream()}  # dbo_comm ran in place


def test_a_half_failing_with_its_comm_unjoined_fails_the_step_with_its_error_and_capture_works_again(fake):
    class Failing(CommModel):
        fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail and pb.get_forward_context().ubatch_index == 1 and torch.cuda.is_current_stream_capturing():
                with pb.dbo_comm(x):
                    cuda_double.current().launch()
                raise KeyError("half 1 failed after launching its collective")
            return super().forward(x)

    model = Failing()
    wrapper = pb.wrap_model(model, CFG)
    x = torch.arange(5.0)
    pb.mark_persistent(x)
    with pytest.raises(KeyError, match="half 1 failed") as info:
        _step(wrapper, x, FULL)
    assert any("micro-batch 1" in note for note in info.value.__notes__) and not wrapper.ubatch_entries
    cuda_double.check_clean(fake)  # the capture was ended (unjoined: it failed) and released
    model.fail = False
    assert torch.equal(_step(wrapper, x, FULL), x * 2) and len(wrapper.ubatch_entries) == 1


def test_a_missing_join_fails_the_capture_at_capture_end(fake, monkeypatch):
    monkeypatch.setattr(ubatch_streams.StepStreams, "join", lambda self, index: None)
    monkeypatch.setattr(ubatch_streams.StepStreams, "join_all", lambda self: None)
    with pytest.raises(pb.CaptureInvalidatedError, match="fork that was not joined"):
        _capture()
    assert fake.unjoined


def test_without_the_hand_over_wait_a_half_reads_its_collective_too_early(fake, monkeypatch):
    # the step's final join alone makes the capture legal, but the halves' reads race their collectives
    monkeypatch.setattr(ubatch_streams.StepStreams, "join", lambda self, index: None)
    _capture()
    assert fake.races and not fake.unjoined


def test_threads_that_do_not_inherit_the_capture_stream_launch_outside_the_graph(fake, monkeypatch):
    # what the checks above would catch: the threads on the legacy default stream
    real = ubatch_threads.capture_state
    monkeypatch.setattr(ubatch_threads, "capture_state", lambda: {**real(), "stream": None})
    _capture()
    assert {name for name, s in fake.stray} == {"ubatch-0", "ubatch-1"}
    assert all(s.is_default for _, s in fake.stray)


def test_capture_without_warm_up_is_refused_before_any_thread_launches(fake):
    with pytest.raises(RuntimeError, match="never ran a step eagerly on the capture stream.*num_warmups >= 1"):
        _capture(CFG.replace(num_warmups=0))
    assert not fake.invalidations


def test_why_threads_prepare_first_a_cublas_handle_made_in_the_capture_invalidates_it(fake, monkeypatch):
    monkeypatch.setattr(ubatch_streams.CommStreams, "check_ready", lambda *a: None)
    with pytest.raises(RuntimeError, match=NOT_PERMITTED):
        _capture(CFG.replace(num_warmups=0))
    assert "cublasCreate" in fake.invalidations


class CaptureOnlyGemm(torch.nn.Module):
    """A GEMM only inside a capture (a FULL-only attention path; the eager warm-up runs none): its workspace
    must already exist on the micro-batch thread's stream, or it is made inside the capture, in the graph's pool."""

    def __init__(self, lt: bool) -> None:
        super().__init__()
        self.lt = lt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fake = cuda_double.current()
        if torch.cuda.is_current_stream_capturing():
            fake.gemm(lt=self.lt)
        with pb.dbo_comm(x):
            fake.launch()
        pb.dbo_yield()
        return x * 2


def test_threads_make_their_cublaslt_workspace_before_the_capture_on_torch_2_11(monkeypatch):
    # torch 2.11 keeps cuBLASLt's workspace apart, made by the first Lt GEMM (cublaslt_unified_workspace)
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])
    with cuda_double.installed((2, 11)) as fake:
        model = CaptureOnlyGemm(lt=True)
        wrapper = pb.wrap_model(model, CFG)
        x = torch.arange(5.0)
        pb.mark_persistent(x)
        _step(wrapper, x, FULL)
        made = {key: seg.pool for key, seg in fake.lt_workspaces.items()}
        assert len(made) >= 4 and set(made.values()) == {(0, 0)}, made  # 2 threads x 2 streams, none in the pool
        cuda_double.check_clean(fake)


def test_a_reused_stream_whose_workspaces_were_freed_is_warmed_again(fake):
    # A generation's end frees its stream's workspaces (torch >= 2.12) and the stream serves the next one:
    # the micro-batch threads' "ready on this stream" must not outlive that.
    model = CaptureOnlyGemm(lt=False)
    wrapper = pb.wrap_model(model, CFG)
    x = torch.arange(5.0)
    pb.mark_persistent(x)
    _step(wrapper, x, FULL)
    p = cuda_platform.platform_for(0)
    first = p.stream.cuda_stream
    for _ in range(2):  # each generation ends; its stream waits as a spare for the one after next
        wrapper.clear_graphs()
        p.release_cached()
        _step(wrapper, x, FULL)
    assert p.stream.cuda_stream == first  # the first generation's raw stream again
    ours = [seg for (h, st), seg in fake.workspaces.items() if st.cuda_stream == first and h in set(fake.handles.values())]
    assert ours and all(seg.pool == (0, 0) for seg in ours), [seg.pool for seg in ours]


# --- the double's rules this relies on (tests/support/pbtest/cuda_double/fake.py), with GPU twins ---------------------


def test_double_global_capture_refuses_cudamalloc_from_another_thread_thread_local_does_not(fake):
    for mode, refused in (("global", True), ("thread_local", False)):
        stream, graph, pool = torch.cuda.Stream(), torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        errors: list[str] = []
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode=mode)
            fake.launch()
            t = threading.Thread(target=lambda: errors.extend(_try(lambda: fake.malloc(1 << 20))))
            t.start(); t.join()  # noqa: E702
            ended = _try(graph.capture_end)
        if ended:
            end_failed_capture(graph, pool)
        assert bool(errors) == refused and bool(ended) == refused, (mode, errors, ended)


def test_double_an_event_wait_forks_a_stream_into_the_capture_and_a_wait_back_joins_it(fake):
    for join in (False, True):
        origin, side = torch.cuda.Stream(), torch.cuda.Stream()
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        with torch.cuda.stream(origin):
            graph.capture_begin(pool=pool)
            fork = torch.cuda.Event()
            fork.record(origin)
            side.wait_event(fork)
            with torch.cuda.stream(side):
                fake.launch()
                assert torch.cuda.is_current_stream_capturing()
            if join:
                done = torch.cuda.Event()
                done.record(side)
                origin.wait_event(done)
            errors = _try(graph.capture_end)
        if errors:
            end_failed_capture(graph, pool)
        assert bool(errors) != join, errors


def _try(fn: Any) -> list[str]:
    try:
        fn()
    except RuntimeError as e:
        return [str(e)]
    return []


# --- GPU twins -------------------------------------------------------------------------------------


class MatmulComm(torch.nn.Module):
    """A gemm, a "collective" (a copy on the comm stream) in a dbo_comm region, a yield, a read."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.eye(4) * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        with pb.dbo_comm(h):
            sent = h.flip(0) + 1
        pb.dbo_yield()
        return sent.flip(0) @ self.w


@pytest.mark.cuda
def test_cuda_micro_batched_capture_with_comm_regions_replays_correct_values():
    # twin of test_full_capture_forks_the_comm_stream_from_the_capture_stream_and_joins_it_back
    model = MatmulComm().cuda()
    wrapper = pb.wrap_model(model, CFG)
    x = torch.randn(6, 4, device="cuda")
    pb.mark_persistent(x)
    with torch.inference_mode():
        _step6 = lambda: _step_rows(wrapper, x)  # noqa: E731
        _step6()
        assert len(wrapper.ubatch_entries) == 1
        for _ in range(2):
            x.copy_(torch.randn(6, 4, device="cuda"))
            assert torch.allclose(_step6(), (x @ model.w + 1) @ model.w)


def _step_rows(wrapper: Any, x: torch.Tensor) -> torch.Tensor:
    with pb.set_forward_context(FULL, pb.BatchDescriptor(x.shape[0]), ubatch_slices=halves(x, 3)):
        return wrapper(x).clone()


@pytest.mark.cuda
def test_cuda_global_capture_refuses_cudamalloc_from_another_thread():
    # twin of test_double_global_capture_refuses_cudamalloc_from_another_thread_thread_local_does_not
    for mode, refused in (("global", True), ("thread_local", False)):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # nothing cached could serve the other thread's allocation
        stream, graph, pool = torch.cuda.Stream(), torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        errors: list[str] = []
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode=mode)
            torch.ones(1, device="cuda").add_(1)
            # an odd size the cache cannot serve: a fresh cudaMalloc on the other thread's default stream
            fresh = lambda: torch.empty((97 << 20) + 3, dtype=torch.uint8, device="cuda")  # noqa: E731
            t = threading.Thread(target=lambda: errors.extend(_try(fresh)))
            t.start(); t.join()  # noqa: E702
            ended = _try(graph.capture_end)
        if ended:  # a failed capture: end its routing as the platform does (2.11 leaves it on)
            end_failed_capture(graph, pool)
        assert bool(errors or ended) == refused, (mode, errors, ended)
        torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_an_event_wait_forks_a_stream_into_the_capture_and_a_wait_back_joins_it():
    # twin of test_double_an_event_wait_forks_a_stream_into_the_capture_and_a_wait_back_joins_it
    for join in (False, True):
        origin, side = torch.cuda.Stream(), torch.cuda.Stream()
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        a = torch.ones(4, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(origin):
            graph.capture_begin(pool=pool)
            fork = torch.cuda.Event()
            fork.record(origin)
            side.wait_event(fork)
            with torch.cuda.stream(side):
                a.add_(1)
            if join:
                done = torch.cuda.Event()
                done.record(side)
                origin.wait_event(done)
            errors = _try(graph.capture_end)
        if errors:  # the unjoined fork failed the capture: end its routing as the platform does
            end_failed_capture(graph, pool)
        assert bool(errors) != join, errors


@pytest.mark.cuda
def test_cuda_capture_without_warm_up_is_refused_before_any_thread_launches():
    # twin of test_capture_without_warm_up_is_refused_before_any_thread_launches
    wrapper = pb.wrap_model(MatmulComm().cuda(), CFG.replace(num_warmups=0))
    x = torch.randn(6, 4, device="cuda")
    pb.mark_persistent(x)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="never ran a step eagerly on the capture stream"):
        _step_rows(wrapper, x)
    torch.cuda.synchronize()
