package server

import (
	"errors"
	"math"
	"strconv"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

// retryError is a refusal that knows when a retry can succeed: its Retry-After.
type retryError struct {
	pe    *protocol.Error
	after time.Duration
}

func (e *retryError) Error() string { return e.pe.Error() }
func (e *retryError) Unwrap() error { return e.pe }

// quotaRetryAfter is the Retry-After of a quota refusal: the limit frees only when the org stops or
// deletes a sandbox, so this is how often a waiting client may look again.
const quotaRetryAfter = 10 * time.Second

// retryAfter is the Retry-After header value (whole seconds, at least 1) of a 429 answer.
func retryAfter(err error) string {
	d := time.Second
	var re *retryError
	var pe *protocol.Error
	switch {
	case errors.As(err, &re):
		d = re.after
	case errors.As(err, &pe) && pe.Code == protocol.CodeQuotaExceeded:
		d = quotaRetryAfter
	}
	return strconv.Itoa(max(1, int(math.Ceil(d.Seconds()))))
}
