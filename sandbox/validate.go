package sandbox

import (
	"regexp"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/sbxbroker/broker/protocol"
)

var (
	nameRE   = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)
	tagKeyRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9_.\-/]{0,62})$`)
)

// Tag bounds: tags are indexed in Redis, so both count and size are capped.
const (
	MaxTags        = 16
	MaxTagValueLen = 255
)

// ValidateName checks a sandbox name: a lowercase DNS label, at most 63 characters.
func ValidateName(name string) error {
	if !nameRE.MatchString(name) {
		return protocol.Errorf(protocol.CodeInvalidName,
			"sandbox name %q is invalid: use 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit", clip(name))
	}
	return nil
}

// ValidateTags checks tag count, key syntax and value size.
func ValidateTags(tags map[string]string) error {
	if len(tags) > MaxTags {
		return protocol.Errorf(protocol.CodeInvalidTag, "%d tags given: at most %d are allowed", len(tags), MaxTags)
	}
	keys := make([]string, 0, len(tags))
	for k := range tags {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if err := validateTag(k, tags[k]); err != nil {
			return err
		}
	}
	return nil
}

func validateTag(k, v string) error {
	if !tagKeyRE.MatchString(k) {
		return protocol.Errorf(protocol.CodeInvalidTag,
			"tag key %q is invalid: use 1-63 letters, digits, '_', '.', '-' or '/', starting with a letter or digit", clip(k))
	}
	if len(v) > MaxTagValueLen || !utf8.ValidString(v) || strings.ContainsFunc(v, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		return protocol.Errorf(protocol.CodeInvalidTag,
			"tag %s has an invalid value: at most %d bytes of printable UTF-8", k, MaxTagValueLen)
	}
	return nil
}

// ParseTag parses a "k=v" selector or tag.
func ParseTag(s string) (string, string, error) {
	k, v, ok := strings.Cut(s, "=")
	if !ok {
		return "", "", protocol.Errorf(protocol.CodeInvalidTag, "tag %q is not of the form key=value", clip(s))
	}
	if err := validateTag(k, v); err != nil {
		return "", "", err
	}
	return k, v, nil
}

// ValidateStatus checks a status filter.
func ValidateStatus(s string) error {
	for _, known := range protocol.Statuses {
		if s == known {
			return nil
		}
	}
	return protocol.Errorf(protocol.CodeInvalidStatus, "status %q is unknown: use one of %s", clip(s), strings.Join(protocol.Statuses, ", "))
}

// ValidateTTL checks a lease length against the broker's bounds.
func ValidateTTL(ttl, max time.Duration) error {
	if ttl < time.Second || ttl > max {
		return protocol.Errorf(protocol.CodeInvalidTTL, "the lease is out of range: ttl_seconds must be 1 to %d (%s, the broker's --max-ttl)",
			int64(max/time.Second), max)
	}
	return nil
}

// clip keeps hostile input from flooding an error message.
func clip(s string) string {
	if len(s) > 80 {
		s = s[:80] + "..."
	}
	return strings.ToValidUTF8(s, "?")
}
