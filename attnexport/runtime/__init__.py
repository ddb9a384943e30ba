"""Runtime: kernel backends, host-side cache management, executors and the engine.

Heavy optional dependencies (onnxruntime, IPEX, xFormers) are imported only where used. The
serving core (engine, scheduler, block manager, sampler, OrtExecutor) imports no torch;
``TorchExecutor`` is imported on first use of the name, so that ``import attnexport.runtime``
works without torch.

    from attnexport.runtime import Engine, SamplingParams, TorchExecutor
    engine = Engine(TorchExecutor(model))          # an eager module, or
    engine = Engine.from_path("out/")             # an export dir / .onnx / .pt2
    outputs = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
"""

from attnexport.runtime.config import CacheConfig, EncoderDecoderConfig, SchedulerConfig
from attnexport.runtime.engine import Engine, EngineStats, engine_from_path
from attnexport.runtime.executors.base import Executor
from attnexport.runtime.executors.ort_executor import OrtExecutor
from attnexport.runtime.loading import load_executor
from attnexport.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from attnexport.runtime.sampling import SamplingParams
from attnexport.runtime.text import Tokenizer, TokenizerError

__all__ = [
    "CacheConfig",
    "CompletionOutput",
    "EncoderDecoderConfig",
    "Engine",
    "EngineStats",
    "Executor",
    "OrtExecutor",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "Tokenizer",
    "TokenizerError",
    "TorchExecutor",
    "engine_from_path",
    "load_executor",
]


def __getattr__(name: str):
    # The torch side, imported when asked for (PEP 562).
    if name == "TorchExecutor":
        from attnexport.runtime.executors.torch_executor import TorchExecutor

        return TorchExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
