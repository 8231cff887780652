from setuptools import find_packages, setup

setup(
    name="little-horse",
    version="0.1.0",
    description="Hand-written Triton kernels (fused attention, MLP, norms) behind drop-in PyTorch layers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # horse is the one top-level package: bench/ and tests/ run from a checkout. The kernels live in
    # horse.kernels, not a top-level `kernels`: that is the import name of Hugging Face's package,
    # which transformers imports.
    packages=find_packages(include=["horse", "horse.*"]),
    # horse: the trainer's built-in corpus; the kernel families: their config tables, beside their kernels
    package_data={
        "horse": ["corpus/*.txt"],
        "horse.kernels.attention": ["configs.json"],
        "horse.kernels.mlp": ["configs.json"],
    },
    python_requires=">=3.11",  # tomllib (bench gates)
    # Loose ranges: a user's CUDA build of PyTorch brings its own Triton, and we keep both.
    # safetensors: the trainer's checkpoints; tqdm: its progress bar.
    install_requires=["torch>=2.9", "triton>=3.5", "numpy", "safetensors", "tqdm"],
    # ruff pinned: its formatter changes between releases, and CI checks formatting.
    # matplotlib draws the bench suite's plots (and is tested with it); transformers and tokenizers
    # build the Hugging Face models that horse.hf's conversions and horse.hf.apply are checked against,
    # accelerate lets transformers.Trainer run (horse.hf.apply's three-step Trainer test); pytest-xdist
    # runs the tests on every core (-n auto). pytest 9.2 gives nodes structured ids that xdist 3.8's
    # --dist loadgroup cannot mark, so it spreads an xdist_group over every worker without a word
    # (pytest-dev/pytest-xdist#1386; tests/conftest.py stops a run where that happens).
    extras_require={
        "test": [
            "pytest>=8,<9.2",
            "pytest-benchmark>=4",
            "pytest-xdist>=3",
            "ruff==0.17.6",
            "matplotlib",
            "transformers",
            "tokenizers",
            "accelerate",
        ]
    },
)
