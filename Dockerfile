# shmwatch: a small image that needs no write access anywhere (runs with a read-only root
# filesystem) and no root. tests/test_deploy.py replays the COPY and RUN steps below in a
# fresh virtualenv and runs the result, since Docker builds cannot run on our CI machines.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
RUN python3 -m pip install --no-cache-dir . && rm -rf /src

WORKDIR /
# nobody:nogroup by default. In a sidecar, run it as the workload's UID instead
# (securityContext.runAsUser): reading /proc/<pid>/maps of another process needs
# ptrace access, which the kernel grants to the same UID (or CAP_SYS_PTRACE).
USER 65534:65534
EXPOSE 9841
ENTRYPOINT ["shmwatch"]
