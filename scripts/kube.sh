#!/usr/bin/env bash
# Builds the Kubernetes binaries the kubernetes provider's test cluster runs (kube-apiserver, kubelet,
# kube-scheduler, kube-controller-manager, kube-proxy, and kubectl for the deploy test) from the Go module proxy, through the wrapper module in
# tools/kube, into a cache keyed by version outside the repository, and reuses them afterwards.
#
#   scripts/kube.sh build   build what is missing; print the cache directory
#   scripts/kube.sh dir     print the cache directory (built or not)
#
# The first build takes 10-30 minutes on 2 cores (kube-apiserver is most of it); later ones are instant.
# SBX_KUBE_DIR overrides the cache directory.
set -euo pipefail

version=v1.32.4
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${SBX_KUBE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sbx-broker/kube-$version}"
bins=(kube-apiserver kubelet kube-scheduler kube-controller-manager kube-proxy kubectl)

case "${1:-build}" in
dir)
  echo "$dir"
  exit 0
  ;;
build) ;;
*)
  echo "usage: $0 build|dir" >&2
  exit 2
  ;;
esac

mkdir -p "$dir"
missing=()
for b in "${bins[@]}"; do [ -x "$dir/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -eq 0 ]; then
  echo "$dir"
  exit 0
fi

# One build at a time: a second caller waits for the first instead of building the same thing twice.
exec 9>"$dir/.lock"
flock 9
missing=()
for b in "${bins[@]}"; do [ -x "$dir/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -gt 0 ]; then
  cd "$root/tools/kube"
  [ -f go.sum ] && grep -q '^k8s.io/kubernetes ' go.sum || go mod tidy >&2
  ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=1"
  ldflags="$ldflags -X k8s.io/component-base/version.gitMinor=32 -X k8s.io/component-base/version.gitTreeState=clean"
  ldflags="$ldflags -X k8s.io/client-go/pkg/version.gitVersion=$version"
  # One go build for all of them: they share most packages, built once.
  echo "building ${missing[*]} $version into $dir (the first build takes 10-30 minutes)..." >&2
  tmp="$(mktemp -d "$dir/.build.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  pkgs=()
  for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$tmp/" "${pkgs[@]}"
  for b in "${missing[@]}"; do mv "$tmp/$b" "$dir/$b"; done
fi
echo "$dir"
