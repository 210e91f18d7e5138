# syntax=docker/dockerfile:1
# Two images from one build stage:
#   worker (default target): `worker` and `publisher`, the production image, and `demo-agent`
#       (examples/demo-agent, the compose demo's agent; an example built on the publisher library,
#       no part of a release of your own).
#       docker build -t intent-worker:dev .
#   downstream: `reference-downstream`, the demo's and tests' business service; never in the
#       worker's image.
#       docker build --target downstream -t intent-downstream:dev .
# Base images are pinned by version (toolchain = the one the tests ran with; Debian by dated tag).
# TLS (rustls with ring, system roots from ca-certificates) is in every build: no feature, and
# no cmake (ring builds with the C compiler the rust image has).

ARG VERSION=0.1.0
# The repository URL for org.opencontainers.image.source: --build-arg SOURCE=<url>.
ARG SOURCE=""

# ---- build -------------------------------------------------------------------------------------
FROM rust:1.95.0-bookworm AS build
WORKDIR /src
# The code uses no compile-time-checked sqlx queries, so no database is needed to build.
ENV CARGO_TERM_COLOR=never
COPY . .
# The release set (README, "Development") and the example agent: never the `fault-points`
# feature (docs/design.md section 9). With resolver 2, only the e2e test crate enables it, and
# that crate is not selected; the guard below proves it. The example links the publisher library
# and adds no feature to the others, so the worker and publisher binaries are the release set's.
# The worker's `jemalloc` feature gives it jemalloc as its allocator (docs/benchmarks.md, "Cost
# per intent").
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    set -eux; \
    release="-p intent-worker -p intent-publisher -p reference-downstream -p demo-agent"; \
    for crate in intent-worker intent-publisher; do \
        if cargo tree --locked -e features -i $crate $release | grep -q 'feature "fault-points"'; then \
            echo "refusing to build: fault-points is enabled for $crate in the release set" >&2; exit 1; \
        fi; \
    done; \
    cargo build --release --locked $release --features intent-worker/jemalloc; \
    mkdir -p /out; \
    cp target/release/worker target/release/publisher target/release/reference-downstream \
        target/release/demo-agent /out/

# ---- runtime base --------------------------------------------------------------------------------
FROM debian:bookworm-20251229-slim AS runtime
# ca-certificates: the system roots every TLS client trusts (plus WORKER_CA_FILE). No curl: health
# checks use `worker probe` and `reference-downstream probe`.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 intent \
 && useradd --system --uid 10001 --gid intent --no-create-home --shell /usr/sbin/nologin intent
ENV RUST_LOG=info
USER 10001:10001

# ---- reference downstream ----------------------------------------------------------------------
FROM runtime AS downstream
ARG VERSION
ARG SOURCE
LABEL org.opencontainers.image.title="reference-downstream" \
      org.opencontainers.image.description="Reference downstream service for the intent worker: replay, lookup and no-recovery modes with fault injection (demo and tests only)." \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
COPY --from=build /out/reference-downstream /usr/local/bin/
ENV DOWNSTREAM_ADDR=0.0.0.0:9100
EXPOSE 9100
CMD ["reference-downstream"]

# ---- worker (default target: last stage) --------------------------------------------------------
FROM runtime AS worker
ARG VERSION
ARG SOURCE
LABEL org.opencontainers.image.title="intent-worker" \
      org.opencontainers.image.description="RabbitMQ consumer that records agent intents in a Postgres ledger and dispatches each logical action at most once; with the publisher CLI." \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
COPY --from=build /out/worker /out/publisher /out/demo-agent /usr/local/bin/
# Listen on all interfaces inside the container: metrics/health (9464) and the admin API (8080,
# which stays off until WORKER_ADMIN_TOKEN or WORKER_TENANT_TOKENS is set).
ENV METRICS_ADDR=0.0.0.0:9464 \
    WORKER_ADMIN_ADDR=0.0.0.0:8080
EXPOSE 9464 8080
CMD ["worker", "run"]
