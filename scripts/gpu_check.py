"""The GPU check's runner (``bash scripts/gpu_check.sh [--plan]`` runs it; standard library only).

Run mode: the gate, then every step of scripts/gpu_steps.py in a process of its own with its own
timeout, one verdict line each (``PASS|FAIL|TIMEOUT <step> (<s> s)...``), a table of them at the
end; exit status 1 unless every step passed. Plan mode (``--plan``, any machine, CUDA or not):
the gate's setup and backend check, then one ``PLAN`` line per step, its budget and the number of
tests it would run (a command step: its command), and ``PLAN total <sum> s of <GPU_CHECK_SECONDS> s``;
exit status 1 if the budgets exceed GPU_CHECK_SECONDS, a pytest step collects no test, the steps
write more files to ``$OUT`` than the device brings back (8), or the backend does not resolve by name.

The gate makes the tracked tree usable as it is, without network, dependencies or a change to the
caller's environment: it installs the tree (``pip install --no-deps --no-build-isolation --no-index
--target``) into a temporary folder, whose dist-info carries the ``torch_dynamo_backends`` entry
point (the checkout's own egg-info is git-ignored and does not travel to the GPU machine; where pip
cannot build it, setuptools < 70.1 without ``wheel``, the gate writes that dist-info itself), puts it
on the steps' ``PYTHONPATH`` after the tree's ``src/``, and checks that
``torch.compile(f, backend="piecewise_breakable")`` resolves *by name* to this tree's code.

Environment: ``PYTHON`` (the interpreter with torch; default python3), ``OUT`` (results folder;
default a new /tmp folder), ``GPU_CHECK_SECONDS`` (default 480), ``GPU_CHECK_DRY_RUN=1`` (run the
steps without CUDA to check this machinery: every verdict is void), ``GPU_CHECK_STEPS`` (another
step table file, for testing the machinery). Files in ``$OUT`` (the device returns 8 at most):
summary.txt, steps.log (every step's output, appended as it runs), junit.xml (every pytest step's
results, merged after each) and the files the benchmark steps write.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SECONDS = 480
OWN_FILES = ("summary.txt", "steps.log", "junit.xml")
MAX_FILES = 8  # what the device tool brings back from $OUT

VERSIONS = r"""
import sys, torch
ok = torch.cuda.is_available()
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| available", ok)
if ok:
    print("gpu", torch.cuda.get_device_name(), "| count", torch.cuda.device_count())
print("GPUS", torch.cuda.device_count() if ok else 0)
"""

BY_NAME = r"""
import importlib.metadata as md, os, sys
root = os.path.realpath(sys.argv[1])
eps = [e for e in md.entry_points(group="torch_dynamo_backends") if e.name == "piecewise_breakable"]
if not eps:
    print("CAUSE no torch_dynamo_backends entry point named piecewise_breakable on this Python's path: the tree's "
          "pyproject.toml must declare it ([project.entry-points.torch_dynamo_backends]); the gate's install carries it")
    sys.exit(3)
import torch
from torch._dynamo.backends.registry import lookup_backend
try:
    fn = lookup_backend("piecewise_breakable")
    torch.compile(lambda x: x + 1, backend="piecewise_breakable")
except Exception as e:
    print(f"CAUSE torch.compile(f, backend='piecewise_breakable') fails: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    sys.exit(3)
import piecewise_backend as pb
if fn is not pb.piecewise_breakable:
    print(f"CAUSE the name resolves to {fn.__module__}.{fn.__qualname__}, not piecewise_backend.piecewise_breakable")
    sys.exit(3)
where = os.path.realpath(pb.__file__)
if not where.startswith(os.path.join(root, "src") + os.sep):
    print(f"CAUSE piecewise_backend is imported from {where}, not from this tree's src/")
    sys.exit(3)
dist = getattr(eps[0], "dist", None)
print("OK piecewise_breakable ->", eps[0].value, "| entry point from", dist.locate_file("") if dist else "?",
      "| code from", os.path.dirname(where))
"""


def load_steps(path: str | None) -> tuple[list[Any], int]:
    """The step table (scripts/gpu_steps.py, or the file ``path``): (steps, the gate's budget)."""
    file = Path(path) if path else ROOT / "scripts" / "gpu_steps.py"
    spec = importlib.util.spec_from_file_location("gpu_steps", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_steps", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    names = [s.name for s in module.STEPS]
    dupes = sorted({n for n in names if names.count(n) > 1} | ({"gate"} & set(names)))
    if dupes:
        raise ValueError(f"{file}: step names must be unique and not 'gate', got {dupes}")
    return list(module.STEPS), int(module.GATE_S)


def junit_counts(path: Path) -> tuple[int, int, int] | None:
    """(passed, failed, skipped) from a junit xml file; failed counts errors too. None if absent or unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = failed = skipped = 0
    for s in suites:
        tests += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def merge_junit(parts: list[tuple[str, Path]], dest: Path) -> None:
    """One junit file with every step's test suites (each renamed after its step)."""
    merged = ET.Element("testsuites")
    for name, path in parts:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        for suite in [root] if root.tag == "testsuite" else list(root.iter("testsuite")):
            suite.set("name", name)
            merged.append(suite)
    ET.ElementTree(merged).write(dest, encoding="utf-8", xml_declaration=True)


def write_dist_info(site: Path) -> str | None:
    """The installed metadata a build would write, from pyproject.toml alone: the name, version and entry
    points (the code itself comes from ``src/`` on ``PYTHONPATH``); the cause if it cannot."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return "Python 3.11+ (tomllib) is needed to read pyproject.toml"
    try:
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        name, version = project["name"], project["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as e:
        return f"pyproject.toml has no readable [project] name and version ({type(e).__name__}: {e})"
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = project.get("entry-points", {})
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) for group, points in groups.items()]
    (info / "entry_points.txt").write_text("\n".join(lines))
    return None

class Check:
    def __init__(self, plan: bool) -> None:
        self.plan = plan
        self.py = os.environ.get("PYTHON") or sys.executable
        self.total = int(os.environ.get("GPU_CHECK_SECONDS") or DEFAULT_SECONDS)
        self.dry = os.environ.get("GPU_CHECK_DRY_RUN") == "1"
        self.out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check."))
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_work."))
        self.summary, self.log = self.out / "summary.txt", self.out / "steps.log"
        self.summary.write_text("")
        self.log.write_text("")
        self.start = time.monotonic()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.verdicts: list[str] = []
        self.failed = False
        self.gpus = 0

    # ---------------------------------------------------------------- output
    def say(self, line: str) -> None:
        print(line, flush=True)
        with open(self.summary, "a") as f:
            f.write(line + "\n")

    def note(self, text: str) -> None:
        with open(self.log, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def elapsed(self) -> int:
        return int(time.monotonic() - self.start)

    def probe(self, code: str, *args: str, env: dict | None = None, timeout: int = 120) -> tuple[int, str]:
        try:
            proc = subprocess.run([self.py, "-c", code, *args], cwd=ROOT, env=env or self.env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124, f"timed out after {timeout} s"
        except OSError as e:
            return 127, f"cannot run {self.py}: {e}"
        self.note(proc.stdout + proc.stderr)
        return proc.returncode, proc.stdout.strip() or proc.stderr.strip()[-2000:]

    # ---------------------------------------------------------------- the gate
    def gate(self) -> bool:
        mode = "plan" if self.plan else "run"
        self.say(f"== gpu_check {mode} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, results in {self.out}")
        smi = shutil.which("nvidia-smi")
        if smi:
            proc = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                  capture_output=True, text=True)
            for line in (proc.stdout or proc.stderr).strip().splitlines():
                self.say(f"nvidia-smi: {line}")
        else:
            self.say("nvidia-smi: not found")
        rc, text = self.probe(VERSIONS)
        lines = text.splitlines()
        for line in lines:
            if not line.startswith("GPUS "):
                self.say(line)
        self.gpus = next((int(ln.split()[1]) for ln in lines if ln.startswith("GPUS ")), 0)
        if rc != 0:
            return self.gate_fails(f"{self.py} cannot import torch ({text.splitlines()[-1] if text else rc})")
        if self.gpus == 0 and not self.plan:
            if not self.dry:
                return self.gate_fails("no CUDA device")
            self.say("DRY RUN: gate bypassed without CUDA; the verdicts below say nothing about a GPU")
        cause = self.setup()
        if cause:
            return self.gate_fails(cause)
        rc, text = self.probe(BY_NAME, str(ROOT), env=self.env)
        if rc != 0:
            cause = next((ln[6:] for ln in text.splitlines() if ln.startswith("CAUSE ")), text.splitlines()[-1] if text else "")
            return self.gate_fails(f"backend 'piecewise_breakable' does not resolve by name: {cause}")
        self.say(text.splitlines()[-1])
        self.say(f"PASS gate ({self.elapsed()} s)")
        self.verdicts.append(f"PASS gate ({self.elapsed()} s)")
        return True

    def gate_fails(self, cause: str) -> bool:
        self.say(f"FAIL gate: {cause}")
        self.verdicts.append(f"FAIL gate: {cause}")
        self.failed = True
        return False

    def setup(self) -> str | None:
        """Install the tree into a temporary folder and point the steps' PYTHONPATH at it; the cause if it fails."""
        stage, site = self.work / "tree", self.work / "site"
        stage.mkdir()
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (ROOT / name).exists():
                shutil.copy2(ROOT / name, stage / name)
        shutil.copytree(ROOT / "src", stage / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
        pip = [self.py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "--no-compile",
               "--disable-pip-version-check", "--target"]
        self.note(f"===== gate: {' '.join(pip)} {site} {stage}")
        proc = subprocess.run([*pip, str(site), str(stage)], cwd=self.work, env=self.env, capture_output=True, text=True)
        self.note(proc.stdout + proc.stderr)
        if proc.returncode != 0:  # e.g. setuptools < 70.1 without `wheel` has no bdist_wheel
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            cause = write_dist_info(site)
            if cause:
                return f"installing the tree into {site} failed: {last[0]}; writing its dist-info failed: {cause}"
            self.say(f"note: pip could not install the tree ({last[0]}); wrote its dist-info by hand instead")
        paths = [str(ROOT / "src"), str(ROOT), str(site)]
        wheels = sorted((ROOT / ".whl").glob("*.whl"))
        if wheels:  # carried wheels (see docs/benchmarks.md): installed offline next to the tree
            proc = subprocess.run([*pip, str(self.work / "wheels"), *map(str, wheels)], env=self.env,
                                  capture_output=True, text=True)
            self.note(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                return f"installing the carried wheels in .whl/ failed: {(proc.stderr or proc.stdout).strip()[-300:]}"
            paths.append(str(self.work / "wheels"))
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        self.env["PYTHONPATH"] = os.pathsep.join(paths)
        return None

    # ---------------------------------------------------------------- plan and run
    def has_xdist(self) -> bool:
        return self.probe("import xdist")[0] == 0

    def runnable(self, steps: list[Any]) -> list[Any]:
        """The steps this machine runs (a planning machine without CUDA plans for the lent one: one GPU)."""
        here = max(self.gpus, 1)
        out = []
        for s in steps:
            if s.gpus > here:
                line = f"  -  {s.name}: not run (needs {s.gpus} GPUs, {here} here)"
                self.say(("PLAN " + line.strip(" -")) if self.plan else line)
            else:
                out.append(s)
        return out

    def count(self, steps: list[Any]) -> dict[str, int] | str:
        """Tests per pytest step, from one collection (scripts/gpu_collect.py); an error message if it fails."""
        pytest_steps = [s for s in steps if s.kind == "pytest"]
        if not pytest_steps:
            return {}
        selections = {s.name: {"tests": list(s.tests), "marker": s.marker} for s in pytest_steps}
        sel, counts = self.work / "selections.json", self.work / "counts.json"
        sel.write_text(json.dumps(selections))
        files = sorted({t.split("::")[0] for s in pytest_steps for t in s.tests})
        env = dict(self.env, GPU_CHECK_SELECTIONS=str(sel), GPU_CHECK_COUNTS=str(counts),
                   PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), self.env.get("PYTHONPATH", "")]))
        cmd = [self.py, "-m", "pytest", "--collect-only", "-q", "-p", "gpu_collect", "-p", "no:cacheprovider", *files]
        self.note(f"===== plan: {' '.join(cmd)}")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        self.note(proc.stdout + proc.stderr)
        if proc.returncode not in (0, 5) or not counts.exists():
            tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
            return f"collecting the steps' tests failed (exit status {proc.returncode}): {tail}"
        return json.loads(counts.read_text())

    def run_plan(self, steps: list[Any], gate_s: int) -> int:
        steps = self.runnable(steps)
        counts = self.count(steps)
        if isinstance(counts, str):
            self.say(f"FAIL plan: {counts}")
            return 1
        xdist = self.has_xdist()
        problems = []
        self.say(f"PLAN gate {gate_s} s setup, versions, backend by name")
        for s in steps:
            if s.kind == "command":
                self.say(f"PLAN {s.name} {s.budget_s} s command: {' '.join(self.argv(s))}")
                continue
            n = counts.get(s.name, 0)
            how = f", {s.workers} workers" if s.workers and xdist else (", serial: pytest-xdist absent" if s.workers else "")
            self.say(f"PLAN {s.name} {s.budget_s} s {n} tests (-m {s.marker} {' '.join(s.tests)}{how})")
            if n == 0:
                problems.append(f"step {s.name} collects no test (-m {s.marker} {' '.join(s.tests)})")
        written = sorted({a for s in steps for a in s.command if "{out}" in a})
        if len(OWN_FILES) + len(written) > MAX_FILES:
            problems.append(f"the steps write {len(written)} files to $OUT besides {', '.join(OWN_FILES)}: the device "
                            f"returns {MAX_FILES} at most ({', '.join(written)})")
        total = gate_s + sum(s.budget_s for s in steps)
        self.say(f"PLAN total {total} s of {self.total} s")
        if total > self.total:
            problems.append(f"the budgets add up to {total} s, over GPU_CHECK_SECONDS={self.total} s")
        for p in problems:
            self.say(f"FAIL plan: {p}")
        return 1 if problems else 0

    def argv(self, step: Any) -> list[str]:
        return [a.replace("{py}", self.py).replace("{out}", str(self.out)) for a in step.command]

    def run_steps(self, steps: list[Any]) -> None:
        xdist = any(s.workers for s in steps) and self.has_xdist()
        junits: list[tuple[str, Path]] = []
        for s in self.runnable(steps):
            left = self.total - self.elapsed() - 5
            limit = min(s.budget_s, left)
            if limit < 5:
                self.verdict(f"FAIL {s.name}: no time left ({left} s of GPU_CHECK_SECONDS={self.total} s)")
                continue
            if s.kind == "pytest":
                junit = self.work / f"junit_{s.name}.xml"
                cmd = [self.py, "-m", "pytest", "-m", s.marker, "-q", "-rfEs", "-p", "no:cacheprovider",
                       "-o", f"faulthandler_timeout={max(limit - 5, 5)}", f"--junitxml={junit}",
                       *(["-n", str(s.workers)] if s.workers and xdist else []), *s.tests]
            else:
                cmd = self.argv(s)
            rc, seconds, timed_out = self.execute(s.name, limit, cmd)
            took = f"{s.name} ({seconds} s)"
            if timed_out:
                self.verdict(f"TIMEOUT {took}: killed at its limit of {limit} s")
            elif s.kind == "command":
                self.verdict(f"PASS {took}" if rc == 0 else f"FAIL {took}: exit status {rc}")
            else:
                junits.append((s.name, junit))
                merge_junit(junits, self.out / "junit.xml")
                counts = junit_counts(junit)
                if counts is None:
                    self.verdict(f"FAIL {took}: exit status {rc}, no junit results")
                    continue
                passed, failed, skipped = counts
                tally = f"{passed} passed, {failed} failed, {skipped} skipped"
                if passed + failed == 0:
                    self.verdict(f"FAIL {s.name}: 0 tests ran ({skipped} skipped, {seconds} s)")
                elif rc == 0 and failed == 0:
                    self.verdict(f"PASS {took}: {tally}")
                else:
                    self.verdict(f"FAIL {took}: {tally}" + ("" if failed else f", exit status {rc}"))

    def execute(self, name: str, limit: int, cmd: list[str]) -> tuple[int, int, bool]:
        """Run ``cmd`` in a process group of its own, its output appended to steps.log; (rc, seconds, timed out)."""
        self.note(f"===== {name} (limit {limit} s): {' '.join(cmd)}")
        t0 = time.monotonic()
        with open(self.log, "a") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            timed_out = False
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=grace)
                        break
                    except subprocess.TimeoutExpired:
                        continue
                rc = proc.returncode if proc.returncode is not None else 137
        seconds = int(time.monotonic() - t0)
        self.note(f"===== {name}: exit status {rc} after {seconds} s" + (" (killed: limit)" if timed_out else ""))
        return rc, seconds, timed_out

    def verdict(self, line: str) -> None:
        self.verdicts.append(line)
        if not line.startswith("PASS"):
            self.failed = True
        self.say(line)

    def finish(self) -> int:
        self.say(f"== verdicts ({self.elapsed()} s in all)")
        for v in self.verdicts:
            self.say(f"  {v}")
        return 1 if self.failed else 0


def main(argv: list[str]) -> int:
    plan = "--plan" in argv
    unknown = [a for a in argv if a != "--plan"]
    if unknown:
        print(f"gpu_check: unknown argument(s) {unknown}; usage: bash scripts/gpu_check.sh [--plan]", file=sys.stderr)
        return 2
    steps, gate_s = load_steps(os.environ.get("GPU_CHECK_STEPS"))
    check = Check(plan)
    try:
        if not check.gate():
            return 1
        if plan:
            return check.run_plan(steps, gate_s)
        check.run_steps(steps)
        return check.finish()
    finally:
        shutil.rmtree(check.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
