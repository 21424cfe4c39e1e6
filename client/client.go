// Package client is the Go SDK of the broker's REST API. It speaks only the wire format of package
// protocol and never imports broker internals; sbctl and the end-to-end tests use it.
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// Client calls one broker with one credential (an org API key).
type Client struct {
	base   *url.URL
	apiKey string
	http   *http.Client
	// UserAgent is sent with every request.
	UserAgent string
}

// New returns a client for the broker at baseURL (e.g. http://127.0.0.1:7070).
func New(baseURL, apiKey string) (*Client, error) {
	u, err := url.Parse(strings.TrimRight(baseURL, "/"))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("broker URL %q is not an http(s) URL like http://127.0.0.1:7070", protocol.RedactURL(baseURL))
	}
	return &Client{base: u, apiKey: apiKey, http: &http.Client{Timeout: 2 * time.Minute}, UserAgent: "sbx-go-client"}, nil
}

// SetHTTPClient replaces the HTTP client (timeouts, proxies, test transports).
func (c *Client) SetHTTPClient(h *http.Client) { c.http = h }

// APIKey is the credential this client sends.
// BaseURL is the broker URL the client talks to, with any password in it masked.
func (c *Client) BaseURL() string { return c.base.Redacted() }

func (c *Client) APIKey() string { return c.apiKey }

// UnreachableError is returned when the broker cannot be reached at all.
type UnreachableError struct {
	// URL is the broker's URL with its password, if any, redacted.
	URL string
	Err error
}

func (e *UnreachableError) Error() string {
	return fmt.Sprintf("cannot reach the broker at %s: %v (is it running? check --broker / SBX_BROKER_URL)", e.URL, e.Err)
}

func (e *UnreachableError) Unwrap() error { return e.Err }

// do sends a request and decodes a JSON answer into out (unless nil). Non-2xx answers come back as
// *protocol.Error carrying the broker's code, message, request id and HTTP status.
func (c *Client) do(ctx context.Context, method, path string, query url.Values, in, out any) error {
	resp, err := c.send(ctx, c.http, method, path, query, in, "application/json")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		io.Copy(io.Discard, resp.Body)
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("broker answered %s %s with a body that is not the expected JSON: %w", method, path, err)
	}
	return nil
}

// send performs a request and returns the response when it is 2xx.
func (c *Client) send(ctx context.Context, hc *http.Client, method, path string, query url.Values, in any, accept string) (*http.Response, error) {
	// path's dynamic segments are escaped by sandboxPath; the rest is literal.
	target := c.base.String() + path
	if len(query) > 0 {
		target += "?" + query.Encode()
	}
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return nil, err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, target, body)
	if err != nil {
		var ue *url.Error // it would show the URL with its password
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("%s %s%s: %w", method, c.base.Redacted(), path, err)
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", accept)
	req.Header.Set("User-Agent", c.UserAgent)
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	resp, err := hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, &UnreachableError{URL: c.base.Redacted(), Err: errors.Unwrap(err)}
	}
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return resp, nil
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var eb protocol.ErrorBody
	if json.Unmarshal(raw, &eb) != nil || eb.Error.Code == "" {
		return nil, &protocol.Error{Code: "http_" + strconv.Itoa(resp.StatusCode), Status: resp.StatusCode,
			Message: fmt.Sprintf("broker answered %s with a non-API body; is %s really a broker?", resp.Status, c.base.Redacted())}
	}
	eb.Error.Status = resp.StatusCode
	return nil, &eb.Error
}

func sandboxPath(ref string, rest ...string) string {
	p := "/v1/sandboxes/" + url.PathEscape(ref)
	for _, r := range rest {
		p += "/" + r
	}
	return p
}

// CreateSandbox creates a sandbox, or reuses the one of the same name (unless Reuse is false).
func (c *Client) CreateSandbox(ctx context.Context, req protocol.CreateSandboxRequest) (protocol.CreateSandboxResponse, error) {
	var out protocol.CreateSandboxResponse
	return out, c.do(ctx, http.MethodPost, "/v1/sandboxes", nil, req, &out)
}

// GetSandbox reads a sandbox by id or name.
func (c *Client) GetSandbox(ctx context.Context, ref string) (protocol.Sandbox, error) {
	var out protocol.Sandbox
	return out, c.do(ctx, http.MethodGet, sandboxPath(ref), nil, nil, &out)
}

// ListOptions filter and page a listing.
type ListOptions struct {
	Tags     map[string]string
	Statuses []string
	Limit    int
	Cursor   string
}

func (o ListOptions) query() url.Values {
	q := url.Values{}
	for k, v := range o.Tags {
		q.Add("tag", k+"="+v)
	}
	for _, s := range o.Statuses {
		q.Add("status", s)
	}
	if o.Limit > 0 {
		q.Set("limit", strconv.Itoa(o.Limit))
	}
	if o.Cursor != "" {
		q.Set("cursor", o.Cursor)
	}
	return q
}

// ListSandboxes returns one page.
func (c *Client) ListSandboxes(ctx context.Context, o ListOptions) (protocol.ListSandboxesResponse, error) {
	var out protocol.ListSandboxesResponse
	return out, c.do(ctx, http.MethodGet, "/v1/sandboxes", o.query(), nil, &out)
}

// ListAllSandboxes follows the cursor to the end.
func (c *Client) ListAllSandboxes(ctx context.Context, o ListOptions) ([]protocol.Sandbox, error) {
	var all []protocol.Sandbox
	for {
		p, err := c.ListSandboxes(ctx, o)
		if err != nil {
			return nil, err
		}
		all = append(all, p.Items...)
		if p.NextCursor == "" {
			return all, nil
		}
		o.Cursor = p.NextCursor
	}
}

// StopSandbox stops a sandbox (files stay).
func (c *Client) StopSandbox(ctx context.Context, ref string) (protocol.Sandbox, error) {
	var out protocol.Sandbox
	return out, c.do(ctx, http.MethodPost, sandboxPath(ref, "stop"), nil, nil, &out)
}

// ResumeSandbox starts a stopped sandbox again.
func (c *Client) ResumeSandbox(ctx context.Context, ref string) (protocol.Sandbox, error) {
	var out protocol.Sandbox
	return out, c.do(ctx, http.MethodPost, sandboxPath(ref, "resume"), nil, nil, &out)
}

// DeleteSandbox deletes one sandbox with its files.
func (c *Client) DeleteSandbox(ctx context.Context, ref string) (protocol.DeleteSandboxesResponse, error) {
	var out protocol.DeleteSandboxesResponse
	return out, c.do(ctx, http.MethodDelete, sandboxPath(ref), nil, nil, &out)
}

// DeleteSandboxes deletes every sandbox carrying all the tags; dryRun only lists them.
func (c *Client) DeleteSandboxes(ctx context.Context, tags map[string]string, dryRun bool) (protocol.DeleteSandboxesResponse, error) {
	q := ListOptions{Tags: tags}.query()
	if dryRun {
		q.Set("dry_run", "true")
	}
	var out protocol.DeleteSandboxesResponse
	return out, c.do(ctx, http.MethodDelete, "/v1/sandboxes", q, nil, &out)
}

// Heartbeat renews a running sandbox's lease.
func (c *Client) Heartbeat(ctx context.Context, ref string) (protocol.HeartbeatResponse, error) {
	var out protocol.HeartbeatResponse
	return out, c.do(ctx, http.MethodPost, sandboxPath(ref, "heartbeat"), nil, nil, &out)
}

// Heartbeats renews many leases in one request; each ref gets its lease or its own error.
func (c *Client) Heartbeats(ctx context.Context, refs []string) (protocol.HeartbeatsResponse, error) {
	var out protocol.HeartbeatsResponse
	return out, c.do(ctx, http.MethodPost, "/v1/heartbeats", nil, protocol.HeartbeatsRequest{Refs: refs}, &out)
}

// SetTTL changes a sandbox's lease length (and renews it when running).
func (c *Client) SetTTL(ctx context.Context, ref string, ttl time.Duration) (protocol.HeartbeatResponse, error) {
	secs := int64(ttl / time.Second)
	var out protocol.HeartbeatResponse
	return out, c.do(ctx, http.MethodPost, sandboxPath(ref, "ttl"), nil, protocol.TTLRequest{TTLSeconds: &secs}, &out)
}

// Environment is what printenv shows inside a running sandbox.
func (c *Client) Environment(ctx context.Context, ref string) (protocol.EnvironmentResponse, error) {
	var out protocol.EnvironmentResponse
	return out, c.do(ctx, http.MethodGet, sandboxPath(ref, "environment"), nil, nil, &out)
}

// Orphans lists sandboxes that look abandoned, with reasons (the sweep's dry run).
func (c *Client) Orphans(ctx context.Context) (protocol.OrphansResponse, error) {
	var out protocol.OrphansResponse
	return out, c.do(ctx, http.MethodGet, "/v1/orphans", nil, nil, &out)
}

// SandboxDataplaneURL is the dataplane URL of a sandbox on the broker that hosts it, as the
// sandbox's view says; with a broker too old to say, the one on this broker (DataplaneURL). Dial
// it: a broker that does not host the sandbox answers wrong_node.
func (c *Client) SandboxDataplaneURL(ctx context.Context, ref string) (string, error) {
	sb, err := c.GetSandbox(ctx, ref)
	if err != nil {
		return "", err
	}
	if sb.DataplaneURL != "" {
		return sb.DataplaneURL, nil
	}
	return c.DataplaneURL(sb.ID), nil
}

// DataplaneURL is the dataplane URL of a sandbox on this broker (ws:// for http://). It carries no
// user or password: the dataplane takes its credential in the Authorization header only.
func (c *Client) DataplaneURL(ref string) string {
	u := *c.base
	u.User = nil
	dp, err := protocol.DataplaneURL(u.String(), ref)
	if err != nil {
		// New accepted a base that DataplaneURL does not (a query or fragment): drop them.
		u.RawQuery, u.Fragment, u.ForceQuery = "", "", false
		dp, _ = protocol.DataplaneURL(u.String(), ref)
	}
	return dp
}
