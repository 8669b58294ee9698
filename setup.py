import os
import re

from setuptools import find_packages, setup

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "dspark", "__init__.py")) as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

SERVE = ["fastapi>=0.110", "uvicorn>=0.29", "prometheus_client>=0.20", "jinja2>=3.1.6"]

setup(
    name="dspark",
    version=VERSION,
    description="DSpark speculative decoding engine for DeepSeek-V4 (PyTorch + Triton)",
    # the shipped model is data inside the package (dspark/assets/default)
    packages=find_packages(include=["dspark", "dspark.*"]) + ["dspark.assets.default"],
    package_data={"dspark.assets.default": ["*"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11,<2.15",
        # the kernels: compiled on CUDA, interpreted (TRITON_INTERPRET=1) on CPU; CPU paths such
        # as tensor_parallel_size=2 import them too
        "triton>=3.2",
        "safetensors>=0.4",
        "numpy>=1.24",
        "tokenizers>=0.19",
        "tqdm>=4.60",
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-xdist>=3.5", "hypothesis>=6.100", "transformers>=5.17", "scipy>=1.10",
                 "matplotlib>=3.7", "openai>=1.40", "httpx>=0.27", *SERVE],
        # OpenAI-compatible HTTP server (python -m dspark.serve / dspark serve), chat templates
        "serve": SERVE,
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["dspark=dspark.cli:main"]},
)
