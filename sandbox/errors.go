package sandbox

import (
	"errors"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// LimitError is a refusal by one of the org's limits: the protocol error the caller gets, and the
// name of the limit (store.Limit*) that refused, for metrics.
type LimitError struct {
	Limit string
	Err   *protocol.Error
}

func (e *LimitError) Error() string { return e.Err.Error() }
func (e *LimitError) Unwrap() error { return e.Err }

// NotFound is the one answer for a sandbox ref that a caller may not see, whether it is missing,
// being deleted or not the caller's: the same code and message, so none of them can be told apart.
func NotFound(ref string) error {
	return protocol.Errorf(protocol.CodeNotFound, "sandbox %q not found: sbctl list (GET /v1/sandboxes) shows the org's sandboxes", clip(ref))
}

// mapStoreErr turns store sentinels into protocol errors a caller can act on.
func (m *Manager) mapStoreErr(err error, ref string) error {
	var se *store.StateError
	var tm *store.TemplateMismatchError
	var qe *store.QuotaError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, store.ErrNotFound):
		return NotFound(ref)
	case errors.Is(err, store.ErrDeletedMeanwhile):
		return protocol.Errorf(protocol.CodeInvalidState, "sandbox %q was deleted while it was being created: create it again", clip(ref))
	case errors.Is(err, store.ErrNameConflict):
		return protocol.Errorf(protocol.CodeNameConflict, "a sandbox named %q already exists: reuse it, or pick another name", clip(ref))
	case errors.As(err, &tm):
		return protocol.Errorf(protocol.CodeNameConflict, "a sandbox named %q already exists with another template (%q): delete it or pick another name", clip(ref), clip(tm.Template))
	case errors.As(err, &qe) && qe.Name == store.LimitMaxSandboxes:
		return &LimitError{Limit: qe.Name, Err: protocol.Errorf(protocol.CodeQuotaExceeded,
			"org %s is at its max_sandboxes limit (%d; stopped sandboxes count: they keep their files): delete one first (sbctl list --status stopped; sbctl delete REF), or ask the broker's operator to raise the limit (broker orgs set-limits %s --max-sandboxes N); sbctl limits shows the org's limits",
			qe.Org, qe.Limit, qe.Org)}
	case errors.As(err, &qe):
		return &LimitError{Limit: qe.Name, Err: protocol.Errorf(protocol.CodeQuotaExceeded,
			"org %s is at its max_running limit (%d running or starting): stop or delete one first (sbctl list --status running; sbctl stop REF), or ask the broker's operator to raise the limit (broker orgs set-limits %s --max-running N); sbctl limits shows the org's limits",
			qe.Org, qe.Limit, qe.Org)}
	case errors.Is(err, store.ErrBadCursor):
		return protocol.Errorf(protocol.CodeInvalidCursor, "the cursor is not one this broker gave out: start again without it")
	case errors.As(err, &se):
		switch se.Status {
		case protocol.StatusFailed:
			return protocol.Errorf(protocol.CodeSandboxFailed, "sandbox %q failed; see its failure with `sbctl get`, then delete it", clip(ref))
		case protocol.StatusStopped:
			return protocol.Errorf(protocol.CodeNotRunning, "sandbox %q is stopped: resume it first", clip(ref))
		case protocol.StatusDeleting:
			return NotFound(ref)
		}
		return protocol.Errorf(protocol.CodeInvalidState, "sandbox %q is %s", clip(ref), se.Status)
	}
	return err
}
