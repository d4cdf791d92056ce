from setuptools import find_packages, setup

setup(
    name="hyperacc",
    version="0.1.0",
    description="FSDP2 training for large language models on Ascend NPUs, CUDA GPUs and CPUs, "
                "launched with accelerate.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hyperacc", "hyperacc.*"]),
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.6",
        "accelerate>=1.0",
        # 5.23: transformers.distributed.expert_parallel.apply_expert_parallelism(..., ep_implementation=)
        # (EP); tensor_parallel's styles (TP) and the fused MoE experts / experts_implementation also 5.x.
        "transformers>=5.23",
        "datasets>=2.18",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        "numpy",
        "pyyaml",
        "omegaconf>=2.4",
        "tqdm",
        "xxhash>=3.0",
    ],
    extras_require={
        # the docs extra too: tests/test_docs.py builds the site with --strict, so CI (make test) does
        "test": ["pytest>=7", "pytest-xdist>=3", "torchdata>=0.8", "megatron-core==0.16.1", "peft>=0.21,<0.22", "trl>=1.16,<1.17", "import-linter>=2.1",
                 "mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings-python>=1.10"],
        "peft": ["peft>=0.21"],
        "trl": ["trl>=1.16"],
        "streaming": ["torchdata>=0.8"],    # accelerate's use_stateful_dataloader (map-style positions)
        "npu": ["torch-npu"],
        "tensorboard": ["tensorboard"],
        "plot": ["matplotlib"],
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings-python>=1.10"],
    },
)
