package client

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ParseDuration is time.ParseDuration that also takes days: "7d", "1d12h".
func ParseDuration(s string) (time.Duration, error) {
	days := time.Duration(0)
	if i := strings.IndexByte(s, 'd'); i > 0 {
		n, err := strconv.Atoi(s[:i])
		if err != nil || n < 0 {
			return 0, fmt.Errorf("invalid duration %q", s)
		}
		days, s = time.Duration(n)*24*time.Hour, s[i+1:]
		if s == "" {
			return days, nil
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("invalid duration %q: use e.g. 90s, 30m, 2h, 7d", s)
	}
	return days + d, nil
}

// Duration is a pflag value for durations that accept days.
type Duration struct{ D *time.Duration }

// String is the value for --help. Zero is "0", which pflag shows as no default: a flag's usage
// says what leaving it unset means (usually "the broker's default").
func (d Duration) String() string {
	if d.D == nil || *d.D == 0 {
		return "0"
	}
	return d.D.String()
}

// Set parses a duration with days.
func (d Duration) Set(s string) error {
	v, err := ParseDuration(s)
	if err != nil {
		return err
	}
	*d.D = v
	return nil
}

// Type names the flag's type in --help.
func (d Duration) Type() string { return "duration" }
