package delegation

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"time"

	"github.com/sbxbroker/broker/protocol"
	"github.com/sbxbroker/broker/store"
)

// Service is delegation on top of the store: minting with recorded metadata, listing, revocation (a
// jti deny-list and the sandbox's token generation, both in Redis, announced to every broker), and
// introspection. It implements State for the Verifier.
type Service struct {
	issuer   *Issuer
	verifier *Verifier
	store    *store.Store
	events   func(org string, e protocol.Event)
	log      *slog.Logger
	now      func() time.Time
	// dataplaneURL builds the dataplane URL of a sandbox from the node that hosts it.
	dataplaneURL func(ctx context.Context, rec store.Record) (string, error)
	// recent remembers verified tokens (recent.go): VerifyRecent, CheckRecent.
	recent *recent
}

// ServiceConfig wires a Service.
type ServiceConfig struct {
	Keys  *Keyring
	Token Config
	Store *store.Store
	// Events receives the service's events (the broker's events.Writer.Emit); nil drops them.
	Events       func(org string, e protocol.Event)
	Log          *slog.Logger
	DataplaneURL func(ctx context.Context, rec store.Record) (string, error)
}

// NewService builds the service and its verifier (which consults the service for revocations).
func NewService(cfg ServiceConfig) (*Service, error) {
	s := &Service{store: cfg.Store, events: cfg.Events, log: cfg.Log, dataplaneURL: cfg.DataplaneURL}
	var err error
	if s.issuer, err = NewIssuer(cfg.Keys, cfg.Token); err != nil {
		return nil, err
	}
	if s.verifier, err = NewVerifier(cfg.Keys, cfg.Token, s); err != nil {
		return nil, err
	}
	s.now = s.issuer.cfg.Now
	s.recent = newRecent(s.now)
	if s.events == nil {
		s.events = func(string, protocol.Event) {}
	}
	return s, nil
}

// Verifier is the one verifier of delegation tokens, with revocation checks.
func (s *Service) Verifier() *Verifier { return s.verifier }

// metadata is what the broker keeps of a minted token (never the token).
type metadata struct {
	Scopes   []string `json:"scopes"`
	AllowCmd []string `json:"allow_cmd,omitempty"`
	Iat      int64    `json:"iat"`
	Exp      int64    `json:"exp"`
	Sub      string   `json:"sub"`
	Gen      int64    `json:"gen"`
}

// Mint mints a token for one sandbox and returns it with its run-config block. actor is the owner
// principal ("key:<id>").
func (s *Service) Mint(ctx context.Context, rec store.Record, actor string, req protocol.MintRequest) (protocol.MintResponse, error) {
	switch rec.Status {
	case protocol.StatusDeleting:
		return protocol.MintResponse{}, protocol.Errorf(protocol.CodeNotFound, "sandbox %q not found", rec.Name)
	case protocol.StatusFailed:
		return protocol.MintResponse{}, protocol.Errorf(protocol.CodeSandboxFailed, "sandbox %s failed; delete it and create another", rec.Name)
	}
	var ttl time.Duration
	if req.TTLSeconds != nil {
		if *req.TTLSeconds <= 0 || *req.TTLSeconds > int64(s.issuer.cfg.MaxTTL/time.Second) {
			return protocol.MintResponse{}, protocol.Errorf(protocol.CodeInvalidTTL,
				"the token lifetime is out of range: ttl_seconds must be 1 to %d (%v, the broker's --token-max-ttl)",
				int64(s.issuer.cfg.MaxTTL/time.Second), s.issuer.cfg.MaxTTL)
		}
		ttl = time.Duration(*req.TTLSeconds) * time.Second
	}
	if err := s.roomForToken(ctx, rec); err != nil {
		return protocol.MintResponse{}, err
	}
	url, err := s.dataplaneURL(ctx, rec)
	if err != nil {
		return protocol.MintResponse{}, err
	}
	token, c, err := s.issuer.Mint(Grant{Org: rec.Org, SandboxID: rec.ID, Gen: rec.Gen, Subject: actor,
		Scopes: req.Scopes, AllowCmd: req.AllowCmd, TTL: ttl})
	if err != nil {
		return protocol.MintResponse{}, err
	}
	meta, _ := json.Marshal(metadata{Scopes: c.Scopes(), AllowCmd: c.Cmd, Iat: c.IssuedAt.Unix(), Exp: c.ExpiresAt.Unix(), Sub: actor, Gen: c.Gen})
	size, err := s.store.RecordToken(ctx, rec.Org, rec.ID, c.ID, meta, MaxLiveTokens)
	if errors.Is(err, store.ErrTokensFull) {
		// Another mint took the last room since roomForToken looked: at the bound it forgets the
		// tokens that ended, which may make room; a record full of live ones refuses this mint.
		if err = s.roomForToken(ctx, rec); err == nil {
			size, err = s.store.RecordToken(ctx, rec.Org, rec.ID, c.ID, meta, MaxLiveTokens)
		}
		if errors.Is(err, store.ErrTokensFull) {
			err = tokensFull(rec, MaxLiveTokens)
		}
	}
	if perr := (*protocol.Error)(nil); errors.As(err, &perr) {
		return protocol.MintResponse{}, perr
	}
	if err != nil {
		return protocol.MintResponse{}, fmt.Errorf("delegation: record token: %w", err)
	}
	// A sandbox minted for on every run, and never listed, would keep every expired entry.
	if size > pruneAbove {
		if all, err := s.store.Tokens(ctx, rec.Org, rec.ID); err == nil {
			s.pruneExpired(ctx, rec, all)
		}
	}
	s.events(rec.Org, protocol.Event{Type: protocol.EventTokenMinted, SandboxID: rec.ID, Name: rec.Name,
		Time: s.now().UTC(), Actor: actor, JTI: c.ID})
	return protocol.MintResponse{
		Token: token, JTI: c.ID, ExpiresAt: c.ExpiresAt.Time.UTC(),
		Sandbox: protocol.SandboxBlock{SandboxID: rec.ID, Credential: token, DataplaneURL: url, MCPURL: protocol.MCPURLOf(url)},
	}, nil
}

// List returns the metadata of a sandbox's unexpired tokens, newest first, pruning expired ones.
func (s *Service) List(ctx context.Context, rec store.Record) ([]protocol.Delegation, error) {
	live, revoked, err := s.unexpired(ctx, rec)
	if err != nil {
		return nil, fmt.Errorf("delegation: list: %w", err)
	}
	out := []protocol.Delegation{}
	for jti, m := range live {
		out = append(out, protocol.Delegation{
			JTI: jti, SandboxID: rec.ID, Scopes: m.Scopes, AllowCmd: m.AllowCmd, IssuedBy: m.Sub,
			IssuedAt: time.Unix(m.Iat, 0).UTC(), ExpiresAt: time.Unix(m.Exp, 0).UTC(),
			Revoked: revoked(jti, m),
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].IssuedAt.After(out[j].IssuedAt) })
	return out, nil
}

// unexpired reads a sandbox's tokens, prunes the expired ones, and answers the others with whether
// each is revoked: by its jti, with the whole sandbox (an older generation), or with the key that
// minted it.
func (s *Service) unexpired(ctx context.Context, rec store.Record) (map[string]metadata, func(jti string, m metadata) bool, error) {
	all, err := s.store.Tokens(ctx, rec.Org, rec.ID)
	if err != nil {
		return nil, nil, err
	}
	live := s.pruneExpired(ctx, rec, all)
	jtis := make([]string, 0, len(live))
	var keyIDs []string // the minting keys, each once
	seen := map[string]bool{}
	for jti, m := range live {
		jtis = append(jtis, jti)
		if id, ok := strings.CutPrefix(m.Sub, KeySubjectPrefix); ok && !seen[id] {
			seen[id] = true
			keyIDs = append(keyIDs, id)
		}
	}
	denied, liveKeys, err := s.store.TokensRevoked(ctx, rec.Org, jtis, keyIDs)
	if err != nil {
		return nil, nil, err
	}
	return live, func(jti string, m metadata) bool {
		id, isKey := strings.CutPrefix(m.Sub, KeySubjectPrefix)
		return denied[jti] || m.Gen < rec.Gen || !isKey || !liveKeys[id]
	}, nil
}

// pruneAbove is the size of a sandbox's token record beyond which Mint removes expired entries.
const pruneAbove = 100

// MaxLiveTokens bounds the unexpired tokens a sandbox holds that its revoke-all has not ended:
// each keeps its metadata in the shared Redis until it expires, so without a bound one key minting
// in a loop would grow Redis for every org (and each mint past pruneAbove reads them all).
const MaxLiveTokens = 1000

// roomForToken refuses a mint for a sandbox that holds MaxLiveTokens live tokens. Only at the bound
// does it read them: it forgets the expired ones and the revoked ones (by jti, with the whole
// sandbox, or with the key that minted them), which no longer count.
func (s *Service) roomForToken(ctx context.Context, rec store.Record) error {
	n, err := s.store.TokenCount(ctx, rec.Org, rec.ID)
	if err != nil {
		return fmt.Errorf("delegation: mint: %w", err)
	}
	if n < MaxLiveTokens {
		return nil
	}
	live, revoked, err := s.unexpired(ctx, rec)
	if err != nil {
		return fmt.Errorf("delegation: mint: %w", err)
	}
	var ended []string
	for jti, m := range live {
		if revoked(jti, m) {
			ended = append(ended, jti)
		}
	}
	s.store.ForgetTokens(ctx, rec.Org, rec.ID, ended...)
	if left := len(live) - len(ended); left >= MaxLiveTokens {
		return tokensFull(rec, left)
	}
	return nil
}

// tokensFull is the refusal of a mint for a sandbox that holds live tokens at the bound.
func tokensFull(rec store.Record, live int) error {
	return protocol.Errorf(protocol.CodeQuotaExceeded,
		"sandbox %s holds %d live delegation tokens, the most one may: revoke those no longer in use (sbctl revoke %s --all, or --jti J) or let them expire", rec.Name, live, rec.Name)
}

// pruneExpired removes the entries of expired (or unreadable) tokens from a sandbox's token record
// all, and returns the others.
func (s *Service) pruneExpired(ctx context.Context, rec store.Record, all map[string]string) map[string]metadata {
	now := s.now()
	live := make(map[string]metadata, len(all))
	var gone []string
	for jti, raw := range all {
		var m metadata
		if json.Unmarshal([]byte(raw), &m) != nil || time.Unix(m.Exp, 0).Before(now) {
			gone = append(gone, jti)
			continue
		}
		live[jti] = m
	}
	s.store.ForgetTokens(ctx, rec.Org, rec.ID, gone...)
	return live
}

// Revoke denies one token by jti until it would have expired anyway, and tells every broker. It
// answers the revocation made (none for a token expired already), for the caller to apply to this
// broker's own connections at once: the announcement may not reach any broker, this one included.
func (s *Service) Revoke(ctx context.Context, rec store.Record, actor, jti string) (Revocation, error) {
	raw, err := s.store.Token(ctx, rec.Org, rec.ID, jti)
	if errors.Is(err, store.ErrNotFound) {
		return Revocation{}, protocol.Errorf(protocol.CodeNotFound, "sandbox %s has no unexpired token %q (see sbctl delegations)", rec.Name, clipJTI(jti))
	}
	if err != nil {
		return Revocation{}, fmt.Errorf("delegation: revoke: %w", err)
	}
	// Deny it until it would have expired; if its record is unreadable, for as long as any token lives.
	ttl := s.issuer.cfg.MaxTTL + s.issuer.cfg.Leeway
	var m metadata
	if json.Unmarshal([]byte(raw), &m) == nil {
		ttl = time.Unix(m.Exp, 0).Sub(s.now()) + s.issuer.cfg.Leeway
	}
	if ttl <= 0 {
		return Revocation{}, nil // already expired: nothing to deny
	}
	if err := s.store.DenyToken(ctx, rec.Org, jti, ttl); err != nil {
		return Revocation{}, fmt.Errorf("delegation: revoke: %w", err)
	}
	r := Revocation{Org: rec.Org, SandboxID: rec.ID, JTI: jti}
	s.announce(ctx, r)
	s.events(rec.Org, protocol.Event{Type: protocol.EventTokenRevoked, SandboxID: rec.ID, Name: rec.Name,
		Time: s.now().UTC(), Actor: actor, JTI: jti})
	return r, nil
}

// RevokeAll revokes every token of a sandbox by bumping its generation. It answers the revocation
// made, as Revoke does.
func (s *Service) RevokeAll(ctx context.Context, rec store.Record, actor string) (Revocation, error) {
	gen, err := s.store.BumpGen(ctx, rec.Org, rec.ID)
	if errors.Is(err, store.ErrNotFound) {
		return Revocation{}, protocol.Errorf(protocol.CodeNotFound, "sandbox %q not found", rec.Name)
	}
	if err != nil {
		return Revocation{}, err
	}
	r := Revocation{Org: rec.Org, SandboxID: rec.ID, Gen: gen}
	s.announce(ctx, r)
	s.events(rec.Org, protocol.Event{Type: protocol.EventTokenRevoked, SandboxID: rec.ID, Name: rec.Name,
		Time: s.now().UTC(), Actor: actor, Reason: "all tokens of the sandbox"})
	return r, nil
}

// Revocation is announced on store.RevocationsChannel so every broker closes affected connections:
// one token (JTI), or every token of a sandbox older than Gen.
type Revocation struct {
	Org       string `json:"org"`
	SandboxID string `json:"sandbox_id"`
	JTI       string `json:"jti,omitempty"`
	Gen       int64  `json:"gen,omitempty"`
}

func (s *Service) announce(ctx context.Context, r Revocation) {
	// This broker forgets the token first, so that its next upgrade refuses it whatever becomes of
	// the announcement.
	s.Forget(r)
	msg, _ := json.Marshal(r)
	if err := s.store.Publish(ctx, store.RevocationsChannel, string(msg)); err != nil {
		s.log.Warn("could not announce a revocation; this broker ended its connections of it, other brokers' learn it at their periodic re-check", "sandbox_id", r.SandboxID, "err", err)
	}
}

// CheckRevocation implements State: one round trip reads the deny-list entry, the sandbox's current
// generation and status, and the state of the API key that minted the token.
//
// Why the minting key is read here rather than recorded per token: the token already names its key
// (sub = "key:<id>"), and the key's record is the one place its revocation is written
// (store.RevokeAPIKey, also by `broker keys revoke`). Reading it in the pipeline this check already
// sends costs no extra round trip, with nothing to fan out to each token at revocation time (a key
// may have minted thousands). This read is exact; the dataplane's upgrade reads it through
// VerifyRecent (at most once per RecentTTL per token, evicted by the key revocation announcement:
// ForgetKey), while the periodic re-check of open connections and introspection read it every time.
// Open connections learn it from the key revocation announcement (hub.keyRevoked).
func (s *Service) CheckRevocation(ctx context.Context, c *Claims) error {
	st, err := s.store.TokenState(ctx, c.Org, c.Sbx, c.ID, c.KeyID())
	if err != nil {
		return err
	}
	if st.Denied {
		return protocol.Errorf(protocol.CodeTokenRevoked, "the token was revoked")
	}
	if st.SandboxGone || st.Status == protocol.StatusDeleting {
		return SandboxDeleted()
	}
	if c.Gen < st.Gen {
		return protocol.Errorf(protocol.CodeTokenRevoked, "every token of the sandbox was revoked")
	}
	// A key that is gone, of another org, or revoked (a non-zero revocation time) ends the token.
	if !st.KeyLive {
		return protocol.Errorf(protocol.CodeTokenRevoked, "the API key that minted the token was revoked")
	}
	return nil
}

// SandboxDeleted is the refusal of a token whose sandbox is deleted or being deleted, wherever that
// is found out (this read, or the dataplane's read of the sandbox's record).
func SandboxDeleted() *protocol.Error {
	return protocol.Errorf(protocol.CodeTokenRevoked, "the token's sandbox was deleted")
}

// Introspect says whether a token is usable now, for an agent server of org checking a block it was
// handed. A token of another org is simply inactive, with no reason: nothing about it, its sandbox
// or its revocation leaks.
func (s *Service) Introspect(ctx context.Context, org, token string) (protocol.IntrospectResponse, error) {
	c, err := s.verifier.VerifyBound(ctx, token, org, "")
	if err != nil {
		var pe *protocol.Error
		if errors.As(err, &pe) && pe.Code == protocol.CodeTokenSandbox {
			return protocol.IntrospectResponse{Active: false}, nil
		}
		if errors.As(err, &pe) {
			return protocol.IntrospectResponse{Active: false, Reason: pe.Code}, nil
		}
		return protocol.IntrospectResponse{}, err
	}
	return protocol.IntrospectResponse{Active: true, SandboxID: c.Sbx, Org: c.Org, Scopes: c.Scopes(),
		AllowCmd: c.Cmd, JTI: c.ID, Exp: c.ExpiresAt.Unix()}, nil
}

// Subscribe calls fn for every revocation announced by any broker until ctx ends. It returns once
// Redis has confirmed the subscription, so no announcement made after it returns is missed.
// Announcements are best effort (Redis pub/sub): while disconnected a subscriber misses some, so
// gap (when not nil) is called, in order with fn, each time the subscription is made again after a
// drop, for the subscriber to catch up from Redis' state; holders of long-lived connections also
// re-verify them periodically.
func Subscribe(ctx context.Context, st *store.Store, fn func(Revocation), gap func()) error {
	return st.FollowWithGaps(ctx, store.RevocationsChannel, func(payload string) {
		var r Revocation
		if json.Unmarshal([]byte(payload), &r) == nil {
			fn(r)
		}
	}, gap)
}

// FollowKeyRevocations calls fn with the id of every API key revoked by any broker (or by
// `broker keys revoke`) until ctx ends; like Subscribe, it returns once subscribed, and calls gap
// after each resubscription.
func FollowKeyRevocations(ctx context.Context, st *store.Store, fn func(keyID string), gap func()) error {
	return st.FollowWithGaps(ctx, store.APIKeyRevokedChannel, fn, gap)
}

func clipJTI(s string) string {
	if len(s) > 64 {
		s = s[:64]
	}
	return strings.ToValidUTF8(s, "?")
}
