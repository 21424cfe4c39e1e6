package provider

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// The egress firewall of a network sandbox: nftables rules in the sandbox's own network namespace,
// on its output hook, installed by the broker before pasta attaches. Nothing inside can change them:
// it needs CAP_NET_ADMIN over the namespace's user namespace, which bwrap drops for everything in the
// sandbox, and no new user namespace can be made there (seccomp, --disable-userns). The rules:
//
//  1. the sandbox's own loopback (and its copy of the host's outbound address, routed over lo) passes;
//  2. the host's other local addresses, as they are when the sandbox starts, are refused: pasta
//     would otherwise connect to them from the host like any local process;
//  3. with an allowlist, TCP and UDP to a listed destination pass and everything else is refused;
//     without one, everything else passes.
//
// Refused TCP gets a reset (connect fails at once with ECONNREFUSED), anything else an ICMP
// administratively-prohibited.

const egressTable = "sbx"

// applyEgress installs the rules in the network namespace netnsFD refers to. hostAddrs are the
// host's local addresses to refuse; allow the parsed allowlist (nil: no allowlist).
func applyEgress(netnsFD int, hostAddrs []netip.Addr, allow []egressRule) error {
	c, err := nftables.New(nftables.WithNetNSFd(netnsFD))
	if err != nil {
		return fmt.Errorf("egress firewall: %w", err)
	}
	defer c.CloseLasting()
	table := c.AddTable(&nftables.Table{Name: egressTable, Family: nftables.TableFamilyINet})
	policy := nftables.ChainPolicyAccept
	chain := c.AddChain(&nftables.Chain{
		Name:     "egress",
		Table:    table,
		Type:     nftables.ChainTypeFilter,
		Hooknum:  nftables.ChainHookOutput,
		Priority: nftables.ChainPriorityFilter,
		Policy:   &policy,
	})
	add := func(exprs ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: exprs})
	}
	accept := &expr.Verdict{Kind: expr.VerdictAccept}
	// 1. oif lo accept (lo is ifindex 1 in every network namespace).
	add(&expr.Meta{Key: expr.MetaKeyOIF, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(1)},
		accept)
	// 2. the host's addresses.
	for _, a := range hostAddrs {
		for _, r := range refuse() {
			add(append(daddr(netip.PrefixFrom(a, a.BitLen())), r...)...)
		}
	}
	// 3. the allowlist, then refuse the rest.
	if allow != nil {
		for _, rule := range allow {
			for _, proto := range []byte{unix.IPPROTO_TCP, unix.IPPROTO_UDP} {
				e := daddr(rule.prefix)
				e = append(e,
					&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
					&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}})
				if rule.from != 0 || rule.to != 65535 {
					e = append(e,
						&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
						&expr.Cmp{Op: expr.CmpOpGte, Register: 1, Data: binaryutil.BigEndian.PutUint16(rule.from)},
						&expr.Cmp{Op: expr.CmpOpLte, Register: 1, Data: binaryutil.BigEndian.PutUint16(rule.to)})
				}
				add(append(e, accept)...)
			}
		}
		for _, r := range refuse() {
			add(r...)
		}
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("egress firewall: %w", err)
	}
	return nil
}

// refuse is two rule tails: TCP gets a reset, the rest an ICMP administratively-prohibited.
func refuse() [][]expr.Any {
	return [][]expr.Any{
		{
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
			&expr.Reject{Type: unix.NFT_REJECT_TCP_RST},
		},
		{&expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_ADMIN_PROHIBITED}},
	}
}

// daddr matches packets of p's family whose destination is in p.
func daddr(p netip.Prefix) []expr.Any {
	proto, off, n := byte(unix.NFPROTO_IPV4), uint32(16), uint32(4)
	if p.Addr().Is6() {
		proto, off, n = unix.NFPROTO_IPV6, 24, 16
	}
	mask := net.CIDRMask(p.Bits(), int(n*8))
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: n},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: n, Mask: mask, Xor: make([]byte, n)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Addr().AsSlice()},
	}
}

// localAddrs are the host's addresses, loopback excluded: what a network sandbox must not reach
// through pasta.
func localAddrs() ([]netip.Addr, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("egress firewall: host addresses: %w", err)
	}
	var out []netip.Addr
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		ip, ok := netip.AddrFromSlice(ipn.IP)
		if !ok {
			continue
		}
		ip = ip.Unmap()
		if ip.IsLoopback() {
			continue
		}
		out = append(out, ip.WithZone(""))
	}
	return out, nil
}
