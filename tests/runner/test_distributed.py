"""Tensor parallel on torch.distributed: collectives captured and replayed, faults reported, the example.

Multi-rank tests spawn real processes (``dist_harness.run_ranks``: gloo, a free port, a
deadline, so a hang fails the test instead of blocking CI). Worker functions live at module
level: the spawned ranks import this module to find them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import piecewise_backend as pb
from piecewise_backend.testing.sharding import ToyMLP, _group_rows, shard_mlp, shard_toy_llama
from piecewise_backend.runner.agreement import capture_agreement, check_same_step, init_tensor_parallel
from piecewise_backend.platforms.simulated import collectives as sim_collectives

from pbtest.dist_harness import oks, run_ranks
from pbtest.helpers import SIM, fresh_break, make_model, run

ROOT = Path(__file__).resolve().parents[2]
FULL, PIECEWISE = pb.CUDAGraphMode.FULL, pb.CUDAGraphMode.PIECEWISE


# --- rank workers ------------------------------------------------------------------


def _mlp_pair(mesh: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    return shard_mlp(ToyMLP(seed=0), mesh), ToyMLP(seed=0)


def _worker_replays_collectives(rank: int, mesh: Any) -> dict[str, Any]:
    model, ref = _mlp_pair(mesh)

    # The compile-free path: DTensor ops desugar under the recorder (the example covers compiled pieces).
    class WithBreak(torch.nn.Module):  # linear, all-reduce | eager break | linear, all-reduce
        def __init__(self) -> None:
            super().__init__()
            self.mlp = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(fresh_break(self.mlp(x)))

    def expected(x: torch.Tensor) -> torch.Tensor:
        return ref(ref(x) * 3 + 1)

    wrapped = pb.CUDAGraphWrapper(pb.BreakableCUDAGraphWrapper(WithBreak(), PIECEWISE, config=SIM), FULL, config=SIM)
    x = torch.zeros(4, 8)
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mode in (FULL, PIECEWISE):
            desc = pb.BatchDescriptor(4)
            x.copy_(torch.randn(4, 8, generator=g))
            recorded = sim_collectives.stats["recorded"]
            first = run(wrapped, mode, desc, x) - expected(x)  # lazily captured: replayed before returning
            recorded = sim_collectives.stats["recorded"] - recorded
            x.copy_(torch.randn(4, 8, generator=g))  # new data in the captured input: only a replay sees it
            replayed = sim_collectives.stats["replayed"]
            again = run(wrapped, mode, desc, x) - expected(x)
            entry = (wrapped if mode == FULL else wrapped.runnable).entries[desc]
            out[mode.name] = dict(
                segments=len(entry.segments),
                recorded=recorded,
                replayed=sim_collectives.stats["replayed"] - replayed,
                err_first=first.abs().max().item(),
                err_again=again.abs().max().item(),
            )
    return out


def _worker_capture_alone(rank: int, mesh: Any) -> float:
    """Rank 0 captures while rank 1 does not: a capture must not communicate (NCCL under capture does not run)."""
    model, ref = _mlp_pair(mesh)
    wrapped = pb.CUDAGraphWrapper(model, FULL, config=SIM)  # no compile: DTensor ops desugar under the recorder
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        if rank == 0:
            with pb.set_forward_context(FULL, pb.BatchDescriptor(2)):
                from piecewise_backend.capture import CaptureSession, run_session

                run_session(CaptureSession(wrapped.platform, breakable=False), model, (x,), {})
        dist.barrier()  # rank 1 waits here while rank 0 captured: no collective of the capture ran
        out = run(wrapped, FULL, pb.BatchDescriptor(2), x)  # both ranks: capture + replay together
        return (out - ref(x)).abs().max().item()


def _mlp_runner(debug_checks: bool, model: Any) -> pb.GraphRunner:
    config = SIM.replace(cudagraph_mode="FULL", capture_sizes=[2, 4], debug_checks=debug_checks)
    return pb.GraphRunner(model, config, [pb.StaticInput("x", shape=(8,), dtype=torch.float32)])


def _worker_mismatched_steps(rank: int, mesh: Any) -> list[str]:
    model, ref = _mlp_pair(mesh)
    runner = _mlp_runner(True, model)
    seen = []
    with torch.no_grad():
        runner.capture(progress=False)
        x = torch.randn(4, 8)
        assert (runner.run(x=x[:3]) - ref(x[:3])).abs().max() < 1e-5  # same step on both ranks: fine
        try:
            runner.run(x=x[: 2 + 2 * rank])  # rank 0 dispatches FULL(2), rank 1 FULL(4)
        except RuntimeError as e:
            seen.append(str(e))
        assert (runner.run(x=x[:4]) - ref(x[:4])).abs().max() < 1e-5  # nothing was left half-run
    return seen


class _FailOnRank(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, rank: int):
        super().__init__()
        self.inner, self.rank = inner, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from piecewise_backend.capture import capture_active

        if self.rank == 1 and capture_active():
            raise ValueError("model bug on rank 1 during capture")
        return self.inner(x)


def _worker_rank_fails_in_capture(rank: int, mesh: Any) -> str:
    model, _ = _mlp_pair(mesh)
    runner = _mlp_runner(False, _FailOnRank(model, rank))
    with torch.no_grad():
        try:
            runner.capture(progress=False)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
    return "no error"


def _worker_host_sync_in_collective(rank: int, mesh: Any) -> list[str]:
    from torch.distributed import _functional_collectives as funcol

    def reads_reduced_value(x: torch.Tensor) -> torch.Tensor:
        return x * funcol.all_reduce(x, "sum", mesh).sum().item()

    def eager_collective(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)  # blocks the host on the returned Work
        return y

    errors = []
    for fn in (reads_reduced_value, eager_collective):
        wrapped = pb.CUDAGraphWrapper(fn, FULL, config=SIM)
        try:
            run(wrapped, FULL, pb.BatchDescriptor(2), torch.ones(2, 2))
        except RuntimeError as e:
            errors.append(str(e))
    dist.barrier()  # the group still works: no rank is left inside a collective
    return errors


def _worker_peer_never_arrives(rank: int, mesh: Any) -> str:
    model, _ = _mlp_pair(mesh)
    if rank == 1:
        time.sleep(4)  # alive but absent: rank 0's all-reduce must time out, not wait forever
        return "slept"
    start = time.monotonic()
    try:
        with torch.no_grad():
            model(torch.randn(2, 8)) + 0  # using the result waits on the all-reduce
    except RuntimeError as e:
        return f"{time.monotonic() - start:.1f}s {e}"
    return "no error"


def _worker_warmup_collectives_waited(rank: int, mesh: Any) -> list[int]:
    """An eager DTensor step returns an AsyncCollectiveTensor, waited on when used; capture() drops its warm-ups'."""
    model, _ = _mlp_pair(mesh)
    registry = torch._C._distributed_c10d._get_work_registry_size  # collectives not waited on yet
    with torch.no_grad():
        before = registry()
        out = model(torch.randn(2, 8))
        pending = registry() - before  # the measure sees an unused result
        out + 0  # using it waits
        before = registry()
        _mlp_runner(False, model).capture(progress=False)  # warm-ups run eagerly (mode NONE)
    return [pending, registry() - before]


def _worker_different_capture_plans(rank: int, mesh: Any) -> str:
    """Ranks configured with different capture sizes (a model without collectives, so nothing hangs)."""
    config = SIM.replace(cudagraph_mode="FULL", capture_sizes=[2 + 2 * rank])
    runner = pb.GraphRunner(torch.nn.Linear(8, 8), config, [pb.StaticInput("x", shape=(8,), dtype=torch.float32)])
    try:
        with torch.no_grad():
            runner.capture(progress=False)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _worker_healthy_group(rank: int, mesh: Any) -> dict[str, Any]:
    """The scenarios that leave the group usable, in one spawn (starting ranks costs seconds each)."""
    results = {}
    for name, fn in [
        ("replays", _worker_replays_collectives),
        ("capture_alone", _worker_capture_alone),
        ("mismatched_steps", _worker_mismatched_steps),
        ("host_sync", _worker_host_sync_in_collective),
        ("different_plans", _worker_different_capture_plans),
        ("warmup_waited", _worker_warmup_collectives_waited),
    ]:
        try:
            results[name] = ("ok", fn(rank, mesh))
        except Exception as e:  # noqa: BLE001 - one scenario's failure must not hide the others
            results[name] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    return results


@pytest.fixture(scope="module")
def healthy() -> Callable[[str], list[Any]]:
    per_rank = oks(run_ranks(_worker_healthy_group, timeout_s=240))

    def scenario(name: str) -> list[Any]:
        return oks([r[name] for r in per_rank])

    return scenario


# --- tests -----------------------------------------------------------------------------


def test_collectives_replay_inside_full_and_piecewise_graphs(healthy):
    for result in healthy("replays"):
        full, piecewise = result["FULL"], result["PIECEWISE"]
        assert full["segments"] == 1, result  # both all-reduces inside one graph
        assert piecewise["segments"] == 3, result  # G E G: one all-reduce in each graph
        assert full["recorded"] == full["replayed"] == 2, result
        assert piecewise["recorded"] == piecewise["replayed"] == 2, result
        for r in (full, piecewise):
            assert r["err_first"] < 1e-5 and r["err_again"] < 1e-5, result


def test_capture_does_not_communicate(healthy):
    errors = healthy("capture_alone")
    assert all(e < 1e-5 for e in errors), errors


def test_ranks_dispatching_different_steps_fail_clearly_with_debug_checks(healthy):
    for seen in healthy("mismatched_steps"):
        assert len(seen) == 1, seen
        pattern = r"ranks dispatched different steps \(rank 0: FULL .*num_tokens=2.*rank 1: FULL .*num_tokens=4"
        assert re.search(pattern, seen[0]), seen


def test_capture_waits_on_its_warm_ups_collectives(healthy):
    # Left unwaited they stay in c10d's work registry: gloo warns "unwaited collective calls" at exit.
    for pending, after_capture in healthy("warmup_waited"):
        assert (pending, after_capture) == (1, 0)


def test_ranks_capturing_different_descriptors_fail_clearly(healthy):
    for msg in healthy("different_plans"):
        assert msg.startswith("PeerCaptureError: ranks captured different descriptors in the same slot"), msg
        assert "rank 0: FULL BatchDescriptor(num_tokens=2" in msg, msg
        assert "rank 1: FULL BatchDescriptor(num_tokens=4" in msg, msg


def test_rank_failing_during_capture_stops_every_rank():
    (s0, msg0), (s1, msg1) = run_ranks(_worker_rank_fails_in_capture, timeout_s=120)
    assert (s0, s1) == ("ok", "ok"), (msg0, msg1)
    assert msg1.startswith("ValueError: model bug on rank 1 during capture"), msg1
    # rank 0 finished its capture; the replay that follows needs rank 1, which left the group
    assert msg0.startswith("RuntimeError: simulated replay of collective _c10d_functional.all_reduce"), msg0
    assert "a peer rank stopped" in msg0, msg0


def test_host_sync_inside_captured_collective_fails_clearly(healthy):
    for errors in healthy("host_sync"):
        assert len(errors) == 2, errors
        assert errors[0].startswith("operation not permitted when stream is capturing"), errors[0]
        assert "_local_scalar_dense" in errors[0], errors[0]
        assert "c10d.allreduce_" in errors[1] and "host sync inside a captured collective" in errors[1], errors


def test_absent_peer_times_out_instead_of_hanging():
    (s0, msg0), (s1, msg1) = run_ranks(_worker_peer_never_arrives, timeout_s=120, pg_timeout_s=2)
    assert (s0, s1, msg1) == ("ok", "ok", "slept"), (msg0, msg1)
    seconds = float(msg0.split("s ", 1)[0])
    assert 1.5 < seconds < 4 and "timed out" in msg0.lower(), msg0


def _run_example(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "tensor_parallel.py"), "--check", "--layers", "1", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def test_example_two_ranks_check():
    proc = _run_example("--steps", "10")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    steps = re.findall(r"^step\s+\d+:.*-> (\w+)\s+max\|diff\| (\S+)$", proc.stdout, re.MULTILINE)
    assert len(steps) == 10 and {m for m, _ in steps} == {"FULL", "PIECEWISE"}, proc.stdout
    assert all(float(d) < 1e-3 for _, d in steps), proc.stdout
    assert "unwaited collective" not in proc.stderr, proc.stderr[-5000:]


def test_example_check_fails_when_a_shard_is_wrong():
    # Rank 1's shard of one o_proj weight is shifted by 0.01: every step's logits differ a little.
    proc = _run_example("--steps", "2", "--perturb-rank", "1")
    assert proc.returncode != 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    diffs = [float(d) for d in re.findall(r"^step\s+\d+:.* max\|diff\| (\S+)$", proc.stdout, re.MULTILINE)]
    assert len(diffs) == 2 and all(d > 1e-3 for d in diffs), proc.stdout
    assert "rank 0: sharded logits differ from the unsharded model" in proc.stderr, proc.stderr[-5000:]


# --- single-process -----------------------------------------------------------------------


def test_checks_are_no_ops_without_a_process_group():
    assert not dist.is_initialized()
    check_same_step(FULL, pb.BatchDescriptor(4))
    with capture_agreement(FULL, pb.BatchDescriptor(4)):
        pass
    with pytest.raises(ValueError, match="boom"), capture_agreement(FULL, pb.BatchDescriptor(4)):
        raise ValueError("boom")


def test_group_rows_gives_each_rank_its_slice_of_every_part():
    parts = [torch.arange(8).reshape(4, 2) + 100 * p for p in range(3)]  # q, k, v of 4 rows each
    grouped = _group_rows(torch.cat(parts), parts=3, ranks=2)
    rank1 = grouped[6:]  # rank 1's contiguous colwise shard
    assert torch.equal(rank1, torch.cat([p[2:] for p in parts]))


def test_sharding_refuses_sizes_the_ranks_do_not_divide():
    mesh = SimpleNamespace(size=lambda: 3)
    with pytest.raises(ValueError, match="ToyLlama num_heads 4 is not divisible by the tensor-parallel size 3"):
        shard_toy_llama(make_model(num_layers=1), mesh)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        init_tensor_parallel("gloo", timeout_s=0)
    with pytest.raises(ValueError, match="backend must be 'nccl' or 'gloo', got 'mpi'"):
        init_tensor_parallel("mpi")
