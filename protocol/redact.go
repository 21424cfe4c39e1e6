package protocol

import (
	"net/url"
	"strings"
)

// RedactURL is a URL fit for an error message or a log line: its password replaced by "xxxxx" and
// its query dropped (a caller may have put a credential there). It handles URLs url.Parse refuses
// too, since those are the ones error messages quote.
func RedactURL(raw string) string {
	if i := strings.IndexByte(raw, '?'); i >= 0 {
		raw = raw[:i]
	}
	if u, err := url.Parse(raw); err == nil {
		if u.User == nil {
			return raw // as given: re-encoding it would only make it harder to recognise
		}
		return u.Redacted()
	}
	if at := strings.LastIndex(raw, "@"); at >= 0 {
		if i := strings.Index(raw, "://"); i >= 0 && i < at {
			return raw[:i+3] + "xxxxx@" + raw[at+1:]
		}
	}
	return raw
}
