# A slim image with fuse3 and ckptfs. Run with FUSE access, e.g.:
#   docker run --device /dev/fuse --cap-add SYS_ADMIN -v /nvme/ckptfs:/var/cache/ckptfs \
#     -e AWS_REGION=us-east-1 ckptfs mount s3://bucket/prefix /mnt/checkpoints --foreground
FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libfuse3-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ckptfs ./ckptfs
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends fuse3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels && mkdir -p /mnt/checkpoints
ENTRYPOINT ["ckptfs"]
CMD ["--help"]
