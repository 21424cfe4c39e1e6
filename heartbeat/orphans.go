package heartbeat

import (
	"context"
	"fmt"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// Orphan is a sandbox that looks abandoned, and why.
type Orphan struct {
	Record  store.Record
	Reasons []string
}

// staleStopped is how long a stopped sandbox sits before it is reported as an orphan.
const staleStopped = 24 * time.Hour

// Orphans lists an org's sandboxes that look abandoned now (on the lease clock), each with every
// reason: a deadline already passed, a heartbeat long overdue, a revoked owner key, a sweeper stop, a
// long stop, a failure. It changes nothing; cleaning up is sbctl delete (by name or by tag).
func Orphans(ctx context.Context, st *store.Store, org string) ([]Orphan, error) {
	now, err := st.Now(ctx)
	if err != nil {
		return nil, err
	}
	recs, err := st.ListAll(ctx, org, store.Filter{})
	if err != nil {
		return nil, err
	}
	revoked := map[string]bool{}
	keys, err := st.ListAPIKeys(ctx, org)
	if err != nil {
		return nil, err
	}
	for _, k := range keys {
		revoked["key:"+k.ID] = !k.RevokedAt.IsZero()
	}
	var out []Orphan
	for _, r := range recs {
		var why []string
		switch r.Status {
		case protocol.StatusRunning:
			if !r.ExpiresAt.IsZero() && !r.ExpiresAt.After(now) {
				why = append(why, fmt.Sprintf("deadline passed at %s; the sweeper stops it at its next pass", stamp(r.ExpiresAt)))
			} else if r.TTL > 0 && now.Sub(r.Heartbeat) > r.TTL/2 {
				why = append(why, fmt.Sprintf("no heartbeat since %s (%s ago); lease expires in %s",
					stamp(r.Heartbeat), now.Sub(r.Heartbeat).Round(time.Second), r.ExpiresAt.Sub(now).Round(time.Second)))
			}
		case protocol.StatusStopped:
			if r.StopReason == protocol.StopTTLExpired {
				why = append(why, fmt.Sprintf("stopped at %s because no heartbeat came within %s (ttl_expired)", stamp(r.StoppedAt), r.TTL))
			} else if now.Sub(r.StoppedAt) > staleStopped {
				why = append(why, fmt.Sprintf("stopped since %s (%s)", stamp(r.StoppedAt), r.StopReason))
			}
		case protocol.StatusFailed:
			why = append(why, "failed: "+r.Failure)
		}
		if revoked[r.CreatedBy] {
			why = append(why, "the API key that created it ("+r.CreatedBy+") is revoked")
		}
		if len(why) > 0 {
			out = append(out, Orphan{Record: r, Reasons: why})
		}
	}
	return out, nil
}

func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339) }
