"""scripts/gpu_check.sh and its step table, where there is no GPU.

* Without CUDA the check fails at the gate at once: every CUDA test would skip, pytest would return
  0, and a machine without a usable GPU would read as a pass.
* ``--plan`` runs anywhere: from a copy of what the device tool sends (tracked and untracked-not-ignored
  files) and a Python that lacks the package, it installs the tree, resolves the backend by name and
  counts each step's tests; it fails when the entry point is gone, a step has no test, or the budgets
  exceed GPU_CHECK_SECONDS. The planning and verdict logic is tested in-process on small fake steps.
(On a GPU the script runs the whole check: these tests skip there.)
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the whole check")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_check, gpu_steps, gpu_collect = load("gpu_check"), load("gpu_steps"), load("gpu_collect")
Step = gpu_steps.Step


def test_gpu_check_fails_at_the_gate_without_cuda(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    env.pop("GPU_CHECK_DRY_RUN", None)
    start = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout
    assert "FAIL gate: no CUDA device" in proc.stdout.splitlines()
    assert elapsed < 60, f"the gate took {elapsed:.0f} s"
    assert "FAIL gate: no CUDA device" in (tmp_path / "summary.txt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.log", "summary.txt"]  # no step ran


def test_gpu_smoke_fails_without_cuda():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_smoke.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "FAIL smoke: no CUDA device" in proc.stdout


# ---------------------------------------------------------------- the step table


def test_the_step_table_fits_its_budget_and_runs_the_headline_first():
    steps = gpu_steps.STEPS
    one_gpu = [s for s in steps if s.gpus == 1]
    assert gpu_steps.GATE_S + sum(s.budget_s for s in one_gpu) <= gpu_check.DEFAULT_SECONDS == 480
    names = [s.name for s in steps]
    assert names[:2] == ["smoke", "headline"] and names.index("rules") < names.index("cuda") < names.index("memory")
    assert all(s.why for s in steps), "every budget says what it is sized from"
    hf_subprocesses = [s for s in steps if s.kind == "command" and "hf_generate.py" in " ".join(s.command)]
    assert all("--arch" in s.command for s in hf_subprocesses)  # one arch per --check step
    assert len([s for s in hf_subprocesses if s.gpus == 1]) == 1  # the 2-GPU plan adds the --tp run
    for s in steps:  # every file a step names is in the tree
        for t in s.tests:
            assert (ROOT / t.split("::")[0]).exists(), (s.name, t)
        scripts = [a for a in s.command if a.endswith(".py")] + [
            a.replace(".", "/") + ".py" for i, a in enumerate(s.command) if i and s.command[i - 1] == "-m"
            and a.startswith("benchmarks.")]
        for script in scripts:
            assert (ROOT / script).exists(), (s.name, script)


def test_a_step_is_either_pytest_or_a_command_with_a_budget():
    with pytest.raises(ValueError, match="exactly one of tests= .* or command="):
        Step("both", 10, "x", tests=("tests/a.py",), command=("true",))
    with pytest.raises(ValueError, match="budget positive, got 0"):
        Step("free", 0, "x", command=("true",))
    assert Step("t", 5, "x", tests=("tests/a.py",)).kind == "pytest"


def test_the_collector_selects_as_pytest_does():
    ids = ["tests/kv/test_kv.py::test_a", "tests/kv/test_kv.py::test_b[cuda-x]", "tests/kvx/test_y.py::test_c"]
    assert [i for i in ids if gpu_collect.selected(i, ["tests/kv"])] == ids[:2]
    assert [i for i in ids if gpu_collect.selected(i, ["tests/kv/test_kv.py::test_b"])] == ids[1:2]
    assert not gpu_collect.selected("tests/kv/test_kv.py::test_ab", ["tests/kv/test_kv.py::test_a"])


# ---------------------------------------------------------------- planning and verdicts, in-process


@pytest.fixture
def check(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("PYTHON", sys.executable)
    monkeypatch.setenv("GPU_CHECK_SECONDS", "100")
    c = gpu_check.Check(plan=True)
    monkeypatch.setattr(c, "has_xdist", lambda: False)
    yield c
    shutil.rmtree(c.work, ignore_errors=True)


FAKE = [
    Step("smoke", 20, "x", command=("{py}", "scripts/gpu_smoke.py")),
    Step("rules", 30, "x", tests=("tests/platforms/test_cuda_double.py",)),
    Step("cuda", 30, "x", tests=("tests/gpu/test_cuda.py",), workers=4),
    Step("nccl", 99, "x", command=("true",), gpus=2),
]


def test_plan_prints_a_line_per_step_and_the_total(check, capsys, monkeypatch):
    monkeypatch.setattr(check, "count", lambda steps: {"rules": 10, "cuda": 44})
    assert check.run_plan(FAKE, 15) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"PLAN smoke 20 s command: {sys.executable} scripts/gpu_smoke.py" in lines
    assert any(re.fullmatch(r"PLAN rules 30 s 10 tests \(-m cuda tests/platforms/test_cuda_double.py\)", ln) for ln in lines)
    assert any(ln.startswith("PLAN cuda 30 s 44 tests") and "serial: pytest-xdist absent" in ln for ln in lines)
    assert "PLAN nccl: not run (needs 2 GPUs, 1 here)" in lines  # left out of the total on one GPU
    assert lines[-1] == "PLAN total 95 s of 100 s"


def test_plan_fails_over_budget_or_with_a_step_that_collects_nothing(check, capsys, monkeypatch):
    monkeypatch.setattr(check, "count", lambda steps: {"rules": 0, "cuda": 44})
    over = [*FAKE, Step("bench", 30, "x", command=("true",))]
    assert check.run_plan(over, 15) == 1
    out = capsys.readouterr().out
    assert "PLAN total 125 s of 100 s" in out
    assert "FAIL plan: the budgets add up to 125 s, over GPU_CHECK_SECONDS=100 s" in out
    assert "FAIL plan: step rules collects no test (-m cuda tests/platforms/test_cuda_double.py)" in out
    many = [Step(f"bench{i}", 1, "x", command=("{py}", "-m", "b", "--out", f"{{out}}/t{i}.md")) for i in range(6)]
    monkeypatch.setattr(check, "count", lambda steps: {})
    assert check.run_plan(many, 1) == 1
    assert "FAIL plan: the steps write 6 files to $OUT besides summary.txt, steps.log, junit.xml" in capsys.readouterr().out


def test_verdicts_count_tests_from_junit_and_no_test_run_is_a_failure(check, tmp_path, monkeypatch):
    check.plan, check.total = False, 300
    tests = tmp_path / "test_fake.py"
    tests.write_text(
        "import pytest\n\n@pytest.mark.cuda\ndef test_ok():\n    pass\n\n"
        "@pytest.mark.cuda\ndef test_skipped():\n    pytest.skip('needs a GPU')\n\n"
        "def test_unmarked():\n    pass\n"
    )
    steps = [
        Step("passes", 60, "x", tests=(f"{tests}::test_ok", f"{tests}::test_skipped")),
        Step("empty", 60, "x", tests=(f"{tests}::test_skipped",)),
        Step("ok", 10, "x", command=("{py}", "-c", "pass")),
        Step("bad", 10, "x", command=("{py}", "-c", "raise SystemExit(3)")),
        Step("hangs", 5, "x", command=("{py}", "-c", "import time; time.sleep(60)")),
    ]
    check.run_steps(steps)
    assert [v.split(" (")[0].split(":")[0] for v in check.verdicts] == [
        "PASS passes", "FAIL empty", "PASS ok", "FAIL bad", "TIMEOUT hangs"]
    assert check.verdicts[0].endswith("1 passed, 0 failed, 1 skipped")
    assert check.verdicts[1].startswith("FAIL empty: 0 tests ran (1 skipped")
    assert check.verdicts[3].endswith("exit status 3") and "killed at its limit of 5 s" in check.verdicts[4]
    assert gpu_check.junit_counts(check.out / "junit.xml") == (1, 0, 2)  # both pytest steps, merged
    assert check.finish() == 1


# ---------------------------------------------------------------- end to end, as the device tool sends the tree


def device_copy(dest: Path) -> Path:
    """What the device tool sends: tracked files and untracked files git does not ignore."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


HIDDEN = ("piecewise_backend", "__editable__.piecewise_backend", "__editable___piecewise_backend", "expecttest")


def python_without_the_package(tmp: Path) -> str:
    """An interpreter with this one's packages (torch, pytest, transformers) but neither piecewise_backend nor
    expecttest, as on the GPU machine: a venv whose site-packages links every entry of ours but those."""
    try:
        importlib.metadata.distribution("piecewise_backend")
    except importlib.metadata.PackageNotFoundError:
        if importlib.util.find_spec("expecttest") is None:
            return sys.executable
    venv = tmp / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True)
    target = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    for d in site.getsitepackages():
        for entry in Path(d).iterdir() if Path(d).is_dir() else ():
            if not entry.name.startswith(HIDDEN) and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
    return str(venv / "bin" / "python")


def test_plan_from_the_sent_tree_with_a_python_without_the_package(tmp_path):
    tree = device_copy(tmp_path / "tree")
    py = python_without_the_package(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPU_CHECK_SECONDS", "GPU_CHECK_STEPS")}
    env.update(PYTHON=py, OUT=str(tmp_path / "out"))
    probe = subprocess.run([py, "-c", "import importlib.util as u; print(u.find_spec('piecewise_backend'), "
                            "u.find_spec('expecttest'), u.find_spec('torch') is not None)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
    assert probe.stdout.split() == ["None", "None", "True"], probe
    proc = subprocess.run(["bash", str(tree / "scripts" / "gpu_check.sh"), "--plan"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("OK piecewise_breakable -> piecewise_backend.backend:piecewise_breakable") and
               str(tree / "src") in ln for ln in lines), proc.stdout
    counted = {m[1]: int(m[2]) for ln in lines if (m := re.match(r"PLAN (\w+) \d+ s (\d+) tests", ln))}
    pytest_steps = {s.name for s in gpu_steps.STEPS if s.kind == "pytest"}
    assert set(counted) == pytest_steps and all(counted.values()), counted
    total = re.fullmatch(r"PLAN total (\d+) s of 480 s", lines[-1])
    assert total and int(total[1]) <= 480, lines[-1]

    # the same tree without the entry point: the gate names the cause, the plan fails
    pyproject = tree / "pyproject.toml"
    text = pyproject.read_text()
    cut = re.sub(r"\[project\.entry-points\.torch_dynamo_backends\]\n[^\n]*\n", "", text)
    assert cut != text
    pyproject.write_text(cut)
    proc = subprocess.run(["bash", str(tree / "scripts" / "gpu_check.sh"), "--plan"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert ("FAIL gate: backend 'piecewise_breakable' does not resolve by name: no torch_dynamo_backends entry point "
            "named piecewise_breakable") in proc.stdout, proc.stdout
    assert "PLAN total" not in proc.stdout


# ---------------------------------------------------------------- the GPU twins themselves


def test_cuda_marked_tests_use_no_fixture_they_do_not_request():
    """A GPU twin that names a module's fixture function without requesting it (the CPU test's ``fake``)
    fails only on the GPU: caught here from the source, on every machine."""
    problems = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        fixtures = {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and any(
            "fixture" in ast.unparse(d) for d in f.decorator_list)}
        module_cuda = any(isinstance(n, ast.Assign) and "mark.cuda" in ast.unparse(n.value) for n in tree.body
                          if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets))
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test"):
                continue
            if not (module_cuda or any("mark.cuda" in ast.unparse(d) for d in fn.decorator_list)):
                continue
            params = {a.arg for a in fn.args.args}
            used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            problems += [f"{path.relative_to(ROOT)}::{fn.name} uses fixture {name!r}" for name in
                         sorted((used & fixtures) - params)]
    assert not problems, problems


def test_the_gate_writes_the_dist_info_by_hand_where_pip_cannot_build(tmp_path):
    """setuptools < 70.1 without `wheel` cannot build the tree (no bdist_wheel): the metadata the steps need,
    the entry point above all, then comes from pyproject.toml alone."""
    assert gpu_check.write_dist_info(tmp_path) is None
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert dist.metadata["Name"] == "piecewise_backend"
    points = {ep.name: ep.value for ep in dist.entry_points if ep.group == "torch_dynamo_backends"}
    assert points == {"piecewise_breakable": "piecewise_backend.backend:piecewise_breakable"}
