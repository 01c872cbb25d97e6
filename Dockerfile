# A slim image with fuse3 and ckptfs, FUSE passthrough included (libfuse 3.18 and pyfuse3 built
# from third_party/ by scripts/install_fuse.sh). Run with FUSE access, e.g.:
#   docker run --device /dev/fuse --cap-add SYS_ADMIN -v /nvme/ckptfs:/var/cache/ckptfs \
#     -e AWS_REGION=us-east-1 ckptfs mount s3://bucket/prefix /mnt/checkpoints --foreground
# (CAP_SYS_ADMIN also lets the daemon register backing files: passthrough needs it.)
FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc pkg-config \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ckptfs ./ckptfs
COPY scripts/install_fuse.sh ./scripts/
COPY third_party/libfuse ./third_party/libfuse
COPY third_party/pyfuse3 ./third_party/pyfuse3
# libfuse into /usr/local/lib, the patched pyfuse3 as a wheel; then ckptfs and the rest.
RUN bash scripts/install_fuse.sh python3 --wheel-dir /wheels \
    && pip wheel --no-cache-dir --find-links /wheels --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends fuse3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/lib/libfuse3.so* /usr/local/lib/
COPY --from=build /wheels /wheels
RUN ldconfig && pip install --no-cache-dir --no-index --find-links /wheels ckptfs \
    && rm -rf /wheels && mkdir -p /mnt/checkpoints \
    && python -c 'import pyfuse3, sys; sys.exit(not pyfuse3.PASSTHROUGH_SUPPORTED)'
ENTRYPOINT ["ckptfs"]
CMD ["--help"]
