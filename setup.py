from setuptools import find_packages, setup

setup(
    name="dspark",
    version="0.1.0",
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
        "test": ["pytest>=7", "hypothesis>=6.100", "transformers>=5.17", "scipy>=1.10",
                 "matplotlib>=3.7"],
        "plot": ["matplotlib>=3.7"],
    },
)
