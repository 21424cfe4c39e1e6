package kubetest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// Cluster addresses kube-proxy makes work.
const (
	// ServiceCIDR is the Services' cluster IP range (kube-apiserver's --service-cluster-ip-range).
	ServiceCIDR = "10.96.0.0/16"
	// APIServiceIP is the `kubernetes` Service's cluster IP (the range's first address): in-cluster
	// config reaches the API server there (kubernetes.default.svc).
	APIServiceIP = "10.96.0.1"
	// PodCIDR is the pods' range on the node (the CNI bridge's host-local IPAM).
	PodCIDR = "10.244.0.0/24"
)

// proxySysctls are the host settings kube-proxy may change (route_localnet for NodePorts on
// localhost, turned off in its configuration; the conntrack table's size and timeouts, left alone
// by zeros in its configuration): Start records them and Stop puts them back, whatever happened.
var proxySysctls = []string{
	"/proc/sys/net/ipv4/conf/all/route_localnet",
	"/proc/sys/net/netfilter/nf_conntrack_max",
	"/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established",
	"/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait",
}

// startKubeProxy runs kube-proxy in iptables mode, so that Services' cluster IPs answer from pods
// and from the host. Every Service's traffic is masqueraded (masqueradeAll): a pod reaching a
// Service backed by a pod on the same bridge then gets its replies back through the host's
// conntrack, whatever br_netfilter says. It returns once the `kubernetes` Service answers on its
// cluster IP from the host.
func (c *Cluster) startKubeProxy(ctx context.Context, bin string) error {
	c.sysctls = map[string][]byte{}
	for _, p := range proxySysctls {
		if b, err := os.ReadFile(p); err == nil {
			c.sysctls[p] = b
		}
	}
	ports, err := freePorts(2)
	if err != nil {
		return err
	}
	cfg := fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection:
  kubeconfig: %q
hostnameOverride: %s
bindAddress: %s
clusterCIDR: %s
healthzBindAddress: 127.0.0.1:%d
metricsBindAddress: 127.0.0.1:%d
nodePortAddresses: [%s/32]
iptables:
  masqueradeAll: true
  localhostNodePorts: false
  syncPeriod: 30s
  minSyncPeriod: 0s
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
`, c.Kubeconfig, c.Node, c.NodeIP, PodCIDR, ports[0], ports[1], c.NodeIP)
	if err := os.WriteFile(c.path("kube-proxy.yaml"), []byte(cfg), 0o644); err != nil {
		return err
	}
	if err := c.run("kube-proxy", filepath.Join(bin, "kube-proxy"), "--config="+c.path("kube-proxy.yaml"), "--v=1"); err != nil {
		return err
	}
	return c.until(ctx, "the kubernetes Service on "+APIServiceIP+":443 (kube-proxy's rules)", 60*time.Second, func() (bool, error) {
		conn, err := net.DialTimeout("tcp", APIServiceIP+":443", time.Second)
		if err == nil {
			conn.Close()
		}
		return err == nil, nil
	})
}

// restoreSysctls puts back what startKubeProxy recorded.
func (c *Cluster) restoreSysctls() {
	for p, b := range c.sysctls {
		if cur, err := os.ReadFile(p); err == nil && string(cur) != string(b) {
			os.WriteFile(p, b, 0o644)
		}
	}
}

// proxyLeftovers lists what kube-proxy could leave besides its iptables chains: the dummy
// interface and the ipsets of its IPVS mode, and the nftables table of its nftables mode (neither
// mode runs here, but a kube-proxy that fell back to one would leave them).
func proxyLeftovers() []string {
	var left []string
	if _, err := net.InterfaceByName("kube-ipvs0"); err == nil {
		left = append(left, "interface kube-ipvs0")
	}
	if out, err := exec.Command("ipset", "list", "-n").Output(); err == nil {
		for _, s := range strings.Fields(string(out)) {
			if strings.HasPrefix(s, "KUBE-") {
				left = append(left, "ipset "+s)
			}
		}
	}
	if out, err := exec.Command("nft", "list", "tables").Output(); err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			if f := strings.Fields(line); len(f) == 3 && f[2] == "kube-proxy" {
				left = append(left, "nft table "+f[1]+" kube-proxy")
			}
		}
	}
	return left
}

// cleanProxy removes what proxyLeftovers finds.
func cleanProxy() error {
	var errs []string
	for _, l := range proxyLeftovers() {
		var cmd *exec.Cmd
		switch f := strings.Fields(l); f[0] {
		case "interface":
			cmd = exec.Command("ip", "link", "delete", f[1])
		case "ipset":
			cmd = exec.Command("ipset", "destroy", f[1])
		case "nft":
			cmd = exec.Command("nft", "delete", "table", f[2], f[3])
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v: %s", l, err, out))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("kube-proxy's leftovers: %s", strings.Join(errs, "; "))
	}
	return nil
}
