"""platforms/registry.py: the one meaning of platform="auto", and the warning of a config that loses its graphs."""

from __future__ import annotations

import warnings

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.platforms import registry
from piecewise_backend.platforms.registry import config_platform_name, resolve_platform_name

M = pb.CUDAGraphMode


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def fresh_process(monkeypatch):
    """As if no config of this process had warned yet."""
    monkeypatch.setattr(registry, "_warned", [False])


def test_named_platforms_are_themselves_whatever_the_machine(no_gpu):
    for simulate in (False, True):
        assert resolve_platform_name("cuda", simulate=simulate) == "cuda"
        assert resolve_platform_name("simulated", simulate=simulate) == "simulated"
    with pytest.raises(ValueError, match="unknown platform 'tpu'"):
        resolve_platform_name("tpu")


def test_auto_is_cuda_with_a_gpu(gpu):
    assert resolve_platform_name("auto") == resolve_platform_name("auto", simulate=True) == "cuda"
    assert config_platform_name(pb.CompilationConfig()) == "cuda"
    assert config_platform_name(pb.CompilationConfig(compile_pieces="eager")) == "cuda"


def test_auto_without_a_gpu_is_the_simulator_only_where_the_caller_runs_on_it(no_gpu):
    assert resolve_platform_name("auto") is None
    assert resolve_platform_name("auto", simulate=True) == "simulated"
    # a config can run on the simulator with eager pieces (Inductor's fused kernels bypass what it records)
    assert config_platform_name(pb.CompilationConfig(compile_pieces="eager")) == "simulated"
    assert config_platform_name(pb.CompilationConfig()) is None
    assert pb.effective_mode(pb.CompilationConfig(compile_pieces="eager")) is M.FULL_AND_PIECEWISE
    # a compile-free capture always captures
    assert pb.BreakableGraph(platform="auto").platform.name == "simulated"


def test_a_config_without_graphs_for_want_of_a_gpu_warns_once_per_process(no_gpu, fresh_process):
    with pytest.warns(UserWarning, match="FULL_AND_PIECEWISE -> NONE") as caught:
        assert pb.effective_mode(pb.CompilationConfig()) is M.NONE
    assert len(caught) == 1 and 'platform="simulated"' in str(caught[0].message)  # says how to get graphs
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert pb.effective_mode(pb.CompilationConfig(cudagraph_mode="PIECEWISE")) is M.NONE
        pb.GraphRunner(torch.nn.Identity(), pb.CompilationConfig(), [pb.StaticInput("x")])
    assert [w for w in again if "no CUDA device" in str(w.message)] == []  # once per process


def test_no_warning_where_nothing_is_lost(no_gpu, fresh_process):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pb.effective_mode(pb.CompilationConfig(cudagraph_mode="NONE")) is M.NONE  # asked for no graphs
        assert pb.effective_mode(pb.CompilationConfig(compile_pieces="eager")) is M.FULL_AND_PIECEWISE  # simulated
        assert pb.effective_mode(pb.CompilationConfig(platform="simulated", compile_pieces="eager")) is (
            M.FULL_AND_PIECEWISE
        )
    assert [w for w in caught if "no CUDA device" in str(w.message)] == []
    assert registry._warned == [False]  # still to come for the first config that loses its graphs


def test_the_runner_warns_naming_its_mode_change(no_gpu, fresh_process):
    with pytest.warns(UserWarning, match=r"cudagraph_mode PIECEWISE -> NONE.*platform=\"simulated\""):
        runner = pb.GraphRunner(torch.nn.Identity(), pb.CompilationConfig(cudagraph_mode="PIECEWISE"),
                                [pb.StaticInput("x")])
    assert runner.mode is M.NONE
    assert runner.downgrades == ("platform 'auto' finds no GPU: cudagraph_mode PIECEWISE -> NONE",)


def test_platform_names_are_defined_once():
    import ast
    from pathlib import Path

    src = Path(pb.__file__).parent
    defined = [
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PLATFORMS" for t in node.targets)
    ]
    assert defined == ["config.py"]
    assert registry.PLATFORMS is pb.config.PLATFORMS == ("auto", "cuda", "simulated")
