package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/sandbox"
	"github.com/sbxbroker/broker/store"
)

// decodeJSON reads a JSON body strictly: one object of UTF-8, no unknown fields, no key given twice
// or in another case than documented (exactKeys), bounded size. An empty body is allowed when the
// route has no required fields (the zero value is used).
func decodeJSON(c echo.Context, v any) error {
	body, err := io.ReadAll(http.MaxBytesReader(c.Response(), c.Request().Body, maxBody))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return protocol.Errorf(protocol.CodeTooLarge, "request body is over %d bytes", maxBody)
		}
		if bodyLate(err) {
			// The connection cannot be read any more: it closes after this answer.
			c.Response().Header().Set("Connection", "close")
			return protocol.Errorf(protocol.CodeInvalidArgument, "the request body did not arrive in full within %s; send the whole body at once", c.Get(ctxBodyWait))
		}
		return protocol.Errorf(protocol.CodeInvalidJSON, "could not read the request body")
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return nil
	}
	var pe *protocol.Error
	switch err := decodeStrict(body, v); {
	case err == nil:
		return nil
	case errors.As(err, &pe): // exactKeys' own answer
		return pe
	case errors.Is(err, errNotUTF8):
		return protocol.Errorf(protocol.CodeInvalidJSON, "request body is not UTF-8: JSON text must be")
	case errors.Is(err, errLoneSurrogate):
		return protocol.Errorf(protocol.CodeInvalidJSON, "request body: %v", err)
	case errors.Is(err, errTrailingData):
		return protocol.Errorf(protocol.CodeInvalidJSON, "request body has data after the JSON object")
	default:
		return protocol.Errorf(protocol.CodeInvalidJSON, "request body is not valid JSON for this route: %s", jsonProblem(err))
	}
}

// jsonProblem describes a decode error without echoing the input back.
func jsonProblem(err error) string {
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	var pe *protocol.Error
	switch {
	case errors.As(err, &pe): // exactKeys' answer
		return pe.Message
	case errors.As(err, &se):
		return fmt.Sprintf("syntax error at byte %d", se.Offset)
	case errors.As(err, &te) && te.Field == "":
		return "the body must be a JSON object"
	case errors.As(err, &te):
		return fmt.Sprintf("field %q has %s where %s belongs", te.Field, jsonKind(te.Value), jsonTypeOf(te.Type))
	case errors.Is(err, io.ErrUnexpectedEOF):
		return "unexpected end of input"
	}
	msg := strings.TrimPrefix(err.Error(), "json: ")
	if len(msg) > 120 {
		msg = msg[:120]
	}
	return msg
}

// jsonKind names what encoding/json's UnmarshalTypeError.Value found, with its article.
func jsonKind(v string) string {
	switch {
	case v == "array" || v == "object":
		return "an " + v
	case v == "" || v == "null":
		return "null"
	case strings.HasPrefix(v, "number"): // "number 1.5" when a float met an integer
		return "a number"
	case v == "bool":
		return "true or false"
	}
	return "a " + v
}

// jsonTypeOf names a Go type by the JSON value that decodes into it, so that an error speaks
// the language the body was written in rather than Go's (map[string]string, int64).
func jsonTypeOf(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		return "an array"
	}
	return "an object"
}

func (s *Server) caller(c echo.Context) sandbox.Caller {
	p := principal(c)
	return sandbox.Caller{Org: p.Org, Actor: p.Actor()}
}

func (s *Server) createSandbox(c echo.Context) error {
	var req protocol.CreateSandboxRequest
	if err := decodeJSON(c, &req); err != nil {
		return err
	}
	cr := sandbox.CreateRequest{Name: req.Name, Template: req.Template, Tags: req.Tags, Reuse: req.Reuse == nil || *req.Reuse, Isolation: req.Isolation}
	if req.TTLSeconds != nil {
		ttl := leaseOf(*req.TTLSeconds)
		cr.TTL = &ttl
	}
	rec, outcome, err := s.sandboxes.Create(c.Request().Context(), s.caller(c), cr)
	if err != nil {
		return err
	}
	status := http.StatusOK
	if outcome == protocol.OutcomeCreated {
		status = http.StatusCreated
	}
	c.Set(ctxSandbox, rec)
	return c.JSON(status, protocol.CreateSandboxResponse{Outcome: string(outcome), Sandbox: s.viewer(c).view(rec)})
}

// Listing limits.
const (
	defaultListLimit = 50
	maxListLimit     = 500
)

func (s *Server) listSandboxes(c echo.Context) error {
	f, err := filterFromQuery(c)
	if err != nil {
		return err
	}
	limit := defaultListLimit
	if l := c.QueryParam("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > maxListLimit {
			return protocol.Errorf(protocol.CodeInvalidArgument, "limit must be a number from 1 to %d", maxListLimit)
		}
		limit = n
	}
	page, err := s.sandboxes.List(c.Request().Context(), principal(c).Org, f, limit, c.QueryParam("cursor"))
	if err != nil {
		return err
	}
	out := protocol.ListSandboxesResponse{Items: make([]protocol.Sandbox, 0, len(page.Records)), NextCursor: page.Next}
	views := s.viewer(c)
	for _, r := range page.Records {
		out.Items = append(out.Items, views.view(r))
	}
	return c.JSON(http.StatusOK, out)
}

// filterFromQuery reads ?tag=k=v (repeatable) and ?status=s (repeatable or comma-separated).
func filterFromQuery(c echo.Context) (store.Filter, error) {
	q := c.QueryParams()
	f := store.Filter{}
	for _, t := range q["tag"] {
		k, v, err := sandbox.ParseTag(t)
		if err != nil {
			return f, err
		}
		if f.Tags == nil {
			f.Tags = map[string]string{}
		}
		if prev, dup := f.Tags[k]; dup && prev != v {
			// Both must match, so nothing can: say so rather than keep the last.
			return f, protocol.Errorf(protocol.CodeInvalidTag, "tag %q is selected twice with different values; a sandbox has one value per tag", k)
		}
		f.Tags[k] = v
	}
	if len(f.Tags) > sandbox.MaxTags {
		return f, protocol.Errorf(protocol.CodeInvalidTag, "at most %d tag selectors", sandbox.MaxTags)
	}
	for _, st := range q["status"] {
		for _, one := range splitComma(st) {
			if err := sandbox.ValidateStatus(one); err != nil {
				return f, err
			}
			f.Statuses = append(f.Statuses, one)
		}
	}
	return f, nil
}

func (s *Server) getSandbox(c echo.Context) error {
	return c.JSON(http.StatusOK, s.viewer(c).view(sandboxOf(c)))
}

// viewer makes the views of one answer. Each names the sandbox's dataplane on the broker hosting
// it (clients dial it from there: another broker answers wrong_node); a hosting broker's base URL
// is looked up once per answer, so a list costs one Redis read per other broker, not per sandbox.
type viewer struct {
	s     *Server
	c     echo.Context
	bases map[string]string // node -> dataplane URL prefix ("" when it could not be had)
}

func (s *Server) viewer(c echo.Context) *viewer {
	return &viewer{s: s, c: c, bases: map[string]string{}}
}

func (w *viewer) view(rec store.Record) protocol.Sandbox {
	v := sandbox.View(rec)
	if w.s.dataplaneURL == nil {
		return v
	}
	suffix := url.PathEscape(rec.ID) + "/dataplane"
	prefix, known := w.bases[rec.Node]
	if !known {
		u, err := w.s.dataplaneURL(w.c.Request().Context(), rec)
		if err != nil {
			w.s.log.Warn("sandbox view without its dataplane URL", "request_id", requestID(w.c), "sandbox_id", rec.ID, "err", err)
		}
		// The URL ends in the sandbox's id and "/dataplane" (protocol.DataplaneURL); the rest is the
		// hosting broker's, the same for its other sandboxes.
		prefix = strings.TrimSuffix(u, suffix)
		if prefix == u {
			prefix = ""
		}
		w.bases[rec.Node] = prefix
	}
	if prefix != "" {
		v.DataplaneURL = prefix + suffix
	}
	return v
}

func (s *Server) stopSandbox(c echo.Context) error {
	rec, err := s.sandboxes.Stop(c.Request().Context(), s.caller(c), sandboxOf(c).ID, protocol.StopRequested)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, s.viewer(c).view(rec))
}

func (s *Server) resumeSandbox(c echo.Context) error {
	rec, err := s.sandboxes.Resume(c.Request().Context(), s.caller(c), sandboxOf(c).ID)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, s.viewer(c).view(rec))
}

func (s *Server) deleteSandbox(c echo.Context) error {
	rec, err := s.sandboxes.Delete(c.Request().Context(), s.caller(c), sandboxOf(c).ID)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, protocol.DeleteSandboxesResponse{Deleted: []protocol.Sandbox{sandbox.View(rec)}})
}

// deleteSandboxes deletes every sandbox matching ?tag=k=v selectors (all must match), or with
// ?dry_run=true lists what would go.
func (s *Server) deleteSandboxes(c echo.Context) error {
	f, err := filterFromQuery(c)
	if err != nil {
		return err
	}
	if len(f.Statuses) > 0 {
		return protocol.Errorf(protocol.CodeInvalidArgument, "batch delete selects by tag only")
	}
	dry, err := boolParam(c, "dry_run")
	if err != nil {
		return err
	}
	recs, err := s.sandboxes.DeleteMatching(c.Request().Context(), s.caller(c), f.Tags, dry)
	out := protocol.DeleteSandboxesResponse{DryRun: dry, Deleted: make([]protocol.Sandbox, 0, len(recs))}
	for _, r := range recs {
		out.Deleted = append(out.Deleted, sandbox.View(r))
	}
	if err != nil {
		// Only a batch that got under way failed partly; a refusal (no selector) is the caller's,
		// and a failure before any delete is logged with the answer if it is the broker's.
		if len(recs) > 0 && !dry {
			s.log.Error("batch delete partly failed", "request_id", requestID(c), "deleted", len(recs), "err", err)
		}
		return err
	}
	return c.JSON(http.StatusOK, out)
}

func (s *Server) heartbeat(c echo.Context) error {
	l, err := s.sandboxes.Heartbeat(c.Request().Context(), principal(c).Org, c.Param("ref"))
	if err != nil {
		return err
	}
	// The hottest route answers without echo's JSON encoder, a tenth of its CPU.
	if b, ok := appendLease(make([]byte, 0, 128), leaseView(l)); ok {
		return c.Blob(http.StatusOK, echo.MIMEApplicationJSON, b)
	}
	return c.JSON(http.StatusOK, leaseView(l))
}

// maxBatchRefs bounds one POST /v1/heartbeats.
const maxBatchRefs = 1000

// heartbeats renews many leases in one request, for clients that keep many sandboxes alive: the
// beats share Redis round trips, and one request replaces hundreds.
func (s *Server) heartbeats(c echo.Context) error {
	var req protocol.HeartbeatsRequest
	if err := decodeJSON(c, &req); err != nil {
		return err
	}
	if len(req.Refs) == 0 || len(req.Refs) > maxBatchRefs {
		return protocol.Errorf(protocol.CodeInvalidArgument, "refs must list 1 to %d sandbox ids or names", maxBatchRefs)
	}
	if err := s.limitBatch(c.Request().Context(), principal(c), len(req.Refs)); err != nil {
		return err
	}
	leases, errs := s.sandboxes.HeartbeatMany(c.Request().Context(), principal(c).Org, req.Refs)
	out := protocol.HeartbeatsResponse{Items: make([]protocol.HeartbeatItem, len(req.Refs))}
	var brokerErrs []error // the broker's own failures (Redis down), not the refs'
	for i, ref := range req.Refs {
		out.Items[i].Ref = ref
		if errs[i] != nil {
			status, pe := apiError(errs[i])
			if status >= 500 {
				brokerErrs = append(brokerErrs, errs[i])
			}
			out.Items[i].Error = pe
			continue
		}
		l := leaseView(leases[i])
		out.Items[i].Lease = &l
	}
	switch {
	case len(brokerErrs) == len(req.Refs):
		// Nothing renewed, for the broker's reason: one error answer (503 when Redis is down) that
		// clients retry, not a 200 whose every item failed.
		return brokerErrs[0]
	case len(brokerErrs) > 0:
		s.log.Error("batch heartbeat: items failed", "request_id", requestID(c), "failed", len(brokerErrs), "refs", len(req.Refs), "err", brokerErrs[0])
	}
	return c.JSON(http.StatusOK, out)
}

// appendLease encodes a lease exactly as encoding/json does, for ids and statuses of plain ASCII
// (always, for ours); ok is false otherwise.
func appendLease(b []byte, l protocol.HeartbeatResponse) ([]byte, bool) {
	for _, s := range []string{l.SandboxID, l.Status, l.NodeStatus} {
		for i := 0; i < len(s); i++ {
			if c := s[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
				return nil, false
			}
		}
	}
	b = append(b, `{"sandbox_id":"`...)
	b = append(b, l.SandboxID...)
	b = append(b, `","status":"`...)
	b = append(b, l.Status...)
	b = append(b, `","ttl_seconds":`...)
	b = strconv.AppendInt(b, l.TTLSeconds, 10)
	b = append(b, `,"expires_at":`...)
	if l.ExpiresAt == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '"')
		b = l.ExpiresAt.AppendFormat(b, time.RFC3339Nano)
		b = append(b, '"')
	}
	if l.NodeStatus != "" {
		b = append(b, `,"node_status":"`...)
		b = append(b, l.NodeStatus...)
		b = append(b, '"')
	}
	return append(b, "}\n"...), true
}

func (s *Server) setTTL(c echo.Context) error {
	var req protocol.TTLRequest
	if err := decodeJSON(c, &req); err != nil {
		return err
	}
	if req.TTLSeconds == nil {
		return protocol.Errorf(protocol.CodeInvalidTTL, "ttl_seconds is required")
	}
	l, err := s.sandboxes.SetTTL(c.Request().Context(), principal(c).Org, sandboxOf(c).ID, leaseOf(*req.TTLSeconds))
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, leaseView(l))
}

// leaseOf is a request's ttl_seconds as a lease, for the sandbox manager to check against its
// bounds. Past what a Duration holds it saturates: multiplying would wrap (18446744078 s would
// become a 4.3 s lease), and the saturated value is refused as over --max-ttl like any other.
func leaseOf(seconds int64) time.Duration {
	const most = math.MaxInt64 / int64(time.Second)
	return time.Duration(min(max(seconds, -most), most)) * time.Second
}

func leaseView(l store.Lease) protocol.HeartbeatResponse {
	out := protocol.HeartbeatResponse{SandboxID: l.ID, Status: l.Status, TTLSeconds: int64(l.TTL / time.Second)}
	if !l.ExpiresAt.IsZero() {
		out.ExpiresAt = &l.ExpiresAt
	}
	if !l.NodeLostAt.IsZero() {
		out.NodeStatus = protocol.NodeLost
	}
	return out
}

func (s *Server) environment(c echo.Context) error {
	rec := sandboxOf(c)
	env, err := s.sandboxes.Environment(rec)
	if err != nil {
		return err
	}
	return c.JSON(http.StatusOK, protocol.EnvironmentResponse{SandboxID: rec.ID, Env: env})
}

func boolParam(c echo.Context, name string) (bool, error) {
	v := c.QueryParam(name)
	if v == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, protocol.Errorf(protocol.CodeInvalidArgument, "%s must be true or false", name)
	}
	return b, nil
}

func splitComma(s string) []string {
	var out []string
	for _, p := range bytes.Split([]byte(s), []byte(",")) {
		if t := string(bytes.TrimSpace(p)); t != "" {
			out = append(out, t)
		}
	}
	return out
}
