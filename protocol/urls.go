package protocol

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"strings"
)

// SandboxIDPrefix starts every sandbox id, so an id is never mistaken for a name (names may not
// start with it).
const SandboxIDPrefix = "sb_"

// NewSandboxID mints a sandbox id: SandboxIDPrefix and a random UUID v4, in canonical lower-case
// form. It is the one place ids are made.
func NewSandboxID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return SandboxIDPrefix + h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// ValidSandboxID reports whether id is SandboxIDPrefix followed by a UUID in its 8-4-4-4-12 hex
// form. Host paths and cgroup names are built from ids, so nothing else (no "/", no "..") passes.
// It is the one place ids are recognised.
func ValidSandboxID(id string) bool {
	u, ok := strings.CutPrefix(id, SandboxIDPrefix)
	if !ok || len(u) != 36 {
		return false
	}
	for i := 0; i < len(u); i++ {
		c := u[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
				return false
			}
		}
	}
	return true
}

// parseBase parses a broker base URL: http or https (in any case: URL schemes are
// case-insensitive), a host, no user info, query or fragment, and no path beyond "/" unless
// pathOK.
func parseBase(raw string, pathOK bool) (*url.URL, error) {
	bad := fmt.Errorf("%q must be a base URL like http://broker.internal:7070 or https://broker.example", RedactURL(raw))
	if strings.TrimSpace(raw) != raw || strings.ContainsAny(raw, "\r\n\t") {
		return nil, bad
	}
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" || u.User != nil || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || u.Opaque != "" {
		return nil, bad
	}
	u.Scheme = strings.ToLower(u.Scheme)
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, bad
	}
	u.Path = strings.TrimRight(u.Path, "/")
	u.RawPath = ""
	if u.Path != "" && !pathOK {
		return nil, bad
	}
	return u, nil
}

// BrokerBaseURL checks and normalises a broker's base URL (--advertise-url): scheme in lower case,
// no trailing "/". The result is what DataplaneURL builds from.
func BrokerBaseURL(raw string) (string, error) {
	u, err := parseBase(raw, false)
	if err != nil {
		return "", err
	}
	return u.String(), nil
}

// DataplaneURL is the dataplane URL of sandbox ref on the broker at base: ws:// for an http base,
// wss:// for https. It is the one builder of dataplane URLs (run-config blocks, the SDK); a path
// prefix of base (a client behind a proxy) is kept.
func DataplaneURL(base, ref string) (string, error) {
	u, err := parseBase(base, true)
	if err != nil {
		return "", err
	}
	if u.Scheme == "https" {
		u.Scheme = "wss"
	} else {
		u.Scheme = "ws"
	}
	return u.String() + "/v1/sandboxes/" + url.PathEscape(ref) + "/dataplane", nil
}

// MCPURLOf is the MCP (Streamable HTTP) URL beside a sandbox's dataplane URL: the same broker and
// path prefix, http:// for ws:// and https:// for wss://, ending in /mcp instead of /dataplane.
// It answers "" for anything that is not a dataplane URL.
func MCPURLOf(dataplaneURL string) string {
	u, err := url.Parse(dataplaneURL)
	if err != nil || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return ""
	}
	switch strings.ToLower(u.Scheme) {
	case "ws":
		u.Scheme = "http"
	case "wss":
		u.Scheme = "https"
	default:
		return ""
	}
	p, ok := strings.CutSuffix(u.EscapedPath(), "/dataplane")
	if !ok {
		return ""
	}
	return u.Scheme + "://" + u.Host + p + "/mcp"
}
