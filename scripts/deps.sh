#!/usr/bin/env bash
# Installs what the broker and its tests need when it is missing: redis-server (the embedded Redis
# and the tests' real Redis), bubblewrap (the namespace sandbox provider), pasta (package passt: the
# user-mode network stack of network: true sandboxes) with iproute2, e2fsprogs (mkfs.ext4:
# per-sandbox disk quotas), tmux (the TUI tests), etcd, containerd, runc, the CNI plugins, iptables and conntrack
# (the kubernetes provider's test cluster), and the toolchains the sandbox tests run
# inside a sandbox, from Debian packages.
#
# scripts/deps.sh broker installs only what a broker serving sandboxes needs (those before tmux), as
# scripts/broker.sh does: starting a broker does not put containerd, etcd or compilers on a host.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v pasta >/dev/null 2>&1 || missing+=(passt)
# ip (iproute2) moves pasta's addresses onto a gvisor network sandbox's veth (gvisor_network.go);
# nsenter and unshare come with util-linux, which every Debian has.
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing+=(iproute2)
# mkfs.ext4 makes each namespace sandbox's workspace filesystem (its disk quota; volume.go).
command -v mkfs.ext4 >/dev/null 2>&1 || [ -x /usr/sbin/mkfs.ext4 ] || [ -x /sbin/mkfs.ext4 ] || missing+=(e2fsprogs)
# pasta runs as the sandbox's uid and opens /dev/net/tun inside the sandbox's namespaces; the kernel
# makes it 0666, some container runtimes 0600. Opening it grants nothing by itself (creating a tap
# needs CAP_NET_ADMIN in a network namespace).
if [ -c /dev/net/tun ] && [ "$(stat -c %a /dev/net/tun)" != 666 ] && [ "$(id -u)" -eq 0 ]; then
  chmod 0666 /dev/net/tun
fi
if [ "${1:-}" != broker ]; then
  # What the sandbox tests run inside a sandbox, from the host's /usr (the tests name what is missing).
  [ -x /usr/bin/gcc ] || missing+=(gcc)
  [ -x /usr/bin/git ] || missing+=(git)
  [ -x /usr/bin/node ] || missing+=(nodejs)
  [ -x /usr/bin/npm ] || missing+=(npm)
  [ -x /usr/bin/python3 ] || missing+=(python3)
  [ -x /usr/bin/pip3 ] || missing+=(python3-pip)
  /usr/bin/python3 -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
  # tmux drives sbctl watch's full-screen TUI in the end-to-end tests (send-keys, capture-pane).
  command -v tmux >/dev/null 2>&1 || missing+=(tmux)
  # A static shell for the test of a template whose rootfs holds no libc (sandbox/provider).
  [ -x /bin/busybox ] || missing+=(busybox-static)
  # The kubernetes provider's test cluster (sandbox/provider/kube/kubetest): etcd, containerd with runc,
  # the CNI plugins and the tools kubelet needs; the Kubernetes binaries are built by scripts/kube.sh.
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  command -v containerd >/dev/null 2>&1 || missing+=(containerd)
  command -v runc >/dev/null 2>&1 || [ -x /usr/sbin/runc ] || missing+=(runc)
  [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
  command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || missing+=(iptables)
  command -v conntrack >/dev/null 2>&1 || [ -x /usr/sbin/conntrack ] || missing+=(conntrack)
fi
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "missing: ${missing[*]}; install them as root: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi
echo "installing ${missing[*]} (Debian packages)..." >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || {
  $sudo apt-get update -q >/dev/null
  $sudo apt-get install -y -q "${missing[@]}" >/dev/null
}
# The redis-server package may start a system Redis on 6379; the broker does not use it.
