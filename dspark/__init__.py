"""dspark: DSpark speculative decoding for DeepSeek-V4, in PyTorch + Triton."""
from .config import ConfigError, ModelConfig

__all__ = ["ModelConfig", "ConfigError"]
