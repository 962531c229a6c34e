"""Multi-rank test harness: run a function on N spawned ranks (gloo, a free port) under a deadline.

A rank that hangs fails the calling test after ``timeout_s`` instead of blocking CI; a rank
that dies without reporting fails it too. ``fn`` must be importable by the spawned ranks
(a module-level function of a test module).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from piecewise_backend.parallel import init_tensor_parallel

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, pg_timeout_s: float, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        mesh = init_tensor_parallel("gloo", timeout_s=pg_timeout_s)
        outcome = ("ok", fn(rank, mesh))
    except BaseException as e:  # noqa: BLE001 - reported to the test process
        outcome = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    results.put((rank, *outcome))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world: int = 2, *, timeout_s: float = 120, pg_timeout_s: float = 30
) -> list[tuple[str, Any]]:
    """Run ``fn(rank, mesh)`` on ``world`` spawned ranks; ``[(status, result or error text)]`` per rank.

    Fails the test when a rank has not reported within ``timeout_s`` (a hang) or died without reporting.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, port, pg_timeout_s, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    done: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world:
            missing = [r for r in range(world) if r not in done]
            if time.monotonic() > deadline:
                pytest.fail(f"ranks {missing} did not finish within {timeout_s} s (a hang); finished: {done}")
            try:
                rank, status, payload = results.get(timeout=1)
                done[rank] = (status, payload)
            except queue.Empty:
                dead = [r for r in missing if procs[r].exitcode is not None]
                if dead:
                    time.sleep(1)  # its report may still be in flight
                    while not results.empty():
                        rank, status, payload = results.get()
                        done[rank] = (status, payload)
                    if any(r not in done for r in dead):
                        codes = [procs[r].exitcode for r in dead]
                        pytest.fail(f"ranks {dead} died without reporting (exit codes {codes})")
    finally:
        for p in procs:
            p.join(timeout=3)  # every result is in hand: a slow teardown (a broken group) is not waited for
            if p.is_alive():
                p.kill()
    return [done[r] for r in range(world)]


def oks(outcomes: list[tuple[str, Any]]) -> list[Any]:
    """The results, once every rank reported "ok" (else fail with every rank's error text)."""
    assert all(status == "ok" for status, _ in outcomes), "\n\n".join(str(p) for _, p in outcomes)
    return [payload for _, payload in outcomes]
