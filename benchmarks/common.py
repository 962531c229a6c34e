"""Timing harness shared by the benchmarks: interleaved repetitions, paired ratios, tables.

Every benchmark times its variants *side by side*: each repetition runs one block of
calls per variant, in a random order drawn afresh for every repetition (seeded), so a
background load that comes and goes hits every variant alike and no variant always runs
right after the same other one (caches carry over from block to block). Ratios and added costs
are computed per repetition (paired with the baseline's block of the same repetition)
and then summarized as a median with the interquartile range (p25..p75).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- variants


@dataclasses.dataclass
class Variant:
    """One thing to time: ``fn(*args)`` called ``number`` times per block, inside ``context()``.

    ``context`` (a zero-argument context-manager factory) is entered around each block,
    not around each call, so setting a forward context costs nothing per call.
    ``sync`` (e.g. ``torch.cuda.synchronize``) is called before the clock starts and
    before it stops.
    """

    name: str
    fn: Callable[..., Any]
    args: tuple = ()
    context: Callable[[], contextlib.AbstractContextManager] | None = None
    sync: Callable[[], Any] | None = None
    number: int | None = None  # calls per block; None: calibrated
    clock: str = "thread"  # "thread": CPU time of this thread; "wall": perf_counter


@dataclasses.dataclass
class Samples:
    """Per-call seconds of each block, one sample per repetition, per variant."""

    names: list[str]
    times: dict[str, list[float]]
    number: dict[str, int]

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def quartiles(self, name: str) -> tuple[float, float]:
        return quartiles(self.times[name])

    def ratios(self, name: str, baseline: str) -> list[float]:
        return [a / b for a, b in zip(self.times[name], self.times[baseline])]

    def diffs(self, name: str, baseline: str) -> list[float]:
        return [a - b for a, b in zip(self.times[name], self.times[baseline])]


def spawn_child(module: str, args: Sequence[str], inductor_cache: str, timeout: float) -> dict:
    """Run ``python -m <module> --child <args>`` in a fresh process with its own Inductor cache dir;
    returns the JSON its last stdout line holds, plus ``process_s`` (the child's wall time)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, "--child", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def launch_ranks(script: str, args: Sequence[str], marker: str, nproc: int = 2, timeout: float = 900) -> Any:
    """Run ``benchmarks/<script> --child <args>`` on ``nproc`` ranks under torchrun (one thread each); returns
    the JSON rank 0 printed after ``marker`` on a line of its own."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "benchmarks" / script), "--child", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"ranks failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if marker in ln), None)
    if line is None:
        raise RuntimeError(f"rank 0 printed no result line: {proc.stdout.strip()[-2000:]}")
    return json.loads(line.split(marker, 1)[1])


def quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


CLOCKS: dict[str, Callable[[], float]] = {"thread": time.thread_time, "wall": time.perf_counter}


def _block(v: Variant, number: int) -> float:
    fn, args, clock = v.fn, v.args, CLOCKS[v.clock]
    ctx = v.context() if v.context is not None else contextlib.nullcontext()
    with ctx:
        if v.sync is not None:
            v.sync()
        loop = itertools.repeat(None, number)
        t0 = clock()
        for _ in loop:
            fn(*args)
        if v.sync is not None:
            v.sync()
        t1 = clock()
    return (t1 - t0) / number


def calibrate(v: Variant, target_s: float) -> int:
    """Calls per block so that one block lasts about ``target_s``."""
    number = 1
    while True:
        per_call = _block(v, number)
        if per_call * number >= target_s / 5 or number >= 1 << 24:
            return max(1, min(1 << 24, int(target_s / max(per_call, 1e-9))))
        number *= 10


def measure(
    variants: Sequence[Variant],
    *,
    reps: int,
    target_s: float = 0.02,
    deadline: float | None = None,
) -> Samples:
    """Time ``variants`` interleaved: ``reps`` repetitions, one block per variant each.

    The order is shuffled every repetition. Garbage collection is off during the blocks.
    Stops early (keeping at least 3 repetitions) once ``time.monotonic()`` passes ``deadline``.
    """
    number = {}
    for v in variants:
        _block(v, 1)  # warm-up call
        number[v.name] = v.number or calibrate(v, target_s)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    order = list(variants)
    rng = random.Random(0)  # reproducible orders
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for rep in range(reps):
            if deadline is not None and rep >= 3 and time.monotonic() > deadline:
                break
            rng.shuffle(order)  # a fresh order each repetition: no variant always follows the same one
            for v in order:
                times[v.name].append(_block(v, number[v.name]))
    finally:
        if gc_was_enabled:
            gc.enable()
    return Samples([v.name for v in variants], times, number)


# ----------------------------------------------------------------------------- formatting


def fmt_time(seconds: float) -> str:
    """A duration with a unit that keeps 3 significant digits."""
    a = abs(seconds)
    if a < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if a < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    if a < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def fmt_spread(xs: Sequence[float], scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
    """``median [p25, p75]`` of ``xs * scale``."""
    lo, hi = quartiles(xs)
    med = statistics.median(xs)
    return f"{med * scale:.{digits}f} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]{unit}"


def fmt_ratio(xs: Sequence[float]) -> str:
    lo, hi = quartiles(xs)
    return f"{statistics.median(xs):.3f}x [{lo:.3f}, {hi:.3f}]"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (also readable as plain text)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [line(cells[0]), "| " + " | ".join("-" * w for w in widths) + " |"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def verdict(value: float, goal: float) -> str:
    return "ok" if value <= goal else "ABOVE GOAL"


@dataclasses.dataclass
class Section:
    """One benchmark's result: a markdown block (printed, and written to docs/benchmarks.md)."""

    title: str
    body: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def markdown(self, level: int = 3) -> str:
        return f"{'#' * level} {self.title}\n\n{self.body.strip()}\n"


# ----------------------------------------------------------------------------- environment


def environment(device: str = "cpu") -> dict[str, str]:
    """What the numbers depend on: versions, device, threads, load, commit."""
    import torch

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "torch threads": str(torch.get_num_threads()),
        "cpu": _cpu_name(),
        "cpu cores": str(os.cpu_count()),
    }
    with contextlib.suppress(OSError, AttributeError):
        env["load average (1 min) at start"] = f"{os.getloadavg()[0]:.2f}"
    if device.startswith("cuda"):
        with contextlib.suppress(Exception):
            env["gpu"] = torch.cuda.get_device_name()
            env["cuda"] = str(torch.version.cuda)
    env["commit"] = _git_commit()
    return env


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" (with uncommitted changes)" if dirty else "")


def env_table(env: dict[str, str]) -> str:
    return table(["what", "value"], list(env.items()))


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Silence the library's info logs (capture progress) while benchmarking."""
    import logging

    logger = logging.getLogger("piecewise_backend")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def raise_recompile_limits() -> None:
    """Several compiled variants of one model share a code object: lift Dynamo's per-code limit.

    Without this, the 9th cache entry of ``ToyLlama.forward`` (across all backends) would
    silently fall back to eager and the timings would lie.
    """
    import torch._dynamo.config as dc

    for name, value in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 4096),
                        ("accumulated_cache_size_limit", 4096)):
        if hasattr(dc, name):
            with contextlib.suppress(Exception):
                setattr(dc, name, max(getattr(dc, name), value))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
