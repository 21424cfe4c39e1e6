package protocol

import "fmt"

// ErrorBody is the one JSON error shape of every REST answer that is not a success:
//
//	{"error":{"code":"not_found","message":"...","request_id":"..."}}
type ErrorBody struct {
	Error Error `json:"error"`
}

// Error is a machine code plus a sentence a person can act on. It is also the error value the Go SDK
// and the backend return, so callers branch on Code with errors.As, never on Message.
type Error struct {
	Code      string `json:"code"`
	Message   string `json:"message"`
	RequestID string `json:"request_id,omitempty"`
	// Status is the HTTP status the error came with (0 on the dataplane). Not serialized.
	Status int `json:"-"`
}

func (e *Error) Error() string {
	if e.RequestID != "" {
		return fmt.Sprintf("%s: %s (request %s)", e.Code, e.Message, e.RequestID)
	}
	return fmt.Sprintf("%s: %s", e.Code, e.Message)
}

// Is makes errors.Is(err, &Error{Code: X}) match any error with code X.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code && t.Message == ""
}

// Errorf builds an *Error with a formatted message.
func Errorf(code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// Stable error codes. Clients branch on these; never rename one.
const (
	// Request shape.
	CodeInvalidJSON     = "invalid_json"
	CodeInvalidArgument = "invalid_argument"
	CodeInvalidName     = "invalid_name"
	CodeInvalidTTL      = "invalid_ttl"
	CodeInvalidTag      = "invalid_tag"
	CodeInvalidStatus   = "invalid_status"
	CodeInvalidCursor   = "invalid_cursor"
	CodeInvalidEventID  = "invalid_event_id"
	CodeInvalidScope    = "invalid_scope"
	CodeUnknownTemplate = "unknown_template"
	// CodeIsolationUnavailable: the isolation level asked for cannot run on this broker's host
	// (runsc missing, no /dev/kvm); the message says what to install.
	CodeIsolationUnavailable = "isolation_unavailable"
	CodeTooLarge             = "payload_too_large"
	CodeRouteNotFound        = "route_not_found"
	CodeMethodNotAllowed     = "method_not_allowed"

	// Who is calling.
	CodeUnauthenticated   = "unauthenticated"
	CodeDelegateForbidden = "delegate_forbidden"
	CodeForbidden         = "forbidden"

	// Token checks (delegation verification); each names the check that failed.
	CodeTokenMalformed  = "token_malformed"
	CodeTokenTooLarge   = "token_too_large"
	CodeTokenAlgorithm  = "token_bad_algorithm"
	CodeTokenType       = "token_bad_type"
	CodeTokenUnknownKey = "token_unknown_key"
	CodeTokenSignature  = "token_bad_signature"
	CodeTokenExpired    = "token_expired"
	CodeTokenNotYet     = "token_not_yet_valid"
	CodeTokenIssuedAt   = "token_issued_in_future"
	CodeTokenIssuer     = "token_bad_issuer"
	CodeTokenAudience   = "token_bad_audience"
	CodeTokenClaims     = "token_bad_claims"
	CodeTokenRevoked    = "token_revoked"
	CodeTokenSandbox    = "token_wrong_sandbox"

	// State.
	CodeNotFound      = "not_found"
	CodeNameConflict  = "name_conflict"
	CodeInvalidState  = "invalid_state"
	CodeSandboxFailed = "sandbox_failed"
	CodeNotRunning    = "sandbox_not_running"
	CodeWrongNode     = "wrong_node"
	// CodeCapacity: the broker cannot host another sandbox (every host uid of its range is in use).
	CodeCapacity = "capacity_exhausted"

	// Dataplane operations.
	CodeScopeDenied       = "scope_denied"
	CodeCommandNotAllowed = "command_not_allowed"
	CodeInvalidPath       = "invalid_path"
	CodeFileNotFound      = "file_not_found"
	CodeIsDirectory       = "is_directory"
	CodeNotDirectory      = "not_directory"
	CodeFileExists        = "file_exists"
	CodePermissionDenied  = "permission_denied"
	CodeNoMatch           = "no_match"
	CodeNotUnique         = "not_unique"
	CodeTooManyRequests   = "too_many_requests"
	// CodeTooManyConnections refuses a dataplane connection over its credential's or org's cap.
	CodeTooManyConnections = "too_many_connections"
	CodeUnknownOp          = "unknown_op"
	CodeTimeout            = "timeout"
	CodeCancelled          = "cancelled"

	// Server side.
	CodeInternal    = "internal"
	CodeUnavailable = "unavailable"

	// Client side (backend): the dataplane could not be reached or the connection broke.
	CodeUnreachable = "unreachable"
)
