"""dspark: DSpark speculative decoding for DeepSeek-V4, in PyTorch + Triton."""
from .config import ConfigError, ModelConfig
from .engine import Engine, RequestOutput
from .engine_config import EngineConfig, EngineConfigError
from .sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineConfigError", "SamplingParams", "RequestOutput",
           "ModelConfig", "ConfigError"]
