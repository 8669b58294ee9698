"""dspark: DSpark speculative decoding for DeepSeek-V4, in PyTorch + Triton."""
__version__ = "0.1.0"     # setup.py reads it from here

from .config import ConfigError, ModelConfig
from .engine import Engine
from .engine_config import EngineConfig, EngineConfigError
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineConfigError", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "ModelConfig", "ConfigError", "__version__"]
