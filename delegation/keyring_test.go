package delegation

import (
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sbxbroker/broker/protocol"
)

type jwkSet struct {
	Keys []map[string]string `json:"keys"`
}

func jwksOf(t *testing.T, k *Keyring) jwkSet {
	t.Helper()
	b, err := k.JWKS()
	if err != nil {
		t.Fatal(err)
	}
	var s jwkSet
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	return s
}

func jwksKids(s jwkSet) []string {
	var kids []string
	for _, k := range s.Keys {
		kids = append(kids, k["kid"])
	}
	return kids
}

func TestKeyringCreateFilesAndReload(t *testing.T) {
	t.Parallel()
	clk := newClock()
	dir := filepath.Join(t.TempDir(), "keys")
	k, err := LoadOrCreateKeyring(dir, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	kid, priv := k.Signer()
	if kid != kidOf(priv.Public().(ed25519.PublicKey)) || !validKid(kid) {
		t.Fatalf("kid %q is not derived from the public key", kid)
	}

	fi, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if perm := fi.Mode().Perm(); perm != 0o700 {
		t.Errorf("directory mode %04o, want 0700", perm)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
		if e.Name() == lockFile {
			continue
		}
		info, err := e.Info()
		if err != nil {
			t.Fatal(err)
		}
		if perm := info.Mode().Perm(); perm != 0o600 {
			t.Errorf("%s has mode %04o, want 0600", e.Name(), perm)
		}
	}
	want := map[string]bool{keyringFile: true, kid + ".pem": true, lockFile: true}
	if len(names) != len(want) {
		t.Fatalf("files %v, want %v", names, want)
	}
	for _, n := range names {
		if !want[n] {
			t.Fatalf("unexpected file %s (all: %v)", n, names)
		}
	}
	pemData, err := os.ReadFile(filepath.Join(dir, kid+".pem"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(pemData), "-----BEGIN PRIVATE KEY-----") {
		t.Error("key file is not a PKCS#8 PEM")
	}

	// Loading again gives the same key.
	k2, err := LoadOrCreateKeyring(dir, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	if kid2, priv2 := k2.Signer(); kid2 != kid || !priv2.Equal(priv) {
		t.Fatalf("reloaded kid %s, want %s", kid2, kid)
	}

	// JWKS: one OKP key.
	s := jwksOf(t, k)
	if len(s.Keys) != 1 {
		t.Fatalf("JWKS has %d keys", len(s.Keys))
	}
	j := s.Keys[0]
	x, err := base64.RawURLEncoding.DecodeString(j["x"])
	if err != nil || !ed25519.PublicKey(x).Equal(priv.Public()) {
		t.Fatalf("JWKS x does not hold the public key")
	}
	for name, want := range map[string]string{"kty": "OKP", "crv": "Ed25519", "kid": kid, "alg": "EdDSA", "use": "sig"} {
		if j[name] != want {
			t.Errorf("JWKS %s = %q, want %q", name, j[name], want)
		}
	}
	if _, ok := j["d"]; ok {
		t.Fatal("JWKS contains a private key")
	}
}

func TestKeyringRefusesInsecureFiles(t *testing.T) {
	t.Parallel()
	clk := newClock()
	dir := filepath.Join(t.TempDir(), "keys")
	k, err := LoadOrCreateKeyring(dir, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	kid, _ := k.Signer()
	for _, name := range []string{kid + ".pem", keyringFile} {
		path := filepath.Join(dir, name)
		if err := os.Chmod(path, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := LoadOrCreateKeyring(dir, clk.Now)
		if !errors.Is(err, ErrInsecureKeyFile) {
			t.Fatalf("%s at 0644: got %v, want ErrInsecureKeyFile", name, err)
		}
		if msg := err.Error(); !strings.Contains(msg, path) || !strings.Contains(msg, "chmod 600 "+path) {
			t.Fatalf("message %q does not name the file and the fix", msg)
		}
		// Rotate re-reads the directory first, so it refuses too, and keeps the keys in use.
		if _, err := k.Rotate(time.Hour); err == nil {
			t.Fatalf("Rotate with %s at 0644 succeeded", name)
		}
		if got, _ := k.Signer(); got != kid {
			t.Fatal("a failed rotation changed the active key")
		}
		if err := os.Chmod(path, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	// The directory must not be writable by others.
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreateKeyring(dir, clk.Now); !errors.Is(err, ErrInsecureKeyFile) || !strings.Contains(err.Error(), "chmod 700") {
		t.Fatalf("directory at 0777: got %v", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		t.Fatal(err)
	}

	// A symlinked key file is refused.
	pemPath := filepath.Join(dir, kid+".pem")
	if err := os.Rename(pemPath, pemPath+".real"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(pemPath+".real", pemPath); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreateKeyring(dir, clk.Now); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("symlinked key: got %v", err)
	}
}

func TestKeyringRefusesForeignKey(t *testing.T) {
	t.Parallel()
	clk := newClock()
	dirA := filepath.Join(t.TempDir(), "a")
	dirB := filepath.Join(t.TempDir(), "b")
	a, err := LoadOrCreateKeyring(dirA, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	b, err := LoadOrCreateKeyring(dirB, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	kidA, _ := a.Signer()
	kidB, _ := b.Signer()
	// Put B's key under A's name: the kid no longer matches the key.
	data, err := os.ReadFile(filepath.Join(dirB, kidB+".pem"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dirA, kidA+".pem"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreateKeyring(dirA, clk.Now); err == nil || !strings.Contains(err.Error(), "holds key") {
		t.Fatalf("swapped key: got %v", err)
	}
}

func TestRotation(t *testing.T) {
	t.Parallel()
	clk := newClock()
	dir := filepath.Join(t.TempDir(), "keys")
	k, err := LoadOrCreateKeyring(dir, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	st := newMapState()
	st.gens["sb_1"] = 1
	is, v := newIssuerVerifier(t, k, clk, st)
	grant := Grant{Org: "org_1", SandboxID: "sb_1", Gen: 1, Subject: "key:k1", Scopes: []string{"fs:read"}, TTL: DefaultMaxTTL}

	oldKid, _ := k.Signer()
	oldTok, _, err := is.Mint(grant)
	if err != nil {
		t.Fatal(err)
	}
	window := DefaultMaxTTL + time.Hour
	newKid, err := k.Rotate(window)
	if err != nil {
		t.Fatal(err)
	}
	if newKid == oldKid {
		t.Fatal("rotation kept the kid")
	}
	if kid, _ := k.Signer(); kid != newKid {
		t.Fatalf("signer kid %s, want the new %s", kid, newKid)
	}
	newTok, _, err := is.Mint(grant)
	if err != nil {
		t.Fatal(err)
	}
	if got := headerOf(t, newTok)["kid"]; got != newKid {
		t.Fatalf("new token kid %v, want %s", got, newKid)
	}
	if kids := jwksKids(jwksOf(t, k)); len(kids) != 2 || kids[0] != newKid || kids[1] != oldKid {
		t.Fatalf("JWKS kids %v, want [%s %s]", kids, newKid, oldKid)
	}
	for _, tok := range []string{oldTok, newTok} {
		if _, err := v.Verify(t.Context(), tok); err != nil {
			t.Fatalf("right after rotation: %v", err)
		}
	}

	// Just before the window ends, the old token (24 h lifetime) still verifies.
	clk.Advance(DefaultMaxTTL - time.Minute)
	if err := k.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(t.Context(), oldTok); err != nil {
		t.Fatalf("old token within the window: %v", err)
	}

	// Past the window the old key is gone: from verification, from JWKS, and from disk.
	clk.Advance(window)
	if _, err := v.Verify(t.Context(), oldTok); code(t, err) != protocol.CodeTokenUnknownKey {
		t.Fatalf("old token past the window: %v", err)
	}
	if kids := jwksKids(jwksOf(t, k)); len(kids) != 1 || kids[0] != newKid {
		t.Fatalf("JWKS kids %v, want [%s]", kids, newKid)
	}
	if err := k.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, oldKid+".pem")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("retired key file still on disk: %v", err)
	}
	raw, err := os.ReadFile(filepath.Join(dir, keyringFile))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(raw), oldKid) {
		t.Fatalf("keyring.json still names the retired key: %s", raw)
	}
	// A fresh load agrees.
	k2, err := LoadOrCreateKeyring(dir, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	if kids := jwksKids(jwksOf(t, k2)); len(kids) != 1 || kids[0] != newKid {
		t.Fatalf("reloaded JWKS kids %v", kids)
	}
	if _, err := k.Rotate(0); err == nil {
		t.Fatal("Rotate(0) accepted")
	}
}

// TestReloadSeesOtherInstance: a rotation made by one Keyring (the `broker keys rotate-signing`
// command) reaches another over the same directory (a running broker) through Reload.
func TestReloadSeesOtherInstance(t *testing.T) {
	t.Parallel()
	clk := newClock()
	dir := filepath.Join(t.TempDir(), "keys")
	cli, err := LoadOrCreateKeyring(dir, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	broker, err := LoadOrCreateKeyring(dir, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	oldKid, _ := broker.Signer()

	// Nothing changed: Reload keeps the very same snapshot.
	before := broker.state.Load()
	if err := broker.Reload(); err != nil {
		t.Fatal(err)
	}
	if broker.state.Load() != before {
		t.Fatal("Reload re-read an unchanged keyring")
	}

	newKid, err := cli.Rotate(time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if kid, _ := broker.Signer(); kid != oldKid {
		t.Fatal("the broker changed keys before reloading")
	}
	if err := broker.Reload(); err != nil {
		t.Fatal(err)
	}
	if kid, _ := broker.Signer(); kid != newKid {
		t.Fatalf("after Reload the broker signs with %s, want %s", kid, newKid)
	}
	if _, ok := broker.PublicKey(oldKid, clk.Now()); !ok {
		t.Fatal("the retiring key does not verify after Reload")
	}
	if _, ok := broker.PublicKey(oldKid, clk.Now().Add(time.Hour)); ok {
		t.Fatal("the retiring key verifies at its retire time")
	}
}

// TestVerifyReloadsOnUnknownKid: a token signed with a key rotated in by another process verifies
// without waiting for the periodic Reload.
func TestVerifyReloadsOnUnknownKid(t *testing.T) {
	t.Parallel()
	clk := newClock()
	dir := filepath.Join(t.TempDir(), "keys")
	a, err := LoadOrCreateKeyring(dir, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	b, err := LoadOrCreateKeyring(dir, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Rotate(time.Hour); err != nil {
		t.Fatal(err)
	}
	isA, _ := newIssuerVerifier(t, a, clk, nil)
	_, vB := newIssuerVerifier(t, b, clk, nil)
	tok, _, err := isA.Mint(Grant{Org: "o", SandboxID: "s", Gen: 1, Subject: "key:k", Scopes: []string{"exec"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vB.Verify(t.Context(), tok); err != nil {
		t.Fatalf("token with a key rotated in elsewhere: %v", err)
	}
}

// TestConcurrentRotations: two processes' keyrings rotating the same directory at once lose no key.
func TestConcurrentRotations(t *testing.T) {
	t.Parallel()
	clk := newClock()
	dir := filepath.Join(t.TempDir(), "keys")
	var rings []*Keyring
	for range 2 {
		k, err := LoadOrCreateKeyring(dir, clk.Now)
		if err != nil {
			t.Fatal(err)
		}
		rings = append(rings, k)
	}
	first, _ := rings[0].Signer()
	const perRing = 5
	var wg sync.WaitGroup
	made := make(chan string, 2*perRing)
	for _, k := range rings {
		wg.Go(func() {
			for range perRing {
				kid, err := k.Rotate(time.Hour)
				if err != nil {
					t.Error(err)
					return
				}
				made <- kid
			}
		})
	}
	wg.Wait()
	close(made)

	k, err := LoadOrCreateKeyring(dir, clk.Now)
	if err != nil {
		t.Fatal(err)
	}
	now := clk.Now()
	for kid := range made {
		if _, ok := k.PublicKey(kid, now); !ok {
			t.Errorf("key %s made by a rotation was lost", kid)
		}
	}
	if _, ok := k.PublicKey(first, now); !ok {
		t.Error("the first key was lost")
	}
	if n := len(jwksOf(t, k).Keys); n != 2*perRing+1 {
		t.Errorf("JWKS has %d keys, want %d", n, 2*perRing+1)
	}
}

// TestKeyringConcurrentUse exercises readers against Reload and Rotate under -race.
func TestKeyringConcurrentUse(t *testing.T) {
	t.Parallel()
	clk := newClock()
	k := newKeyring(t, clk)
	is, v := newIssuerVerifier(t, k, clk, nil)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 50 {
				tok, _, err := is.Mint(Grant{Org: "o", SandboxID: "s", Gen: 1, Subject: "key:k", Scopes: []string{"exec"}})
				if err != nil {
					t.Error(err)
					return
				}
				if _, err := v.Verify(t.Context(), tok); err != nil {
					t.Error(err)
					return
				}
				if _, err := k.JWKS(); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Go(func() {
		for range 5 {
			if _, err := k.Rotate(time.Hour); err != nil {
				t.Error(err)
			}
			if err := k.Reload(); err != nil {
				t.Error(err)
			}
		}
	})
	wg.Wait()
}
