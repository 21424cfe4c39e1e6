package provider

import (
	"fmt"
	"net"
	"net/netip"
	"sync"

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

// The egress firewall of a gvisor network sandbox (gvisor_network.go shows where each part sits).
// gVisor's netstack (runsc --network=sandbox) sends the sandbox's frames through an AF_PACKET
// socket on an interface of the namespace: they never pass the namespace's IP layer, so the
// output hook above would not see them. The rules sit on the netdev family's hooks instead, twice:
//
//   - on the egress hook of pasta's tap (applyNetdevEgress), which every frame bound for pasta
//     passes, whoever sent it and however: an AF_PACKET socket's frames go through it whether they
//     take the qdisc or bypass it (PACKET_QDISC_BYPASS, which runsc does not set and the sentry's
//     seccomp filter would not let it set; the bypass path runs the same hook since Linux 5.17).
//     TestNetdevEgressSeesPacketSockets checks both paths on this kernel. This is the wall; it
//     can only drop (Linux refuses reject on the egress hook);
//   - on the ingress hook of the veth end facing the sentry's interface (applyNetdevIngress), the
//     same rules with answers: a refused TCP connect gets a reset at once, as at the namespace
//     level, and what passes is handed on to the tap, where the wall checks it again.
//
// The rules, under a policy of drop:
//
//  1. ARP passes (pasta answers it itself), and so does IPv6 neighbour discovery (ICMPv6 133-136
//     right behind the IPv6 header, which pasta answers itself too); IPv6 with extension headers
//     is refused (pasta walks them differently from the kernel);
//  2. the sandbox's loopback, unspecified, IPv4-mapped, multicast and broadcast destinations, and the
//     host's local addresses as they are when the sandbox starts, are refused: pasta would connect
//     to any of them on the host (0.0.0.0 and 127.0.0.1 are the host's loopback there);
//  3. with an allowlist, TCP and UDP to a listed destination pass and the rest is refused; without
//     one, IPv4 and IPv6 pass.
//
// The frame is read as pasta will read it: the ethertype and the destination are taken from the
// frame's own bytes (the link-layer header and the fixed offsets behind it), not from what the
// sender declared (skb->protocol, which on the egress hook an AF_PACKET sender chooses), and a
// pass also needs the declared protocol to agree with the frame, so that a frame declared one
// thing and carrying another can only be dropped.

// gvisorIfname is the sentry's interface in a gvisor sandbox's namespace, and so the sandbox's
// interface inside gVisor (runsc copies it).
const gvisorIfname = "eth0"

const (
	etherTypeOff      = 12 // the ethertype in an Ethernet header
	etherLen          = 14 // an Ethernet header without a VLAN tag
	ipv6NextHeaderOff = 6  // the next header in an IPv6 header
	ipv6HeaderLen     = 40 // an IPv6 header without extension headers
)

// gvisorRefused are destinations that lead to the host through pasta whatever the host's addresses.
var gvisorRefused = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("224.0.0.0/4"),
	netip.MustParsePrefix("255.255.255.255/32"),
	netip.MustParsePrefix("::/128"),
	netip.MustParsePrefix("::1/128"),
	netip.MustParsePrefix("::ffff:0:0/96"),
	netip.MustParsePrefix("ff00::/8"),
}

// applyNetdevEgress installs the gvisor sandbox's rules, dropping what they refuse, on the egress
// hook of the interface dev of the network namespace netnsFD refers to. hostAddrs and allow are as
// for applyEgress.
func applyNetdevEgress(netnsFD int, dev string, hostAddrs []netip.Addr, allow []egressRule) error {
	c, err := nftables.New(nftables.WithNetNSFd(netnsFD))
	if err != nil {
		return fmt.Errorf("egress firewall: %w", err)
	}
	defer c.CloseLasting()
	table := c.AddTable(&nftables.Table{Name: egressTable, Family: nftables.TableFamilyNetdev})
	policy := nftables.ChainPolicyDrop
	chain := c.AddChain(&nftables.Chain{
		Name:     "egress",
		Table:    table,
		Type:     nftables.ChainTypeFilter,
		Hooknum:  nftables.ChainHookEgress,
		Priority: nftables.ChainPriorityFilter,
		Device:   dev,
		Policy:   &policy,
	})
	accept := []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}}
	drop := []expr.Any{&expr.Verdict{Kind: expr.VerdictDrop}}
	for _, r := range frameRules(hostAddrs, allow, accept, drop, drop) {
		c.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: r})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("egress firewall on %s: %w", dev, err)
	}
	return nil
}

// frameRules are the gvisor level's rules (see applyNetdevEgress), each ending in pass, refuseTCP
// (for TCP) or refuse (for the rest).
func frameRules(hostAddrs []netip.Addr, allow []egressRule, pass, refuseTCP, refuse []expr.Any) [][]expr.Any {
	var rules [][]expr.Any
	add := func(match []expr.Any, verdict []expr.Any) {
		rules = append(rules, append(append([]expr.Any(nil), match...), verdict...))
	}
	isTCP := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
	}
	refuseMatch := func(match []expr.Any) {
		add(append(append([]expr.Any(nil), match...), isTCP...), refuseTCP)
		add(match, refuse)
	}
	// 1. ARP and neighbour discovery. Neighbour discovery is read at fixed offsets (ICMPv6 right
	// behind the IPv6 header), as pasta reads it: the kernel's walk of extension headers (l4proto,
	// the transport header) is not pasta's, and this rule looks at no destination.
	add(frameType(unix.ETH_P_ARP), pass)
	for _, typ := range []byte{133, 134, 135, 136} {
		add(append(declared(unix.ETH_P_IPV6),
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: etherLen + ipv6NextHeaderOff, Len: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_ICMPV6}},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: etherLen + ipv6HeaderLen, Len: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{typ}}), pass)
	}
	// IPv6 with extension headers is refused: pasta walks them differently from the kernel (every
	// header's length as (hdrlen+1)*8, AH's and a fragment header's included; next headers 135,
	// 139, 140, 253 and 254 skipped; the transport header taken to start at the last extension
	// header), so the protocol, ports and type the rules below read could differ from what pasta
	// acts on. Without them both read the same bytes. gVisor sends them only for IPv6 fragments,
	// which pasta does not reassemble, and for multicast listener reports, which rule 2 refuses.
	add(append(frameType(unix.ETH_P_IPV6),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: etherLen + ipv6NextHeaderOff, Len: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{unix.IPPROTO_UDP}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{unix.IPPROTO_ICMPV6}}), refuse)
	// 2. What leads to the host.
	refused := append([]netip.Prefix(nil), gvisorRefused...)
	for _, a := range hostAddrs {
		refused = append(refused, netip.PrefixFrom(a, a.BitLen()))
	}
	for _, p := range refused {
		refuseMatch(frameDaddr(p))
	}
	// 3. The allowlist, or every IPv4 and IPv6 destination left.
	if allow == nil {
		add(declared(unix.ETH_P_IP), pass)
		add(declared(unix.ETH_P_IPV6), pass)
		return rules
	}
	for _, rule := range allow {
		for _, proto := range []byte{unix.IPPROTO_TCP, unix.IPPROTO_UDP} {
			e := append(frameDaddr(rule.prefix), declaredOnly(rule.prefix)...)
			e = append(e,
				&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}})
			if rule.from != 0 || rule.to != 65535 {
				e = append(e,
					&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
					&expr.Cmp{Op: expr.CmpOpGte, Register: 1, Data: binaryutil.BigEndian.PutUint16(rule.from)},
					&expr.Cmp{Op: expr.CmpOpLte, Register: 1, Data: binaryutil.BigEndian.PutUint16(rule.to)})
			}
			add(e, pass)
		}
	}
	refuseMatch(frameType(unix.ETH_P_IP))
	refuseMatch(frameType(unix.ETH_P_IPV6))
	return rules
}

// applyNetdevIngress installs, on the ingress hook of fw (the peer of the veth the sentry sends on),
// the same rules as applyNetdevEgress with answers: a frame that passes is handed to the tap whose
// ifindex is tapIndex (a copy sent there, through the tap's egress hook and so through its rules,
// and the original dropped), a refused TCP segment is answered with a reset and anything else
// refused with an ICMP administratively-prohibited, both sent back out of fw to the sentry. On the
// tap's own ingress hook, what pasta sends is handed to fw (ifindex fwIndex), for the sentry.
func applyNetdevIngress(netnsFD int, fw, tap string, fwIndex, tapIndex int, hostAddrs []netip.Addr, allow []egressRule) error {
	c, err := nftables.New(nftables.WithNetNSFd(netnsFD))
	if err != nil {
		return fmt.Errorf("egress firewall: %w", err)
	}
	defer c.CloseLasting()
	table := c.AddTable(&nftables.Table{Name: egressTable, Family: nftables.TableFamilyNetdev})
	policy := nftables.ChainPolicyDrop
	chain := func(name, dev string) *nftables.Chain {
		return c.AddChain(&nftables.Chain{
			Name:     name,
			Table:    table,
			Type:     nftables.ChainTypeFilter,
			Hooknum:  nftables.ChainHookIngress,
			Priority: nftables.ChainPriorityFilter,
			Device:   dev,
			Policy:   &policy,
		})
	}
	to := func(index int) []expr.Any {
		return []expr.Any{
			&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint32(uint32(index))},
			&expr.Dup{RegDev: 1, IsRegDevSet: true},
			&expr.Verdict{Kind: expr.VerdictDrop},
		}
	}
	fromSandbox := chain("from-sandbox", fw)
	rst := []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_TCP_RST}}
	prohibited := []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_ADMIN_PROHIBITED}}
	for _, r := range frameRules(hostAddrs, allow, to(tapIndex), rst, prohibited) {
		c.AddRule(&nftables.Rule{Table: table, Chain: fromSandbox, Exprs: r})
	}
	c.AddRule(&nftables.Rule{Table: table, Chain: chain("to-sandbox", tap), Exprs: to(fwIndex)})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("egress firewall on %s: %w", fw, err)
	}
	return nil
}

// frameType matches frames whose own ethertype is typ.
func frameType(typ uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: etherTypeOff, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(typ)},
	}
}

// declared matches frames whose own ethertype is typ and whose sender declared typ too: the
// protocol the kernel parsed the headers by (l4proto, transport offsets) is the one pasta reads.
func declared(typ uint16) []expr.Any {
	return append(frameType(typ),
		&expr.Meta{Key: expr.MetaKeyPROTOCOL, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(typ)})
}

// declaredOnly is the declared-protocol half of declared, for p's family.
func declaredOnly(p netip.Prefix) []expr.Any {
	typ := uint16(unix.ETH_P_IP)
	if p.Addr().Is6() {
		typ = unix.ETH_P_IPV6
	}
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyPROTOCOL, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(typ)},
	}
}

// frameDaddr matches frames of p's family, by their own ethertype, whose destination (read at its
// fixed offset in the frame) is in p.
func frameDaddr(p netip.Prefix) []expr.Any {
	typ, off, n := uint16(unix.ETH_P_IP), uint32(etherLen+16), uint32(4)
	if p.Addr().Is6() {
		typ, off, n = unix.ETH_P_IPV6, etherLen+24, 16
	}
	return append(frameType(typ),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: off, Len: n},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: n, Mask: net.CIDRMask(p.Bits(), int(n*8)), Xor: make([]byte, n)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Addr().AsSlice()})
}

// The host's wall for pasta. The namespace's rules refuse the host's addresses as they are when the
// sandbox starts; an address the host gets later (a bridge of a container runtime or of Kubernetes
// started after the sandbox, a VPN) would be reached through pasta like any other destination, and
// with it whatever listens on all addresses. So the host's own output hook refuses every sandbox
// uid (pasta's sockets carry it) anything routed to the host itself: that leaves by lo, whatever
// address it is sent to, now or later. pasta needs no local address: it forwards no port.
//
// One table for the host, a set of the uids: a uid is added when a pasta of it starts and stays
// (the --sandbox-uids range is the sandboxes', whoever holds a uid next wants the same), so a
// broker that dies leaves nothing that needs removing, and the cost per packet is one lookup.

// Names of the host's wall for pasta.
const (
	pastaWallTable = "sbxpasta"
	pastaWallSet   = "uids"
)

var pastaWallMu sync.Mutex

// applyPastaHostWall adds uid to the host's wall for pasta, making the wall first if the host has
// none. uid must be a sandbox's own, never one a host service runs as.
func applyPastaHostWall(uid int) error {
	// Two sandboxes starting at once must not both find no rules and both add them.
	pastaWallMu.Lock()
	defer pastaWallMu.Unlock()
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("host wall: %w", err)
	}
	defer c.CloseLasting()
	table := c.AddTable(&nftables.Table{Name: pastaWallTable, Family: nftables.TableFamilyINet})
	set := &nftables.Set{Table: table, Name: pastaWallSet, KeyType: nftables.TypeUID, KeyByteOrder: binaryutil.NativeEndian}
	if err := c.AddSet(set, nil); err != nil {
		return fmt.Errorf("host wall: %w", err)
	}
	policy := nftables.ChainPolicyAccept
	chain := c.AddChain(&nftables.Chain{
		Name:     "pasta",
		Table:    table,
		Type:     nftables.ChainTypeFilter,
		Hooknum:  nftables.ChainHookOutput,
		Priority: nftables.ChainPriorityFilter,
		Policy:   &policy,
	})
	if err := c.SetAddElements(set, []nftables.SetElement{{Key: binaryutil.NativeEndian.PutUint32(uint32(uid))}}); err != nil {
		return fmt.Errorf("host wall: %w", err)
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("host wall: %w", err)
	}
	// The rules, once: a broker that finds them there (its own from before, another's) adds none.
	rules, err := c.GetRules(table, chain)
	if err != nil {
		return fmt.Errorf("host wall: %w", err)
	}
	if len(rules) > 0 {
		return nil
	}
	match := []expr.Any{
		&expr.Meta{Key: expr.MetaKeySKUID, Register: 1},
		&expr.Lookup{SourceRegister: 1, SetName: set.Name, SetID: set.ID},
		// lo is ifindex 1 in every network namespace.
		&expr.Meta{Key: expr.MetaKeyOIF, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(1)},
	}
	for _, r := range refuse() {
		c.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: append(append([]expr.Any(nil), match...), r...)})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("host wall: %w", err)
	}
	return nil
}
