# shmwatch: a small image that needs no write access anywhere (runs with a read-only root
# filesystem) and no root. The container tier (tests/containers/) builds it with `docker
# build` and runs it in each deployment shape; tests/project/test_deploy.py also replays the COPY
# and RUN steps in a fresh virtualenv. `FROM python:3.11-slim` is Docker Hub's image, or the
# tests' local stand-in (Debian bookworm's python3, built with mmdebstrap): both work.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
RUN python3 -m pip install --no-cache-dir --root-user-action=ignore . && rm -rf /src

WORKDIR /
# nobody:nogroup by default: beside a server of another UID it sees mounts, sizes and
# segments but not who holds them (what it cannot prove leaked is `unverified`). For owners
# run it as the server's UID (`--user`, securityContext.runAsUser) or with SYS_PTRACE:
# reading /proc/<pid>/maps and fd needs ptrace access, which the kernel grants to the same
# UID when our capabilities cover the server's (root beside root: keep Docker's default
# set, or drop all and add SYS_PTRACE).
USER 65534:65534
EXPOSE 9841
ENTRYPOINT ["shmwatch"]
