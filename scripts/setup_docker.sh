#!/usr/bin/env bash
# The docker sandbox's prerequisites on a Debian 12 machine, as root: Debian's docker.io and debootstrap,
# a running dockerd (started here in the background when none answers: these machines have no systemd),
# and the base image ht-debian:bookworm, which tasks whose FROM image is not on the daemon are built from
# (no registry is reachable: the image is a debootstrap minbase of bookworm with python3, python3-venv (pip
# agents install into a venv) and ca-certificates, imported with `docker import`; its label
# harness-trainer.include names those packages, and an image with another list is rebuilt). Everything
# lives outside the clone (the daemon's storage in /var/lib/docker, the rootfs tarball in
# $HT_DOCKER_CACHE) and is made once per machine: re-running only checks. Each failure is one line naming
# what failed (with the log's tail above it).
#
#   scripts/setup_docker.sh           # then: pytest -m docker
set -euo pipefail

IMAGE="${HT_DOCKER_BASE_IMAGE:-ht-debian:bookworm}"
CACHE="${HT_DOCKER_CACHE:-/var/cache/harness-trainer}"
MIRROR="${HT_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DOCKERD_LOG="${HT_DOCKERD_LOG:-/var/log/ht-dockerd.log}"
INCLUDE="python3,python3-venv,ca-certificates"
die() { echo "setup_docker: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (it installs packages and starts dockerd)"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } \
        || die "apt-get could not install ${missing[*]}"
fi

if ! docker info >/dev/null 2>&1; then
    # overlay2 storage; bridge networking with iptables NAT (per-container networks, internet for tasks
    # that allow it). Started detached, so it outlives this script and serves the tests after it.
    setsid nohup dockerd --storage-driver=overlay2 >>"$DOCKERD_LOG" 2>&1 < /dev/null &
    for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.25; done
    docker info >/dev/null 2>&1 || { tail -n 15 "$DOCKERD_LOG" >&2; die "dockerd did not come up (its log's tail above)"; }
fi

label=$(docker image inspect --format '{{index .Config.Labels "harness-trainer.include"}}' "$IMAGE" 2>/dev/null || true)
if [ "$label" != "$INCLUDE" ]; then
    tarball="$CACHE/ht-debian-bookworm-${INCLUDE//,/-}.tar"
    if [ ! -s "$tarball" ]; then
        mkdir -p "$CACHE"
        root=$(mktemp -d /var/tmp/ht-debootstrap.XXXXXX)
        started=$SECONDS
        debootstrap --variant=minbase --include="$INCLUDE" bookworm "$root" "$MIRROR" \
            >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -n 15 "$CACHE/debootstrap.log" >&2; rm -rf "$root"; die "debootstrap of bookworm from $MIRROR failed"; }
        # Smaller: no package lists or caches, no documentation (dpkg keeps its own records).
        rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
            "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/*
        tar -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
        rm -rf "$root"
        echo "setup_docker: debootstrap of bookworm minbase + $INCLUDE took $((SECONDS - started)) s"
    fi
    docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' --change "LABEL harness-trainer.include=$INCLUDE" \
        "$tarball" "$IMAGE" >/dev/null \
        || die "docker import of $tarball as $IMAGE failed"
fi
echo "setup_docker: $(docker version --format 'daemon {{.Server.Version}}') with $(docker info --format '{{.Driver}}, cgroup v{{.CgroupVersion}}'); base image $IMAGE ready"
