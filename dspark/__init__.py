"""dspark: DSpark speculative decoding for DeepSeek-V4, in PyTorch + Triton."""
from .config import ConfigError, ModelConfig
from .engine import Engine, RequestOutput
from .sampling import SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "ModelConfig", "ConfigError"]
