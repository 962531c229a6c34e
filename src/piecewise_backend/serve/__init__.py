"""The engine for any model that follows the protocol (docs/engine.md): scheduling, sampling, the serving loop, speculative decoding."""

from .arguments import EngineArgs, check_generate
from .engine import Engine
from .loop import RequestOutput, ServingLoop, StepExecutor, StepInfo
from .model_runner import KVLayout, ModelRunner
from .sampling import SamplingParams
from .scheduler import Request, Scheduler
from .speculative import RoundInfo, SpecStats, SpeculativeEngine
from .token_rules import TokenRules

__all__ = [
    "Engine",
    "EngineArgs",
    "KVLayout",
    "SamplingParams",
    "TokenRules",
    "RequestOutput",
    "StepInfo",
    "SpeculativeEngine",
    "RoundInfo",
    "SpecStats",
    "ModelRunner",
    "ServingLoop",
    "StepExecutor",
    "Request",
    "Scheduler",
    "check_generate",
]
