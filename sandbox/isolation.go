package sandbox

import (
	"errors"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
)

// levelRank orders the isolation levels by strength, for "may raise, never lower".
var levelRank = map[string]int{
	protocol.IsolationNamespace: 1,
	protocol.IsolationGvisor:    2,
	protocol.IsolationMicroVM:   3,
}

// withIsolation is the template at the level a create asks for (asked, or the template's own when
// asked is empty), refused when asked would lower the template's level or the host cannot give it.
// Nothing is created before this answers: a refused level never becomes a weaker sandbox.
func withIsolation(p provider.Provider, t provider.Template, asked string) (provider.Template, error) {
	if asked != "" {
		if levelRank[asked] == 0 {
			return t, protocol.Errorf(protocol.CodeInvalidArgument, "isolation %q is not a level: use namespace, gvisor or microvm", clip(asked))
		}
		if own := provider.LevelOf(t); levelRank[asked] < levelRank[own] {
			return t, protocol.Errorf(protocol.CodeInvalidArgument, "template %q runs at isolation %s; a create may raise its level, not lower it to %s", t.Name, own, asked)
		}
		t.Isolation = asked
	}
	if err := provider.CheckIsolation(p, t); err != nil {
		if errors.Is(err, provider.ErrIsolationUnavailable) {
			return t, protocol.Errorf(protocol.CodeIsolationUnavailable, "%s", err.Error())
		}
		return t, err
	}
	return t, nil
}

// GvisorRelayDiscards counts the frames the gvisor level's bridges discarded for a channel not open
// on their side, since the broker started: 0 unless the relay or the in-sandbox bridge has a
// defect (each discard is logged too, within a rate).
func GvisorRelayDiscards() int64 { return provider.GvisorRelayDiscards() }

// IsolationLevels are the levels p offers on this host, and what the host lacks for the others.
func IsolationLevels(p Provider) (offered []string, missing map[string]string) {
	return provider.Levels(p)
}
