# Stratus container image: ps-server, ps-worker and the data tool ps-data on a
# slim Debian runtime.
#
#   docker build -t stratus:latest .
#   docker run --rm stratus:latest ps-worker --help
#
# The build stage compiles the binaries in release mode from the locked
# dependency set, dependencies first in a layer of their own (see below); the
# runtime stage holds only the (stripped) binaries, the configs and
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
# 1. The dependency layer: the manifests and the lockfile only, with stub
#    sources (an empty lib.rs per crate and `fn main() {}` for each [[bin]]),
#    so the dependencies are built once and stay cached until a manifest or
#    Cargo.lock changes. The stubs are removed again.
COPY Cargo.toml Cargo.lock ./
COPY shared/Cargo.toml shared/
COPY net/Cargo.toml net/
COPY dataset/Cargo.toml dataset/
COPY tools/Cargo.toml tools/
COPY server/Cargo.toml server/
COPY worker/Cargo.toml worker/
COPY tests/Cargo.toml tests/
COPY examples/Cargo.toml examples/
ARG CRATES="shared net dataset tools server worker tests examples"
RUN set -eu; \
    for dir in $CRATES; do \
        mkdir -p "$dir/src"; : >"$dir/src/lib.rs"; \
        sed -n 's/^path = "\(.*\)"$/\1/p' "$dir/Cargo.toml" | while read -r bin; do \
            mkdir -p "$dir/$(dirname "$bin")"; echo 'fn main() {}' >"$dir/$bin"; \
        done; \
    done; \
    cargo build --release --locked -p ps-server -p ps-worker -p ps-data; \
    for dir in $CRATES; do rm -rf "$dir/src"; done
# 2. The sources: only the workspace's own crates are compiled here. Their
#    files are touched so that cargo sees them as newer than the stubs.
COPY . .
RUN find $CRATES -name '*.rs' -exec touch {} + \
    && cargo build --release --locked -p ps-server -p ps-worker -p ps-data \
    && install -D -s -m 0755 -t /out target/release/ps-server target/release/ps-worker \
        target/release/ps-data

FROM debian:${DEBIAN_RELEASE}-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /stratus stratus \
    && mkdir -p /stratus/configs /stratus/ca /stratus/certs /stratus/data /stratus/runs /stratus/run \
    && chown -R stratus:stratus /stratus
COPY --from=build /out/ps-server /out/ps-worker /out/ps-data /usr/local/bin/
COPY configs/ /stratus/configs/
WORKDIR /stratus
USER stratus
# Servers listen on UDP (QUIC); the compose file and the README use 7400.
EXPOSE 7400/udp
CMD ["ps-server", "--help"]
