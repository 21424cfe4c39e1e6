package sandbox

import (
	"encoding/json"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox/provider"
	"github.com/sbxbroker/broker/store"
)

// View is a record as the API shows it.
func View(r store.Record) protocol.Sandbox {
	v := protocol.Sandbox{
		ID: r.ID, Org: r.Org, Name: r.Name, Template: r.Template, Provider: r.Provider, Isolation: Isolation(r.Provider), Status: r.Status,
		Tags: r.Tags, TTLSeconds: int64(r.TTL / time.Second), CreatedAt: r.CreatedAt,
		LastHeartbeatAt: r.Heartbeat, ExpiresAt: timePtr(r.ExpiresAt), StopReason: r.StopReason,
		StoppedAt: timePtr(r.StoppedAt), Failure: r.Failure, CreatedBy: r.CreatedBy,
		Workspace: provider.WorkspacePath, ProcessesLostAt: timePtr(r.LostAt),
	}
	if r.Placement != "" && r.Status == protocol.StatusRunning {
		var pl protocol.Placement
		if json.Unmarshal([]byte(r.Placement), &pl) == nil {
			v.Placement = &pl
		}
	}
	if !r.NodeLostAt.IsZero() {
		v.NodeStatus, v.NodeLostAt = protocol.NodeLost, timePtr(r.NodeLostAt)
	}
	return v
}

// Isolation is the isolation level of sandboxes run by the named provider (the runner recorded on a
// sandbox: provider.Runner). The namespace provider isolates, at the namespace or the gvisor level;
// anything else (dir, or a name this broker does not know) is reported as none.
func Isolation(providerName string) string {
	if level := provider.RecordedIsolation(providerName); level != "" {
		return level
	}
	if providerName == "kubernetes" {
		return protocol.IsolationContainer
	}
	return protocol.IsolationNone
}

func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}
