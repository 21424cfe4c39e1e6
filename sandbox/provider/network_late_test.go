package provider

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// An address the host gets after a network sandbox started (a container runtime's or Kubernetes'
// bridge brought up later, a VPN) is the host's too: a sandbox of either level must not reach what
// listens there, although the namespace's rules were written before it existed.
func TestNetworkLateHostAddress(t *testing.T) {
	n := newGvisor(t)
	type started struct {
		name string
		in   Instance
	}
	var sbs []started
	in, _ := startSandbox(t, n, gvisorNetTemplate)
	sbs = append(sbs, started{"gvisor", in})
	in, _ = startSandbox(t, n, Template{Network: NetworkOn})
	sbs = append(sbs, started{"namespace", in})
	// The host's new address, on a veth made now.
	name := fmt.Sprintf("sbxlt%d", os.Getpid()%100000)
	host := fmt.Sprintf("10.214.%d.1", os.Getpid()%250)
	for _, args := range [][]string{
		{"link", "add", name + "a", "type", "veth", "peer", "name", name + "b"},
		{"addr", "add", host + "/30", "dev", name + "a"},
		{"link", "set", name + "a", "up"},
		{"link", "set", name + "b", "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		if args[0] == "link" && args[1] == "add" {
			t.Cleanup(func() { exec.Command("ip", "link", "del", name+"a").Run() })
		}
	}
	for _, sb := range sbs {
		addr, accepted := listenOn(t, net.JoinHostPort(host, "0"))
		if res, out := sh(t, sb.in, bashConnect(addr)); res.ExitCode == 0 || accepted() {
			t.Errorf("a %s network sandbox reached the host's address %s added after it started: %+v %q", sb.name, addr, res, out)
		}
	}
}
