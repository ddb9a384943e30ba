"""Runtime: kernel backends, host-side cache management, executors and the engine.

Heavy optional dependencies (onnxruntime, IPEX, xFormers) are imported only where used.

    from attnexport.runtime import Engine, SamplingParams, TorchExecutor
    engine = Engine(TorchExecutor(model))          # an eager module, or
    engine = Engine.from_path("out/")             # an export dir / .onnx / .pt2
    outputs = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
"""

from attnexport.runtime.config import CacheConfig, EncoderDecoderConfig, SchedulerConfig
from attnexport.runtime.engine import Engine, EngineStats
from attnexport.runtime.executors.base import Executor
from attnexport.runtime.executors.ort_executor import OrtExecutor
from attnexport.runtime.executors.torch_executor import TorchExecutor
from attnexport.runtime.loading import engine_from_path, load_executor
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
