"""platforms/base.py: both platforms satisfy the Platform protocol, and the layers above use nothing else."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import piecewise_backend as pb
from piecewise_backend.platforms.base import Platform, Recording
from piecewise_backend.platforms.cuda.platform import CudaPlatform
from piecewise_backend.platforms.registry import get_platform
from piecewise_backend.platforms.simulated.platform import SimulatedPlatform

SRC = Path(pb.__file__).parent


def protocol_members(proto: type) -> list[str]:
    names = set()
    for klass in proto.__mro__:
        if klass is object or klass.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n in vars(klass) if not n.startswith("_")}
        names |= set(getattr(klass, "__annotations__", {}))
    return sorted(names)


MEMBERS = protocol_members(Platform)


def test_the_protocol_declares_what_the_capture_layer_calls():
    assert set(protocol_members(Recording)) == {"name", "capture_scope", "begin"}
    for name in ("memory", "describe", "new_pool", "capturing_into", "pool_memory", "fresh_pool", "release_cached",
                 "owner_test", "weak_ref", "warmup_scope", "warmed_step", "warm_up"):
        assert name in MEMBERS


@pytest.mark.parametrize("cls", [SimulatedPlatform, CudaPlatform], ids=lambda c: c.__name__)
@pytest.mark.parametrize("member", MEMBERS)
def test_both_platforms_satisfy_the_protocol(cls, member):
    assert hasattr(cls, member), f"{cls.__name__} lacks Platform.{member}"
    declared = getattr(Platform, member, None)
    if declared is None or not callable(declared):  # an attribute (name)
        assert isinstance(getattr(cls, member), str)
        return
    want = inspect.signature(declared).parameters
    have = inspect.signature(getattr(cls, member)).parameters
    for name, param in want.items():
        assert name in have, f"{cls.__name__}.{member} has no parameter {name!r}"
        assert have[name].kind == param.kind, f"{cls.__name__}.{member}: {name!r} is {have[name].kind}"
        assert (have[name].default is inspect.Parameter.empty) == (param.default is inspect.Parameter.empty), (
            f"{cls.__name__}.{member}: {name!r} default differs from the protocol's"
        )
    extra = [n for n, p in have.items() if n not in want and p.default is inspect.Parameter.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not extra, f"{cls.__name__}.{member} requires parameters the protocol does not pass: {extra}"


def test_the_simulated_platform_is_a_platform_at_run_time():
    platform = get_platform("simulated")
    assert isinstance(platform, Platform)
    with platform.warmup_scope(), platform.warmed_step():
        platform.warm_up(lambda: pytest.fail("the simulator warms nothing up"), (), {}, 3)
    with platform.fresh_pool() as scratch:
        assert platform.pool is scratch and platform.memory() == 0
        assert platform.owner_test()(object()) is False
    assert platform.pool is not scratch


class _UsedAttributes(ast.NodeVisitor):
    """Attributes read of a platform object (``platform.x``, ``self.platform.x``, ``getattr(platform, "x")``)."""

    def __init__(self) -> None:
        self.found: set[tuple[str, int, str]] = set()
        self.where = ""

    def visit_Attribute(self, node: ast.Attribute) -> None:
        value = node.value
        if (isinstance(value, ast.Name) and value.id == "platform") or (
            isinstance(value, ast.Attribute) and value.attr in ("platform", "_platform", "captured_on")
        ):
            self.found.add((self.where, node.lineno, node.attr))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and node.args:
            target = node.args[0]
            if isinstance(target, ast.Name) and "platform" in target.id and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant):
                    self.found.add((self.where, node.lineno, f"getattr:{name.value}"))
        self.generic_visit(node)


def test_the_layers_above_the_platforms_use_only_the_protocol():
    """Outside ``platforms/`` a platform is used through Platform's members only, and never probed with getattr."""
    visitor = _UsedAttributes()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "platforms":
            continue
        visitor.where = str(rel)
        visitor.visit(ast.parse(path.read_text()))
    assert visitor.found, "the scan found no platform use at all: it is broken"
    foreign = sorted(f"{where}:{line}: {attr}" for where, line, attr in visitor.found if attr not in MEMBERS)
    assert not foreign, "platform members used outside the Platform protocol:\n" + "\n".join(foreign)
