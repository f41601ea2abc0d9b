"""pip packaging for glmjax: the model library, its kernels, the RL loop and the environments.

    pip install -e .            # library + `glmjax-train`
    pip install -e '.[test]'    # + pytest and the Hugging Face reference (CPU torch)
    pip install -e '.[serve]'   # + `glmjax-serve`, JetStream's gRPC protocol (grpcio, protobuf)
    pip install -e '.[ray]'     # + environment workers on Ray (env.backend="ray")
    pip install -e '.[gpu]'     # or '.[tpu]': JAX for the accelerator
"""

from setuptools import find_packages, setup

JAX_VERSION = "0.10.2"
RAY = "ray==2.60.0"

setup(
    name="glmjax",
    version="0.1.0",
    description="GLM-5 (MoE + MLA + DeepSeek sparse attention) and its RL post-training loop in JAX / Flax NNX",
    python_requires=">=3.11",
    packages=find_packages(include=["glmjax*", "pallas_kernels*", "rl*", "envs*", "tool_formats*"]),
    install_requires=[
        f"jax=={JAX_VERSION}",
        f"jaxlib=={JAX_VERSION}",
        "flax==0.12.8",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.8",
        "grain==0.2.18",
        "tensorstore==0.1.86",
        # every path of the jobs (workdir, checkpoints, exports, logs, task directories): local or gs://
        "etils[epath]",
        "ml-collections==1.1.0",
        "tensorboardX==2.6.5",
        "safetensors>=0.4",
        # a checkpoint's tokenizer and chat template (base.checkpoint, glmjax-serve --http-port)
        "transformers>=5.24,<6",
        "tokenizers>=0.22",
        "jinja2",
        # the `math` verifier's expression equivalence (envs/verifiers/expressions.py)
        "sympy>=1.12",
        # the OpenAI-compatible API (glmjax-serve --http-port) and task.agent episodes, whose
        # agent talks to the engine through it with the official client (envs/agents)
        "openai>=3.63",
        "fastapi>=0.165",
        "uvicorn>=0.55",
        "numpy>=2.0",
        "tqdm",
        "matplotlib",
        # a task's shell scripts are read with bash's maintained grammar (envs/image/shell_syntax.py)
        "tree-sitter>=0.23,<1",
        "tree-sitter-bash>=0.23",
        # the sandbox's python3 runs Harbor tasks' verifiers (`uvx pytest --ctrf ...`), as their images do
        "pytest",
        "pytest-json-ctrf",
        # a task's Dockerfile, read by Docker's own grammar (it wraps moby/buildkit's parser: envs/image/dockerfile.py)
        "dockerfile==3.4.0",
    ],
    extras_require={
        # torch is pinned to the release whose CPU wheel the test machines carry; any other
        # version pulls the CUDA build (gigabytes) just to run the Hugging Face reference.
        # nbclient, nbformat and ipykernel execute notebooks/ablations.ipynb (tests/notebooks/test_notebook.py).
        "test": ["pytest-xdist>=3.6", "torch==2.13.0", "transformers>=5.24,<6", "grpcio", "protobuf", "prometheus-client",
                 "nbclient", "nbformat", "ipykernel",
                 # an evaluation harness run against the OpenAI-compatible API
                 "httpx>=0.28", "inspect-ai>=0.3.285,<0.4",
                 # libtpu: the Mosaic kernels and glmjax-aot compile for TPU topologies on a CPU
                 # (tests/conftest.py keeps JAX_PLATFORMS=cpu for running)
                 f"jax[tpu]=={JAX_VERSION}",
                 # env.backend="ray", tested on a two-node cluster of the test machine
                 RAY],
        "serve": ["grpcio", "protobuf", "prometheus-client"],
        # env.backend="ray": episodes' sandboxes on Ray workers (envs/workers/ray_backend.py),
        # on this machine or a cluster whose nodes run the same installation
        "ray": [RAY],
        "gpu": [f"jax[cuda12]=={JAX_VERSION}"],
        # gs:// workdirs and task directories (glmjax/storage.py through etils.epath's fsspec backend)
        "gcs": ["gcsfs"],
        "tpu": [f"jax[tpu]=={JAX_VERSION}"],
    },
    entry_points={"console_scripts": ["glmjax-train=rl.cli:main", "glmjax-serve=rl.engine.cli:main", "glmjax-envs=envs.cli:main",
                                        "glmjax-aot=rl.aot:main"]},
)
