package client

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// EventOptions choose what Events streams.
type EventOptions struct {
	// Ref is a sandbox id or name; "" streams the whole org.
	Ref string
	// After resumes after this event id (exactly: every later event, once).
	After string
	// Backlog starts with up to this many recent events (when After is "").
	Backlog int
	// Follow keeps the stream open for new events; false returns after what there is.
	Follow bool
	// OnReconnect, when set, is told about each reconnect after a dropped stream.
	OnReconnect func(err error, attempt int)
	// OnOpen, when set, is called each time the stream opens (first and after every reconnect),
	// before its first event: the broker has subscribed by then, so every event that happens
	// after OnOpen is delivered. A caller that must not miss what it does next waits for it.
	OnOpen func()
}

// Events streams sandbox events to fn until ctx ends, fn returns an error, or (without Follow) the
// events there are have been delivered. A dropped stream, and an answer that says retry (503 while
// the broker cannot reach Redis, 502/504 from a proxy, 429), is reopened with backoff and
// Last-Event-ID, so no event is lost or repeated (a reset event says when the broker's log no
// longer held the position). A broker that never answered at all is not retried: the error says
// it is unreachable (UnreachableError), which is a setting to fix, not a blip to wait out.
func (c *Client) Events(ctx context.Context, o EventOptions, fn func(protocol.Event) error) error {
	last := o.After
	answered := false // the broker answered once: an unreachable one later is a restart or a blip
	for attempt := 0; ; attempt++ {
		err := c.streamOnce(ctx, o, last, func() { answered = true }, func(e protocol.Event) error {
			if e.ID != "" {
				last = e.ID
			}
			attempt = 0
			return fn(e)
		})
		var pe *protocol.Error
		var un *UnreachableError
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case err == nil && !o.Follow:
			return nil
		case errors.As(err, &pe):
			answered = true
			if !retryable(pe.Status) {
				return err // the broker refused: reconnecting would not help
			}
		case errors.Is(err, errStop):
			return err
		case errors.As(err, &un) && !answered:
			return err // it says where it looked and what to check
		}
		if o.OnReconnect != nil {
			o.OnReconnect(err, attempt+1)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(backoff(attempt)):
		}
		o.Backlog = 0
	}
}

// retryable reports an HTTP status that asks to try again later.
func retryable(status int) bool {
	switch status {
	case http.StatusServiceUnavailable, http.StatusBadGateway, http.StatusGatewayTimeout, http.StatusTooManyRequests:
		return true
	}
	return false
}

// backoff is the wait before reconnect attempt n+1: 250 ms doubling to 5 s, with up to a fifth
// of jitter so that the panes of many users do not come back in step after a broker restart.
func backoff(attempt int) time.Duration {
	d := min(250*time.Millisecond<<min(attempt, 5), 5*time.Second)
	return d - time.Duration(rand.Int64N(int64(d/5)))
}

// errStop wraps an error returned by the caller's fn: it ends Events.
var errStop = errors.New("stopped by the event handler")

func (c *Client) streamOnce(ctx context.Context, o EventOptions, after string, opened func(), fn func(protocol.Event) error) error {
	path := "/v1/events"
	if o.Ref != "" {
		path = sandboxPath(o.Ref, "events")
	}
	q := url.Values{}
	if after != "" {
		q.Set("last_event_id", after)
	} else if o.Backlog > 0 {
		q.Set("backlog", strconv.Itoa(o.Backlog))
	}
	if !o.Follow {
		q.Set("follow", "false")
	}
	// SSE is long-lived: no overall client timeout, only the caller's context.
	hc := *c.http
	hc.Timeout = 0
	resp, err := c.send(ctx, &hc, http.MethodGet, path, q, nil, "text/event-stream")
	if err != nil {
		return err
	}
	opened()
	if o.OnOpen != nil {
		o.OnOpen()
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var data strings.Builder
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if data.Len() == 0 {
				continue
			}
			var e protocol.Event
			if err := json.Unmarshal([]byte(data.String()), &e); err == nil {
				if err := fn(e); err != nil {
					return errors.Join(errStop, err)
				}
			}
			data.Reset()
		case strings.HasPrefix(line, "data:"):
			data.WriteString(strings.TrimPrefix(strings.TrimPrefix(line, "data:"), " "))
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	if o.Follow {
		return errors.New("the event stream ended")
	}
	return nil
}
