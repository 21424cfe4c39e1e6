package delegation

import (
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/google/uuid"

	"github.com/sbxbroker/broker/protocol"
)

// Config is shared by Issuer and Verifier, so that what one broker mints another verifies. Zero
// fields take the defaults below.
type Config struct {
	// Issuer is the iss claim. Default "sbx-broker".
	Issuer string
	// Audience is the aud claim. Default "sbx-dataplane".
	Audience string
	// DefaultTTL is the lifetime of a token minted with Grant.TTL == 0. Default 1h.
	DefaultTTL time.Duration
	// MaxTTL caps Grant.TTL. Default 24h. The keyring rotation window must exceed it (plus Leeway).
	MaxTTL time.Duration
	// Leeway is the clock skew between brokers that verification tolerates on nbf and iat (never on
	// exp: a token is dead from its exp on, everywhere). Default 30s; it cannot be zero, on purpose
	// (brokers' clocks differ).
	Leeway time.Duration
	// MaxTokenSize is the longest token, in bytes, that verification will parse. Default 8 KiB.
	MaxTokenSize int
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// Defaults of Config.
const (
	DefaultIssuer       = "sbx-broker"
	DefaultAudience     = "sbx-dataplane"
	DefaultTTL          = time.Hour
	DefaultMaxTTL       = 24 * time.Hour
	DefaultLeeway       = 30 * time.Second
	DefaultMaxTokenSize = 8 << 10
)

// withDefaults fills zero fields and checks the rest.
func (c Config) withDefaults() (Config, error) {
	if c.Issuer == "" {
		c.Issuer = DefaultIssuer
	}
	if c.Audience == "" {
		c.Audience = DefaultAudience
	}
	if c.DefaultTTL == 0 {
		c.DefaultTTL = DefaultTTL
	}
	if c.MaxTTL == 0 {
		c.MaxTTL = DefaultMaxTTL
	}
	if c.Leeway == 0 {
		c.Leeway = DefaultLeeway
	}
	if c.MaxTokenSize == 0 {
		c.MaxTokenSize = DefaultMaxTokenSize
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	switch {
	case c.MaxTTL < time.Second:
		return c, fmt.Errorf("delegation: MaxTTL %v must be at least 1s", c.MaxTTL)
	case c.DefaultTTL < time.Second || c.DefaultTTL > c.MaxTTL:
		return c, fmt.Errorf("delegation: DefaultTTL %v must be between 1s and MaxTTL (%v)", c.DefaultTTL, c.MaxTTL)
	case c.Leeway < 0:
		return c, fmt.Errorf("delegation: Leeway %v must not be negative", c.Leeway)
	case c.MaxTokenSize < 512:
		return c, fmt.Errorf("delegation: MaxTokenSize %d is too small for any token; leave it 0 for %d", c.MaxTokenSize, DefaultMaxTokenSize)
	}
	return c, nil
}

// Issuer mints delegation tokens with the keyring's active key.
type Issuer struct {
	keys *Keyring
	cfg  Config
}

// NewIssuer returns an Issuer signing with keys. It fails on an inconsistent Config.
func NewIssuer(keys *Keyring, cfg Config) (*Issuer, error) {
	if keys == nil {
		return nil, fmt.Errorf("delegation: NewIssuer needs a keyring")
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Issuer{keys: keys, cfg: cfg}, nil
}

// Grant is what an owner delegates: some scopes on one sandbox, for a while.
type Grant struct {
	// Org and SandboxID name the sandbox; Gen is its current token generation (≥ 1).
	Org       string
	SandboxID string
	Gen       int64
	// Subject is the owner principal, "key:<keyid>" (KeySubjectPrefix); it becomes the sub claim,
	// and revoking that key revokes the token.
	Subject string
	// Scopes is a non-empty subset of protocol.Scopes.
	Scopes []string
	// AllowCmd, when set, is the only programs the token may run: names or absolute paths (see
	// CheckCommand).
	AllowCmd []string
	// TTL is the token's lifetime; 0 means Config.DefaultTTL.
	TTL time.Duration
}

// Mint validates g and signs a token for it. Validation errors are *protocol.Error with code
// invalid_scope, invalid_ttl or invalid_argument; the returned Claims are what the token says (the
// caller records their metadata, never the token).
func (is *Issuer) Mint(g Grant) (token string, c Claims, err error) {
	switch {
	case g.Org == "":
		return "", Claims{}, protocol.Errorf(protocol.CodeInvalidArgument, "grant has no org")
	case g.SandboxID == "":
		return "", Claims{}, protocol.Errorf(protocol.CodeInvalidArgument, "grant has no sandbox id")
	case g.Subject == "":
		return "", Claims{}, protocol.Errorf(protocol.CodeInvalidArgument, "grant has no subject")
	case !strings.HasPrefix(g.Subject, KeySubjectPrefix) || len(g.Subject) == len(KeySubjectPrefix):
		return "", Claims{}, protocol.Errorf(protocol.CodeInvalidArgument, "grant subject must name the minting API key (%s<id>)", KeySubjectPrefix)
	case g.Gen < 1:
		return "", Claims{}, protocol.Errorf(protocol.CodeInvalidArgument, "grant has token generation %d; generations start at 1", g.Gen)
	}
	scopes, why := canonicalScopes(g.Scopes)
	if why != "" {
		return "", Claims{}, protocol.Errorf(protocol.CodeInvalidScope, "%s", why)
	}
	ttl := g.TTL
	if ttl == 0 {
		ttl = is.cfg.DefaultTTL
	}
	// JWT times have whole seconds: a lifetime under 1s could expire as it is issued.
	if ttl < time.Second || ttl > is.cfg.MaxTTL {
		return "", Claims{}, protocol.Errorf(protocol.CodeInvalidTTL,
			"token lifetime %v is out of range: it must be between 1s and %v", g.TTL, is.cfg.MaxTTL)
	}
	if why := checkAllowCmd(g.AllowCmd); why != "" {
		return "", Claims{}, protocol.Errorf(protocol.CodeInvalidArgument, "allow_cmd: %s", why)
	}
	if slices.Contains(scopes, protocol.ScopeFSWrite) {
		for _, p := range g.AllowCmd {
			// The token could write that file: with any program's bytes in it, the allowlist
			// would allow everything (CheckSearchPath is the same rule for bare names).
			if where := writableDir(path.Dir(p)); strings.HasPrefix(p, "/") && where != "" {
				return "", Claims{}, protocol.Errorf(protocol.CodeInvalidArgument,
					"allow_cmd: entry %s %s, where this token may rewrite files (scope %s; /proc reaches %s as /proc/self/cwd and /proc/self/root, and /dev/fd is /proc/self/fd), so it could run any program under that name: name a program outside the workspace, or mint the token without %s",
					quoteShort(p), where, protocol.ScopeFSWrite, protocol.WorkspaceRoot, protocol.ScopeFSWrite)
			}
		}
	}
	jti, err := uuid.NewRandom()
	if err != nil {
		return "", Claims{}, fmt.Errorf("delegation: token id: %w", err)
	}

	now := is.cfg.Now()
	c = Claims{
		RegisteredClaims: jwt.RegisteredClaims{
			Issuer:    is.cfg.Issuer,
			Subject:   g.Subject,
			Audience:  jwt.ClaimStrings{is.cfg.Audience},
			ExpiresAt: jwt.NewNumericDate(now.Add(ttl)),
			NotBefore: jwt.NewNumericDate(now),
			IssuedAt:  jwt.NewNumericDate(now),
			ID:        jti.String(),
		},
		Org:   g.Org,
		Sbx:   g.SandboxID,
		Gen:   g.Gen,
		Scope: protocol.JoinScopes(scopes),
	}
	if len(g.AllowCmd) > 0 {
		c.Cmd = append([]string(nil), g.AllowCmd...)
	}
	kid, key := is.keys.Signer()
	t := jwt.NewWithClaims(jwt.SigningMethodEdDSA, &c)
	t.Header["kid"] = kid
	t.Header["typ"] = protocol.TokenType
	token, err = t.SignedString(key)
	if err != nil {
		return "", Claims{}, fmt.Errorf("delegation: sign token: %w", err)
	}
	return token, c, nil
}

// Limits on a command allowlist.
const (
	MaxAllowCmd    = 32
	MaxAllowCmdLen = 255
)

// checkAllowCmd returns why an allowlist is not valid, or "" (nil is no allowlist). Entries are program names or absolute
// paths made of [A-Za-z0-9._+-] and '/', so they can never contain whitespace, quotes or shell
// metacharacters, and the first word of a command matches one only if the shell runs that program.
func checkAllowCmd(allow []string) string {
	// Given but empty ("allow_cmd": []) names no program; taken as absent, it would allow every one.
	if allow != nil && len(allow) == 0 {
		return "is empty, which would allow no program: name the programs, or omit allow_cmd to allow any"
	}
	if len(allow) > MaxAllowCmd {
		return fmt.Sprintf("%d entries; at most %d are allowed", len(allow), MaxAllowCmd)
	}
	for i, p := range allow {
		if why := checkCmdEntry(p); why != "" {
			return fmt.Sprintf("entry %s %s", quoteShort(p), why)
		}
		for _, q := range allow[:i] {
			if q == p {
				return fmt.Sprintf("entry %s is listed twice", quoteShort(p))
			}
		}
	}
	return ""
}

// checkCmdEntry returns why p is not a valid allowlist entry, or "".
func checkCmdEntry(p string) string {
	switch {
	case p == "":
		return "is empty"
	case len(p) > MaxAllowCmdLen:
		return fmt.Sprintf("is longer than %d bytes", MaxAllowCmdLen)
	case p[0] == '-':
		return "starts with '-'"
	}
	for i := 0; i < len(p); i++ {
		c := p[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '+' || c == '-' || c == '/') {
			return "contains " + strconv.QuoteRune(rune(c)) + "; use a program name or an absolute path of letters, digits and . _ + - /"
		}
	}
	if p[0] == '/' {
		if p == "/" || p[len(p)-1] == '/' {
			return "does not name a file"
		}
		for _, part := range strings.Split(p[1:], "/") {
			if part == "" || part == "." || part == ".." {
				return "is not a clean absolute path"
			}
		}
		return ""
	}
	if strings.Contains(p, "/") {
		return "is a relative path; use a program name or an absolute path"
	}
	if p == "." || p == ".." {
		return "is not a program name"
	}
	if shellBuiltins[p] {
		return "is a shell keyword or builtin, which can run or evaluate arbitrary code in a shell " +
			"command; name the program by its absolute path instead (e.g. /usr/bin/" + p + ")"
	}
	return ""
}

// shellBuiltins are the reserved words and builtins of bash, dash and busybox ash that a command
// allowlist may not name: in a shell-string command the shell runs them itself, not a program, and
// many run or evaluate code (eval, exec, trap, command, source; and in bash, arithmetic in an array
// subscript, as in `printf -v 'a[$(id)]'` or `test -v`, runs command substitutions). A name with a
// slash is never a builtin, so an absolute path (/usr/bin/printf) is the way to allow the program.
// echo, true, false and pwd stay allowed: they evaluate nothing.
var shellBuiltins = map[string]bool{
	// reserved words
	"case": true, "coproc": true, "do": true, "done": true, "elif": true, "else": true, "esac": true,
	"fi": true, "for": true, "function": true, "if": true, "in": true, "select": true, "then": true,
	"time": true, "until": true, "while": true,
	// builtins
	"alias": true, "bg": true, "bind": true, "break": true, "builtin": true, "caller": true, "cd": true,
	"chdir": true, "command": true, "compgen": true, "complete": true, "compopt": true, "continue": true,
	"declare": true, "dirs": true, "disown": true, "enable": true, "eval": true, "exec": true,
	"exit": true, "export": true, "fc": true, "fg": true, "getopts": true, "hash": true, "help": true,
	"history": true, "jobs": true, "kill": true, "let": true, "local": true, "logout": true,
	"mapfile": true, "popd": true, "printf": true, "pushd": true, "read": true, "readarray": true,
	"readonly": true, "return": true, "set": true, "shift": true, "shopt": true, "source": true,
	"suspend": true, "test": true, "times": true, "trap": true, "type": true, "typeset": true,
	"ulimit": true, "umask": true, "unalias": true, "unset": true, "wait": true,
}

// quoteShort quotes caller input for an error message, cut to a readable length.
func quoteShort(s string) string {
	const max = 64
	if len(s) > max {
		return strconv.Quote(s[:max]) + "..."
	}
	return strconv.Quote(s)
}
