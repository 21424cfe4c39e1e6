package store

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Sentinel errors. The server maps them to codes in one place.
var (
	ErrNotFound     = errors.New("store: not found")
	ErrNameConflict = errors.New("store: name taken")
	// ErrDeletedMeanwhile means a create sent again (its first answer lost) had made its sandbox,
	// which was deleted before the call came again: it is not made twice.
	ErrDeletedMeanwhile = errors.New("store: the sandbox was deleted while being created")
	// ErrWrongState means a transition's precondition failed (e.g. stop of a deleting sandbox).
	ErrWrongState = errors.New("store: wrong state")
	// ErrTemplateMismatch means create-or-reuse found the name taken by a sandbox of another template.
	ErrTemplateMismatch = errors.New("store: name taken with another template")
)

// StateError carries the status that made a transition fail.
type StateError struct {
	Status string
}

func (e *StateError) Error() string { return "store: sandbox is " + e.Status }

// Is lets errors.Is(err, ErrWrongState) match.
func (e *StateError) Is(target error) bool { return target == ErrWrongState }

// Record is a sandbox record as stored: one Redis hash.
type Record struct {
	ID         string
	Org        string
	Name       string
	Template   string
	Provider   string
	Node       string // the broker that hosts the sandbox's files and processes
	Status     string
	Tags       map[string]string
	TTL        time.Duration // lease; 0 = none
	CreatedAt  time.Time
	CreatedBy  string
	Heartbeat  time.Time // last heartbeat
	ExpiresAt  time.Time // zero when not running or no lease
	StoppedAt  time.Time
	StopReason string
	Failure    string
	LostAt     time.Time // processes lost in a broker restart
	StartedAt  time.Time // first time it ran: zero while its first provisioning is under way
	Gen        int64     // delegation token generation
	// NodeLostAt is when another broker declared the hosting node lost (zero: it was not, or it
	// came back since).
	NodeLostAt time.Time
	// UID is the host uid (and gid) the sandbox's processes and files have, from the broker's
	// range (AllocateUID); 0 for a sandbox recorded before each got its own, or on a broker that
	// runs them as its own user.
	UID int
	// Placement is where a provider that places sandboxes elsewhere last started it (JSON of
	// protocol.Placement; "" for the host's own providers).
	Placement string
	// SearchPath is the PATH the runtime of a remote provider's sandbox gets (its image's, when its
	// template sets none), as that runtime reported it at its last start; "" when it reported none,
	// and for the host's own providers, whose PATH the broker sets itself.
	SearchPath string
	// Claim names the last move into provisioning that claimed the record (Transition.Claim, or the
	// new id of a create-or-reuse that resumed it); "" for a record never resumed. Read only: a
	// create never writes it.
	Claim string
}

// Hash field names. Lua scripts spell the same names.
const (
	fID, fOrg, fName, fTemplate, fProvider, fNode, fStatus = "id", "org", "name", "template", "provider", "node", "status"
	fTags, fTTL, fCreated, fCreatedBy, fHeartbeat          = "tags", "ttl", "created", "created_by", "heartbeat"
	fExpires, fStopped, fStopReason, fFailure, fLost, fGen = "expires", "stopped", "stop_reason", "failure", "lost", "gen"
	fStarted, fUID, fNodeLost, fPlacement, fClaim          = "started", "uid", "node_lost", "placement", "claim"
	fSearchPath                                            = "search_path"
)

// fields flattens a new record into HSET arguments.
func (r *Record) fields() []any {
	tags, _ := json.Marshal(r.Tags)
	return []any{
		fID, r.ID, fOrg, r.Org, fName, r.Name, fTemplate, r.Template, fProvider, r.Provider,
		fNode, r.Node, fStatus, r.Status, fTags, string(tags), fTTL, int64(r.TTL / time.Second),
		fCreated, ms(r.CreatedAt), fCreatedBy, r.CreatedBy, fHeartbeat, ms(r.Heartbeat),
		fExpires, ms(r.ExpiresAt), fStopped, ms(r.StoppedAt), fStopReason, r.StopReason,
		fFailure, r.Failure, fLost, ms(r.LostAt), fStarted, ms(r.StartedAt), fGen, max(r.Gen, 1), fUID, r.UID,
	}
}

// parseRecord reads the flat field/value array of HGETALL as returned by a script.
func parseRecord(v any) (Record, error) {
	flat, ok := v.([]any)
	if !ok || len(flat) == 0 || len(flat)%2 != 0 {
		return Record{}, ErrNotFound
	}
	m := make(map[string]string, len(flat)/2)
	for i := 0; i < len(flat); i += 2 {
		k, _ := flat[i].(string)
		val, _ := flat[i+1].(string)
		m[k] = val
	}
	return recordFromMap(m)
}

func recordFromMap(m map[string]string) (Record, error) {
	if m[fID] == "" {
		return Record{}, ErrNotFound
	}
	r := Record{
		ID: m[fID], Org: m[fOrg], Name: m[fName], Template: m[fTemplate], Provider: m[fProvider],
		Node: m[fNode], Status: m[fStatus], CreatedBy: m[fCreatedBy], StopReason: m[fStopReason],
		Failure:   m[fFailure],
		TTL:       time.Duration(atoi(m[fTTL])) * time.Second,
		CreatedAt: fromMS(m[fCreated]), Heartbeat: fromMS(m[fHeartbeat]), ExpiresAt: fromMS(m[fExpires]),
		StoppedAt: fromMS(m[fStopped]), LostAt: fromMS(m[fLost]), StartedAt: fromMS(m[fStarted]), Gen: atoi(m[fGen]),
		NodeLostAt: fromMS(m[fNodeLost]),
		UID:        int(atoi(m[fUID])),
		Placement:  m[fPlacement],
		SearchPath: m[fSearchPath],
		Claim:      m[fClaim],
	}
	if t := m[fTags]; t != "" && t != "null" {
		if err := json.Unmarshal([]byte(t), &r.Tags); err != nil {
			return Record{}, fmt.Errorf("store: record %s has corrupt tags: %w", r.ID, err)
		}
	}
	if r.Tags == nil {
		r.Tags = map[string]string{}
	}
	return r, nil
}

func ms(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMilli()
}

func fromMS(s string) time.Time {
	n := atoi(s)
	if n == 0 {
		return time.Time{}
	}
	return time.UnixMilli(n).UTC()
}

func atoi(s string) int64 {
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}

// TemplateMismatchError is ErrTemplateMismatch (errors.Is) with the template the existing sandbox
// uses.
type TemplateMismatchError struct{ Template string }

func (e *TemplateMismatchError) Error() string {
	return fmt.Sprintf("%v (it uses template %q)", ErrTemplateMismatch, e.Template)
}

// Is makes it match ErrTemplateMismatch.
func (e *TemplateMismatchError) Is(target error) bool { return target == ErrTemplateMismatch }

// scriptErr turns a script's status reply ({"err", code, detail}) into a sentinel error.
func scriptErr(code, detail string) error {
	switch code {
	case "not_found":
		return ErrNotFound
	case "conflict":
		return ErrNameConflict
	case "gone":
		return ErrDeletedMeanwhile
	case "mismatch":
		return &TemplateMismatchError{Template: detail}
	case "state":
		return &StateError{Status: detail}
	}
	return fmt.Errorf("store: script answered %q %q", code, detail)
}

// isNil reports whether err is redis.Nil.
func isNil(err error) bool { return errors.Is(err, redis.Nil) }
