# archway: the admission webhook / scheduler extender / certificate bootstrap image.
# Build: docker build -t ghcr.io/archway/archway:0.1.0 .
# Stage 1 installs archway and its dependencies into a virtualenv; stage 2 copies only that venv
# onto the same slim Python base, so no compiler, pip cache or source tree ends up in the image.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/archway
WORKDIR /src
COPY pyproject.toml README.md ./
COPY registry/ registry/
COPY archway/ archway/
COPY webhook/ webhook/
COPY extender/ extender/
COPY certs/ certs/
RUN /opt/archway/bin/pip install . \
 && /opt/archway/bin/archway --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="archway" \
      org.opencontainers.image.description="Architecture-aware pod placement for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/archway /opt/archway
# 65532: the conventional "nonroot" uid/gid; the chart runs with the same ids.
RUN groupadd --system --gid 65532 archway \
 && useradd --system --uid 65532 --gid 65532 --home-dir /var/lib/archway --no-create-home \
            --shell /usr/sbin/nologin archway
ENV PATH=/opt/archway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["archway"]
CMD ["serve", "--bind", "0.0.0.0:8443"]
