# syntax=docker/dockerfile:1
# One image for every service of the compose demo: worker, publisher and reference-downstream.
# Build: docker build -t intent-worker:dev .   (docker-compose.yml builds it once as intent-worker:dev)

# ---- build -------------------------------------------------------------------------------------
FROM rust:1-bookworm AS build
WORKDIR /src
# cmake: fallback builder of aws-lc-sys (rustls' crypto provider behind the `https` feature).
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake \
 && rm -rf /var/lib/apt/lists/*
# The code uses no compile-time-checked sqlx queries, so no database is needed to build.
ENV CARGO_TERM_COLOR=never
COPY . .
# The release set: never the `fault-points` feature (docs/design.md section 9). With resolver 2, only
# the e2e test crate enables it, and that crate is not selected; the guard below proves it.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    set -eux; \
    release="-p intent-worker -p intent-publisher -p reference-downstream --features intent-worker/https"; \
    for crate in intent-worker intent-publisher; do \
        if cargo tree --locked -e features -i $crate $release | grep -q 'feature "fault-points"'; then \
            echo "refusing to build: fault-points is enabled for $crate in the release set" >&2; exit 1; \
        fi; \
    done; \
    cargo build --release --locked $release; \
    mkdir -p /out; \
    cp target/release/worker target/release/publisher target/release/reference-downstream /out/

# ---- runtime -----------------------------------------------------------------------------------
FROM debian:bookworm-slim
# ca-certificates: HTTPS to downstream services; curl: container health checks.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 intent \
 && useradd --system --uid 10001 --gid intent --no-create-home --shell /usr/sbin/nologin intent
COPY --from=build /out/worker /out/publisher /out/reference-downstream /usr/local/bin/
USER 10001:10001
ENV RUST_LOG=info \
    METRICS_ADDR=0.0.0.0:9464
EXPOSE 9464 8080 9100
CMD ["worker", "run"]
