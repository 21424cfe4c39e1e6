package kube

import (
	"strings"
	"testing"
)

// TestParseAgentFrom: who may reach the agents' port is written as addresses or pod labels; an
// entry that is neither is refused at start rather than turned into a peer that matches nothing
// (every broker locked out) or everything.
func TestParseAgentFrom(t *testing.T) {
	peers, err := ParseAgentFrom([]string{"10.244.0.1", "10.0.0.0/8", "fd00::1", BrokerPodLabel, "sbx-system:app.kubernetes.io/name=sbx-broker"})
	if err != nil {
		t.Fatal(err)
	}
	if len(peers) != 5 {
		t.Fatalf("%d peers", len(peers))
	}
	if peers[0].IPBlock.CIDR != "10.244.0.1/32" || peers[1].IPBlock.CIDR != "10.0.0.0/8" || peers[2].IPBlock.CIDR != "fd00::1/128" {
		t.Errorf("address peers %+v %+v %+v", peers[0].IPBlock, peers[1].IPBlock, peers[2].IPBlock)
	}
	if p := peers[3]; p.PodSelector.MatchLabels["app.kubernetes.io/name"] != "sbx-broker" || p.NamespaceSelector != nil {
		t.Errorf("pod label in the sandboxes' namespace: %+v", p)
	}
	if p := peers[4]; p.PodSelector.MatchLabels["app.kubernetes.io/name"] != "sbx-broker" ||
		p.NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"] != "sbx-system" {
		t.Errorf("pod label in another namespace: %+v", p)
	}
	for _, bad := range []string{"", "broker", "=x", "app=", "a b=c", "Bad_NS:app=x", ":app=x", "10.0.0.0/33"} {
		if _, err := ParseAgentFrom([]string{bad}); err == nil || !strings.Contains(err.Error(), "CIDR") && !strings.Contains(err.Error(), "label") {
			t.Errorf("%q accepted", bad)
		}
	}
}
