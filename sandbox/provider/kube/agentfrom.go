package kube

import (
	"fmt"
	"net"
	"strings"

	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
)

// BrokerPodLabel is the label the default in-cluster AgentFrom selects the brokers' pods by (the
// deploy manifests put it on the broker's pods).
const BrokerPodLabel = "app.kubernetes.io/name=sbx-broker"

// ParseAgentFrom turns the --kube-agent-from entries into the NetworkPolicy peers admitted to the
// agents' port. An entry is a CIDR or an IP address (the brokers' addresses as the pods see them),
// or a pod label KEY=VALUE, optionally NAMESPACE:KEY=VALUE (without a namespace: the sandboxes'
// own). Anything else is refused: a peer that silently matched nothing would lock every broker out,
// and one that matched too much would admit other pods.
func ParseAgentFrom(entries []string) ([]networkingv1.NetworkPolicyPeer, error) {
	var peers []networkingv1.NetworkPolicyPeer
	for _, e := range entries {
		e = strings.TrimSpace(e)
		if _, n, err := net.ParseCIDR(e); err == nil {
			peers = append(peers, networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: n.String()}})
			continue
		}
		if ip := net.ParseIP(e); ip != nil {
			bits := "/32"
			if ip.To4() == nil {
				bits = "/128"
			}
			peers = append(peers, networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: ip.String() + bits}})
			continue
		}
		// A colon is in neither a namespace nor a label, so it parts the two (IPv6 was taken above).
		ns, label, hasNS := strings.Cut(e, ":")
		if !hasNS {
			ns, label = "", e
		}
		key, value, ok := strings.Cut(label, "=")
		if !ok || key == "" || value == "" {
			return nil, fmt.Errorf("%q is not a CIDR, an IP address or a pod label KEY=VALUE ([NAMESPACE:]KEY=VALUE)", e)
		}
		if errs := validation.IsQualifiedName(key); len(errs) > 0 {
			return nil, fmt.Errorf("%q: label key %q: %s", e, key, strings.Join(errs, "; "))
		}
		if errs := validation.IsValidLabelValue(value); len(errs) > 0 {
			return nil, fmt.Errorf("%q: label value %q: %s", e, value, strings.Join(errs, "; "))
		}
		peer := networkingv1.NetworkPolicyPeer{PodSelector: &metav1.LabelSelector{MatchLabels: map[string]string{key: value}}}
		if hasNS {
			if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
				return nil, fmt.Errorf("%q: namespace %q: %s", e, ns, strings.Join(errs, "; "))
			}
			peer.NamespaceSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": ns}}
		}
		peers = append(peers, peer)
	}
	return peers, nil
}
