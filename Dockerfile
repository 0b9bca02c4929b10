# The image of the Agent IM Python services. One image serves every role;
# docker-compose.yml picks the role with `command` (the default serves the
# IM on its embedded SQLite database, migrating it first).
#
#   docker build -t agentim:dev .
#   docker run --rm -p 127.0.0.1:50051:50051 agentim:dev

# The build stage installs the project into a virtual environment that the
# runtime stage copies, so no source tree or build cache ships.
FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml constraints.txt ./
COPY gen ./gen
COPY services ./services
COPY gateway ./gateway
RUN python -m venv /opt/agentim \
    && /opt/agentim/bin/pip install -c constraints.txt .


FROM python:3.11-slim

ENV PATH=/opt/agentim/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    AGENTIM_DATA_DIR=/var/lib/agentim \
    IM_GRPC_ADDRESS=0.0.0.0:50051

RUN groupadd --system --gid 10001 agentim \
    && useradd --system --uid 10001 --gid agentim --home-dir /var/lib/agentim --create-home \
       --shell /usr/sbin/nologin agentim \
    && install -d -o agentim -g agentim -m 0700 /var/lib/agentim/keys

COPY --from=build /opt/agentim /opt/agentim

USER agentim
WORKDIR /var/lib/agentim
# 50051: the IM (gRPC); 50052: the runtime (gRPC); 50053: the memory (gRPC); 8080: the HTTP gateway and web UI.
EXPOSE 50051 50052 50053 8080

# `exec` hands PID 1 to the server so that SIGTERM starts its graceful shutdown
# (and SIGHUP reloads its signing keys). On SQLite the IM makes its own key.
CMD ["sh", "-c", "python -m services.im migrate && exec python -m services.im serve"]
