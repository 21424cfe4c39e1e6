package kube

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// NewClient is the provider's client for cfg: client-go's, with every request sent again while the
// API server throttles it (429) or refuses connections (restarting), for as long as the request's
// context lasts.
//
// client-go alone retries a 429 that carries Retry-After ten times (about ten seconds with API
// Priority and Fairness' Retry-After: 1), then fails the call, whatever time its caller gave it: a
// create, a stop or a delete failed while the API server was merely busy. Measured on the real API
// server (TestAPIServerThrottling). Here the wait is the caller's to bound.
func NewClient(cfg *rest.Config) (kubernetes.Interface, error) {
	cfg = rest.CopyConfig(cfg)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return retryThrottled{rt} })
	return kubernetes.NewForConfig(cfg)
}

// retryThrottled sends a request again, with backoff, while the API server answers 429 or refuses
// the connection, until the request's context ends (or would end before the next try). Both are
// safe to resend whatever the verb: a 429 is answered before the request is processed, and a
// refused connection carried nothing. Its last answer then goes to client-go without Retry-After,
// so that client-go reports the throttling (apierrors.IsTooManyRequests) instead of waiting again.
type retryThrottled struct{ rt http.RoundTripper }

const (
	throttleFirstWait = 250 * time.Millisecond
	throttleMaxWait   = 2 * time.Second
	// throttleMaxRetryAfter bounds the server's Retry-After we honour (it is a floor for the wait).
	throttleMaxRetryAfter = 30 * time.Second
)

func (t retryThrottled) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	next := throttleFirstWait
	for {
		resp, err := t.rt.RoundTrip(req)
		refused := err != nil && errors.Is(err, syscall.ECONNREFUSED)
		if !refused && (err != nil || resp.StatusCode != http.StatusTooManyRequests) {
			return resp, err
		}
		if req.Body != nil && req.Body != http.NoBody && req.GetBody == nil {
			return resp, err // a body that cannot be read again: client-go decides
		}
		wait := next + rand.N(next/2)
		if resp != nil {
			if s, perr := strconv.Atoi(resp.Header.Get("Retry-After")); perr == nil && s > 0 {
				wait = max(wait, min(time.Duration(s)*time.Second, throttleMaxRetryAfter))
			}
			// Keep the answer (a few bytes) to give it back if this was the last try.
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
			resp.Body = io.NopCloser(bytes.NewReader(b))
			resp.Header.Del("Retry-After")
		}
		if d, ok := ctx.Deadline(); ok && time.Until(d) < wait {
			return resp, err
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			if resp != nil {
				return resp, nil
			}
			return nil, err
		case <-timer.C:
		}
		next = min(next*2, throttleMaxWait)
		if req.GetBody != nil {
			body, gerr := req.GetBody()
			if gerr != nil {
				return resp, err
			}
			req = req.Clone(ctx)
			req.Body = body
		}
	}
}
