# archway: the admission webhook / scheduler extender / certificate bootstrap image.
#
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/archway:vX.Y.Z --push .
#
# or, with no container engine at all, `bash scripts/build-image.sh --push REF` (buildah; it makes
# both bases locally from Debian bookworm with mmdebstrap and passes them in as BASE/BUILD_BASE).
#
# Stage 1 runs on the BUILD machine's own architecture even for a foreign target: pip downloads
# the target architecture's wheels (every dependency has manylinux wheels, for any glibc up to the
# base's own) and unpacks them into /opt/archway, so no step ever runs under emulation. Stage 2 only copies that onto the slim
# runtime base: no compiler, no pip cache, no source tree, no tests, no RUN step at all.
# BUILD_BASE and BASE must carry the same Python (same version, same path): the byte code and
# the `archway` script's #! line are made in stage 1 and used in stage 2. The byte code never
# compares source timestamps (unchecked-hash): the image is immutable and its root read-only.
ARG BASE=python:3.11-slim-bookworm
ARG BUILD_BASE=python:3.11-slim-bookworm

FROM --platform=$BUILDPLATFORM ${BUILD_BASE} AS build
ARG TARGETARCH
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md ./
COPY archway/ archway/
COPY registry/ registry/
COPY certs/ certs/
COPY placement/ placement/
COPY objects/ objects/
COPY cluster/ cluster/
COPY webhook/ webhook/
COPY extender/ extender/
COPY gate/ gate/
COPY tools/ tools/
COPY main/ main/
RUN set -eu; \
    case "$TARGETARCH" in \
      amd64) machine=x86_64 ;; \
      arm64) machine=aarch64 ;; \
      *) echo "unsupported TARGETARCH '$TARGETARCH' (amd64, arm64)" >&2; exit 1 ;; \
    esac; \
    pyver=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
    glibc=$(python3 -c 'import platform; print(platform.libc_ver()[1].split(".")[1])'); \
    platforms="--platform manylinux2014_$machine"; \
    while [ "$glibc" -gt 17 ]; do platforms="$platforms --platform manylinux_2_${glibc}_$machine"; glibc=$((glibc - 1)); done; \
    python3 -m pip wheel --quiet --no-deps --wheel-dir /wheels .; \
    python3 -m pip install --quiet --target /opt/archway/lib --only-binary=:all: \
        --implementation cp --python-version "$pyver" $platforms /wheels/archway-*.whl; \
    mv /opt/archway/lib/bin /opt/archway/bin; \
    python3 -m compileall -q -j 0 --invalidation-mode unchecked-hash /opt/archway/lib; \
    mkdir -p /home-archway

# --platform=$TARGETPLATFORM is BuildKit's default; buildah 1.28 needs it said, or it keeps the
# build stage's platform for this stage too.
FROM --platform=$TARGETPLATFORM ${BASE}
LABEL org.opencontainers.image.title="archway" \
      org.opencontainers.image.description="Architecture-aware pod placement for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/archway /opt/archway
# 65532:65532, the conventional "nonroot" ids; the chart's podSecurityContext uses the same.
# HOME, where server.state_dir (~/.local/state/archway) lives; the chart mounts an emptyDir here.
COPY --from=build --chown=65532:65532 /home-archway /var/lib/archway
ENV PATH=/opt/archway/bin:$PATH \
    PYTHONPATH=/opt/archway/lib \
    HOME=/var/lib/archway \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
WORKDIR /var/lib/archway
EXPOSE 8443
ENTRYPOINT ["archway"]
CMD ["serve", "--bind", "0.0.0.0:8443"]
