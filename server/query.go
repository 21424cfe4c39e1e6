package server

import (
	"errors"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/sbxbroker/broker/protocol"
)

// maxQueryParams bounds a request's query. The routes take a few parameters (at most sandbox.MaxTags
// tag selectors and a handful of others); past this the query is refused rather than parsed. Go's
// url.ParseQuery gives up silently past 10,000 parameters (echo then sees none), which once turned
// a filtered list into a list of every sandbox.
const maxQueryParams = 256

// queryParams names the query parameters of each route that takes any ("METHOD path" in echo's
// form); a name ending in "*" may repeat. A parameter not listed, or a single one given twice, is
// refused: a misspelled dry_run or a second limit must not be quietly ignored. Routes absent from
// the table check only that their query is well formed.
var queryParams = map[string][]string{
	"GET /v1/sandboxes":                          {"tag*", "status*", "limit", "cursor"},
	"DELETE /v1/sandboxes":                       {"tag*", "dry_run"},
	"GET /v1/events":                             {"last_event_id", "backlog", "follow"},
	"GET /v1/sandboxes/:ref/events":              {"last_event_id", "backlog", "follow"},
	"POST /v1/sandboxes":                         nil,
	"GET /v1/sandboxes/:ref":                     nil,
	"DELETE /v1/sandboxes/:ref":                  nil,
	"POST /v1/sandboxes/:ref/stop":               nil,
	"POST /v1/sandboxes/:ref/resume":             nil,
	"POST /v1/sandboxes/:ref/ttl":                nil,
	"POST /v1/sandboxes/:ref/heartbeat":          nil,
	"POST /v1/heartbeats":                        nil,
	"GET /v1/sandboxes/:ref/environment":         nil,
	"POST /v1/sandboxes/:ref/delegations":        nil,
	"GET /v1/sandboxes/:ref/delegations":         nil,
	"DELETE /v1/sandboxes/:ref/delegations":      nil,
	"DELETE /v1/sandboxes/:ref/delegations/:jti": nil,
	"POST /v1/tokens/introspect":                 nil,
	"GET /v1/orphans":                            nil,
	"GET /v1/limits":                             nil,
	"PUT /v1/sandboxes/:ref/dataplane/upload":    {"path", "mode"},
}

// checkQuery refuses a query that is malformed, too long, or not what the route takes, before any
// handler reads it: a handler must never act on a query that was partly dropped.
func checkQuery(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		raw := c.Request().URL.RawQuery
		if raw == "" {
			return next(c)
		}
		if n := strings.Count(raw, "&") + 1; n > maxQueryParams {
			return protocol.Errorf(protocol.CodeInvalidArgument,
				"the query has %d parameters, over the %d a request may have; filter with fewer (docs/openapi.yaml lists each route's)", n, maxQueryParams)
		}
		q, err := url.ParseQuery(raw)
		if err != nil {
			return protocol.Errorf(protocol.CodeInvalidArgument,
				"the query is malformed (%s): separate parameters with &, and percent-encode ; %% and &", queryProblem(err))
		}
		method := c.Request().Method
		if method == http.MethodHead {
			method = http.MethodGet // a HEAD takes its GET's query
		}
		names, listed := queryParams[method+" "+c.Path()]
		if !listed {
			return next(c)
		}
		for name, vals := range q {
			switch {
			case slices.Contains(names, name+"*"):
			case slices.Contains(names, name):
				if len(vals) > 1 {
					return protocol.Errorf(protocol.CodeInvalidArgument, "query parameter %q is given %d times; give it once", clipForLog(name), len(vals))
				}
			case len(names) == 0:
				return protocol.Errorf(protocol.CodeInvalidArgument, "this route takes no query parameters, and %q is one", clipForLog(name))
			default:
				return protocol.Errorf(protocol.CodeInvalidArgument, "unknown query parameter %q: this route takes %s", clipForLog(name), strings.ReplaceAll(strings.Join(names, ", "), "*", ""))
			}
		}
		return next(c)
	}
}

// queryProblem says what is wrong with a query without echoing it back.
func queryProblem(err error) string {
	var ee url.EscapeError
	if errors.As(err, &ee) {
		return "a bad %-escape"
	}
	return "a bare semicolon" // ParseQuery's one other complaint below the count checked above
}
