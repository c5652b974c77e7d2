# Stratus container image: ps-server and ps-worker on a slim Debian runtime.
#
#   docker build -t stratus:latest .
#   docker run --rm stratus:latest ps-worker --help
#
# The build stage compiles both binaries in release mode from the locked
# dependency set; the runtime stage holds only the binaries, the configs and
# the system CA certificates (needed for https:// object stores such as S3).
# It runs as the user stratus (uid 10001), who owns /stratus and its folders:
# a named volume mounted on /stratus/certs or /stratus/ca starts with that
# owner, so the keys `ps-server certs` writes there (mode 0600) are readable
# by every container of the image that mounts the volume. docker-compose.yml
# keeps the CA key in /stratus/ca, a volume only its certs service mounts.
# GPU workers need a CUDA base and `--features cuda`; see the README.

ARG RUST_VERSION=1.89
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p ps-server -p ps-worker \
    && install -D -m 0755 -t /out target/release/ps-server target/release/ps-worker

FROM debian:${DEBIAN_RELEASE}-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /stratus stratus \
    && mkdir -p /stratus/configs /stratus/ca /stratus/certs /stratus/data /stratus/runs \
    && chown -R stratus:stratus /stratus
COPY --from=build /out/ps-server /out/ps-worker /usr/local/bin/
COPY configs/ /stratus/configs/
WORKDIR /stratus
USER stratus
# Servers listen on UDP (QUIC); the compose file and the README use 7400.
EXPOSE 7400/udp
CMD ["ps-server", "--help"]
