#!/usr/bin/env bash
# Builds the Dockerfile.spyre image on this machine with buildah, then checks
# it: the demo runs inside it, and its default command serves a completion
# over loopback with /health answering inside.  `make image`; `.ci/run`
# runs it after the suite.
#
#   scripts/image.sh [base|build|check|prune|all]      (default: all)
#
# No image registry is needed: `base` makes a Debian 12 root file system
# with Python 3.11 (debootstrap, from this machine's Debian mirror) and
# imports it as $BASE_IMAGE.  pip inside the build gets this machine's own
# pip configuration (`pip config list`: index, wheel directories, CA
# bundle), with every local path it names mounted read-only, and pip's
# cache, so the build reuses what the set-up has downloaded.  buildah and
# debootstrap are installed with apt-get when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/vllm-spyre:latest}
BASE_IMAGE=${BASE_IMAGE:-localhost/spyre-base:bookworm}
WORK=${IMAGE_WORK:-/var/tmp/vllm-spyre-image}
RUN=(buildah run --isolation chroot)

say() { echo "== image: $*"; }

need_tools() {
  local missing=()
  command -v buildah >/dev/null || missing+=(buildah)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [ ${#missing[@]} -eq 0 ] && return
  say "installing ${missing[*]}"
  local apt=(apt-get)
  [ "$(id -u)" = 0 ] || apt=(sudo apt-get)
  export DEBIAN_FRONTEND=noninteractive
  "${apt[@]}" install -y -q "${missing[@]}" >/dev/null \
    || { "${apt[@]}" update -q >/dev/null \
         && "${apt[@]}" install -y -q "${missing[@]}" >/dev/null; }
}

# The Debian mirror for debootstrap: $DEBIAN_MIRROR, else the first http(s)
# URI of this machine's sources for bookworm (deb822 or one-line form);
# empty means debootstrap's own default.
debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then
    echo "$DEBIAN_MIRROR"
    return
  fi
  {
    cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
      | awk 'BEGIN {RS = ""} /Suites:[^\n]*bookworm( |\n|$)/ {
               if (match($0, /URIs:[^\n]*/)) print substr($0, RSTART + 5, RLENGTH - 5)
             }' | tr ' ' '\n'
    sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\) bookworm .*/\2/p' \
      /etc/apt/sources.list 2>/dev/null
  } | grep -m1 -E '^https?://' || true
}

make_base() {
  if buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    say "base $BASE_IMAGE already here"
    return
  fi
  local start=$SECONDS root="$WORK/rootfs" ctr
  rm -rf "$root" && mkdir -p "$root"
  say "making base $BASE_IMAGE (debootstrap bookworm)"
  # shellcheck disable=SC2046  # no mirror: debootstrap's default
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-dev,build-essential,git,make,ca-certificates,curl \
    bookworm "$root" $(debian_mirror) >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; exit 1; }
  # The official Python images name it python3 and python.
  ln -sf python3 "$root/usr/bin/python"
  tar -C "$root" -cf "$WORK/rootfs.tar" .
  ctr=$(buildah from scratch)
  buildah add "$ctr" "$WORK/rootfs.tar" / >/dev/null
  buildah config \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
  buildah commit -q "$ctr" "$BASE_IMAGE" >/dev/null
  buildah rm "$ctr" >/dev/null
  rm -rf "$root" "$WORK/rootfs.tar"
  say "base made in $((SECONDS - start)) s"
}

# pip's configuration on this machine as a pip.conf, and a `-v` for every
# local path it names (file:// indexes, wheel directories, the CA bundle),
# and for pip's cache.
PIP_MOUNTS=()
pip_config() {
  local python=python3 path
  [ -x .venv/bin/python ] && python=.venv/bin/python
  "$python" -m pip config list >"$WORK/pip-config.txt"
  "$python" scripts/pip_conf.py "$WORK/pip.conf" <"$WORK/pip-config.txt" \
    >"$WORK/pip-mounts.txt"
  while IFS= read -r path; do
    PIP_MOUNTS+=(-v "$path")
  done <"$WORK/pip-mounts.txt"
  PIP_MOUNTS+=(-v "$WORK/pip.conf:/etc/pip.conf:ro")
}

# What earlier builds of this image left in buildah's storage: the
# working containers of a build that failed (on the base, on the
# untagged image of a build step, or the scratch container of a failed
# base), and the images a rebuild replaced or cached as intermediate
# steps (untagged). Each is several GB, and on a machine that builds
# again and again they fill the disk; the base and the current image
# stay, and so do containers of any other image.
prune() {
  local id image name store
  buildah containers --format '{{.ContainerID}}|{{.ImageName}}|{{.ContainerName}}' \
    | while IFS='|' read -r id image name; do
        case "$name" in *working-container) ;; *) continue ;; esac
        case "$image" in
          "" | "<none>" | scratch | "$BASE_IMAGE" | "$IMAGE")
            buildah rm "$id" >/dev/null || true ;;
        esac
      done
  buildah rmi --prune >/dev/null 2>&1 || true
  store=$(buildah info --format '{{.store.GraphRoot}}')
  say "storage: $(du -sh "$store" 2>/dev/null | cut -f1) in buildah's" \
    "images; $(df -h --output=avail "$store" | tail -1 | tr -d ' ') free" \
    "on its disk"
}

build_image() {
  local start=$SECONDS
  prune
  pip_config
  say "building $IMAGE on $BASE_IMAGE"
  buildah bud --isolation chroot --format docker --layers \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" "${PIP_MOUNTS[@]}" \
    -f Dockerfile.spyre -t "$IMAGE" . >"$WORK/build.log" 2>&1 \
    || { tail -40 "$WORK/build.log"; exit 1; }
  say "built $IMAGE in $((SECONDS - start)) s;" \
    "size $(buildah images --format '{{.Size}}' "$IMAGE")"
  prune
}

SERVER_PID=""
CTR=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then
    kill -- -"$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  [ -z "$CTR" ] || buildah rm "$CTR" >/dev/null || true
}

check_image() {
  local start=$SECONDS port
  trap cleanup EXIT
  CTR=$(buildah from "$IMAGE")
  say "check 1/2: the demo inside the image"
  "${RUN[@]}" "$CTR" -- python examples/offline_demo.py | tee "$WORK/demo.log"
  grep -q "^Completion: '..*'$" "$WORK/demo.log"

  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  say "check 2/2: the default command serves on 127.0.0.1:$port"
  local cmd health
  cmd=$(buildah inspect --type image \
    --format '{{range .Docker.Config.Cmd}}{{.}} {{end}}' "$IMAGE")
  # The image's own HEALTHCHECK (CMD-SHELL form), run inside it.
  health=$(buildah inspect --type image \
    --format '{{index .Docker.Config.Healthcheck.Test 1}}' "$IMAGE")
  # shellcheck disable=SC2086  # the image's command, split into words
  setsid "${RUN[@]}" --env HOST=127.0.0.1 --env "PORT=$port" "$CTR" -- \
    $cmd >"$WORK/serve.log" 2>&1 &
  SERVER_PID=$!
  until "${RUN[@]}" --env "PORT=$port" "$CTR" -- sh -c "$health" \
      >/dev/null 2>&1; do
    kill -0 "$SERVER_PID" 2>/dev/null \
      || { tail -40 "$WORK/serve.log"; exit 1; }
    [ $((SECONDS - start)) -lt 900 ] \
      || { say "not healthy in 900 s"; tail -40 "$WORK/serve.log"; exit 1; }
    sleep 2
  done
  say "healthy (the image's HEALTHCHECK: $health)"
  # From the host, over loopback.
  python3 - "$port" <<'PY'
import json, sys, urllib.request
body = json.dumps({"model": "models/SmolLM2-135M-Instruct",
                   "prompt": "The capital of France is", "max_tokens": 8,
                   "temperature": 0}).encode()
request = urllib.request.Request(
    f"http://127.0.0.1:{sys.argv[1]}/v1/completions", body,
    {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=120))
print(json.dumps(reply))
text = reply["choices"][0]["text"]
assert text.strip(), reply
print("completion:", repr(text))
PY
  say "check passed in $((SECONDS - start)) s"
}

mkdir -p "$WORK"
case "${1:-all}" in
  base) need_tools; make_base ;;
  prune) need_tools; prune ;;
  build) need_tools; make_base; build_image ;;
  check) need_tools; check_image ;;
  all) need_tools; make_base; build_image; check_image ;;
  *) echo "usage: $0 [base|build|check|prune|all]" >&2; exit 2 ;;
esac
