"""Packaging: installs ``simplefsdp`` and the Inductor passes under ``simplefsdp.passes``."""

from setuptools import setup

setup(
    name="simplefsdp",
    version="0.1.0",
    description="Compiler-first SimpleFSDP for PyTorch: DTensor parameters, traced collectives, Inductor passes",
    python_requires=">=3.10",
    packages=[
        "simplefsdp",
        "simplefsdp.moe",
        "simplefsdp.models",
        "simplefsdp.baselines",
        "simplefsdp.train",
        "simplefsdp.passes",
    ],
    package_dir={"simplefsdp.passes": "passes"},
    install_requires=["torch>=2.11"],
    extras_require={"dev": ["pytest", "expecttest", "tlparse", "matplotlib", "transformers", "accelerate"], "plot": ["matplotlib"], "hf": ["transformers", "accelerate"]},
    entry_points={
        "console_scripts": ["simplefsdp-train=simplefsdp.train.cli:main", "simplefsdp-compare=simplefsdp.train.compare:main"]
    },
)
