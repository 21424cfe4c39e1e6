package delegation

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// On-disk layout of a keyring directory (0700):
//
//	keyring.json   {"active": KID, "retiring": [{"kid": KID, "retire_at": RFC 3339}]}   0600
//	KID.pem        PKCS#8 PEM Ed25519 private key, one per active or retiring key          0600
//	keyring.lock   empty; flock(2) on it serializes writers across processes
//
// keyring.json is the commit point: a new key's PEM is written (atomically) before the keyring.json
// that names it, and a pruned key's PEM is removed only after a keyring.json without it is in place,
// so a reader never sees a keyring.json naming a key it cannot find (short of a concurrent prune of a
// key that was expiring anyway, which read skips and retries).
const (
	keyringFile = "keyring.json"
	lockFile    = "keyring.lock"
	keyFileExt  = ".pem"
	pemType     = "PRIVATE KEY"
	// kidBytes of SHA-256(public key), base64url: 16 characters, 96 bits, collision-free for any
	// number of keys a broker will ever have.
	kidBytes = 12
	kidLen   = 16
	// maxKeyFileSize bounds what load reads from any file in the directory.
	maxKeyFileSize = 64 << 10
	// missReloadInterval rate-limits the Reload that an unknown kid triggers during verification.
	missReloadInterval = time.Second
)

// ErrInsecureKeyFile is wrapped by the errors LoadOrCreateKeyring and Reload return when a file of the
// keyring is readable by group or others, or its directory writable by them.
var ErrInsecureKeyFile = errors.New("delegation: insecure permissions on keyring")

// Keyring holds the broker's Ed25519 signing keys: one active key that signs, and retiring keys that
// still verify until their retire time (so tokens signed before a rotation stay valid until they
// expire). It is backed by a directory and safe for concurrent use; verification reads a snapshot
// without locking.
type Keyring struct {
	dir string
	now func() time.Time

	mu             sync.Mutex // serializes Reload and Rotate within this process
	state          atomic.Pointer[keyState]
	lastMissReload atomic.Int64 // unix nanoseconds of the last reloadOnMiss
}

type signingKey struct {
	kid      string
	priv     ed25519.PrivateKey
	pub      ed25519.PublicKey
	retireAt time.Time // zero for the active key
}

// keyState is an immutable snapshot of the keyring.
type keyState struct {
	active   *signingKey
	retiring []*signingKey // still within their window when read
	byKid    map[string]*signingKey
	// file is keyring.json as read, so Reload can tell cheaply whether anything changed.
	file os.FileInfo
	// nextRetire is the earliest retire time among retiring, zero if none: when it passes, Reload
	// does the full read again so the expired key is pruned from disk.
	nextRetire time.Time
	// expired lists retiring kids past their window that are still named on disk (to prune).
	expired []string
}

type keyringJSON struct {
	Active   string         `json:"active"`
	Retiring []retiringJSON `json:"retiring"`
}

type retiringJSON struct {
	Kid      string    `json:"kid"`
	RetireAt time.Time `json:"retire_at"`
}

// LoadOrCreateKeyring opens the keyring in dir, creating dir (0700) and a first active key when it
// holds none. now is the clock for retire times (nil means time.Now). Files with group or other
// permissions are refused (the error wraps ErrInsecureKeyFile and says which chmod fixes it).
func LoadOrCreateKeyring(dir string, now func() time.Time) (*Keyring, error) {
	if dir == "" {
		return nil, errors.New("delegation: keyring directory is empty")
	}
	if now == nil {
		now = time.Now
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("delegation: create keyring directory: %w", err)
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return nil, fmt.Errorf("delegation: keyring directory: %w", err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("delegation: keyring path %s is not a directory", dir)
	}
	if perm := fi.Mode().Perm(); perm&0o022 != 0 {
		return nil, fmt.Errorf("%w: directory %s has mode %04o, writable by group or others, who could "+
			"replace the signing key: run chmod 700 %s", ErrInsecureKeyFile, dir, perm, dir)
	}

	k := &Keyring{dir: dir, now: now}
	k.mu.Lock()
	defer k.mu.Unlock()
	st, err := k.read()
	if errors.Is(err, errNoKeyring) {
		st, err = k.create()
	}
	if err != nil {
		return nil, err
	}
	if len(st.expired) > 0 {
		if pruned, perr := k.prune(); perr == nil {
			st = pruned
		}
		// A failed prune (read-only directory) leaves expired keys on disk; they never verify.
	}
	k.state.Store(st)
	return k, nil
}

// Signer returns the active key, the only one that signs.
func (k *Keyring) Signer() (kid string, key ed25519.PrivateKey) {
	st := k.state.Load()
	return st.active.kid, st.active.priv
}

// PublicKey returns the verification key named kid: the active key, or a retiring key whose retire
// time is after now.
func (k *Keyring) PublicKey(kid string, now time.Time) (ed25519.PublicKey, bool) {
	sk, ok := k.state.Load().byKid[kid]
	if !ok || (!sk.retireAt.IsZero() && !now.Before(sk.retireAt)) {
		return nil, false
	}
	return sk.pub, true
}

// jwk is one RFC 8037 OKP public key.
type jwk struct {
	Kty string `json:"kty"`
	Crv string `json:"crv"`
	X   string `json:"x"`
	Kid string `json:"kid"`
	Alg string `json:"alg"`
	Use string `json:"use"`
}

// JWKS returns the public JWK set (RFC 7517, OKP keys per RFC 8037) of the keys that verify now:
// the active key first, then the retiring ones.
func (k *Keyring) JWKS() ([]byte, error) {
	st := k.state.Load()
	now := k.now()
	set := struct {
		Keys []jwk `json:"keys"`
	}{Keys: []jwk{toJWK(st.active)}}
	for _, sk := range st.retiring {
		if now.Before(sk.retireAt) {
			set.Keys = append(set.Keys, toJWK(sk))
		}
	}
	return json.Marshal(set)
}

func toJWK(sk *signingKey) jwk {
	return jwk{Kty: "OKP", Crv: "Ed25519", X: base64.RawURLEncoding.EncodeToString(sk.pub), Kid: sk.kid,
		Alg: "EdDSA", Use: "sig"}
}

// Rotate makes a new key active. The previous active key keeps verifying until now+window, then is
// pruned: pass at least the maximum token lifetime plus the verifiers' leeway and some slack, or
// tokens signed just before the rotation fail before they expire. Other processes on the same
// directory see the rotation at their next Reload.
func (k *Keyring) Rotate(window time.Duration) (newKid string, err error) {
	if window <= 0 {
		return "", fmt.Errorf("delegation: rotation window must be positive, got %v", window)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	unlock, err := lockDir(k.dir)
	if err != nil {
		return "", err
	}
	defer unlock()

	// Rotate from what is on disk, not from memory: another process may have rotated since we read.
	cur, err := k.read()
	if err != nil {
		return "", err
	}
	sk, err := k.writeNewKey()
	if err != nil {
		return "", err
	}
	next := keyringJSON{Active: sk.kid, Retiring: []retiringJSON{{Kid: cur.active.kid, RetireAt: k.now().Add(window)}}}
	for _, r := range cur.retiring {
		next.Retiring = append(next.Retiring, retiringJSON{Kid: r.kid, RetireAt: r.retireAt})
	}
	st, err := k.commit(next)
	if err != nil {
		return "", err
	}
	k.state.Store(st)
	return sk.kid, nil
}

// Reload re-reads the directory, so a running broker picks up a rotation made by another process
// (`broker keys rotate-signing`). It is cheap when nothing changed (one stat of keyring.json); call
// it periodically. It also prunes keys whose window has passed. On error the keys in use stay.
func (k *Keyring) Reload() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	cur := k.state.Load()
	if fi, err := os.Stat(filepath.Join(k.dir, keyringFile)); err == nil && sameFile(cur.file, fi) &&
		(cur.nextRetire.IsZero() || k.now().Before(cur.nextRetire)) {
		return nil
	}
	st, err := k.read()
	if err != nil {
		return err
	}
	var perr error
	if len(st.expired) > 0 {
		var pruned *keyState
		if pruned, perr = k.prune(); perr == nil {
			st = pruned
		}
	}
	k.state.Store(st)
	return perr
}

// reloadOnMiss reloads when verification meets an unknown kid, at most once per missReloadInterval:
// a token signed by another broker right after a rotation then verifies here without waiting for
// the periodic Reload, and a flood of bogus kids costs at most one stat per interval.
func (k *Keyring) reloadOnMiss() {
	now := time.Now().UnixNano()
	last := k.lastMissReload.Load()
	if now-last < int64(missReloadInterval) || !k.lastMissReload.CompareAndSwap(last, now) {
		return
	}
	_ = k.Reload() // on error the current keys stay; the periodic Reload reports it
}

func sameFile(a, b os.FileInfo) bool {
	return a != nil && b != nil && os.SameFile(a, b) && a.ModTime().Equal(b.ModTime()) && a.Size() == b.Size()
}

// kidOf derives a key's id from its public key, so a kid can never name two keys.
func kidOf(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return base64.RawURLEncoding.EncodeToString(sum[:kidBytes])
}

func validKid(kid string) bool {
	if len(kid) != kidLen {
		return false
	}
	for i := 0; i < len(kid); i++ {
		if !isB64URL(kid[i]) {
			return false
		}
	}
	return true
}

var errNoKeyring = errors.New("no keyring in the directory")

// read loads the keyring from disk. It returns errNoKeyring when keyring.json does not exist.
// Retiring keys past their window are not loaded but listed in expired.
func (k *Keyring) read() (*keyState, error) {
	var err error
	for range 3 {
		var st *keyState
		st, err = k.readOnce()
		// A PEM vanishing under us means another process pruned or rotated between our read of
		// keyring.json and of the PEM: read again.
		if err == nil || !errors.Is(err, errKeyVanished) {
			return st, err
		}
	}
	return nil, err
}

var errKeyVanished = errors.New("key file vanished")

func (k *Keyring) readOnce() (*keyState, error) {
	path := filepath.Join(k.dir, keyringFile)
	data, fi, err := readPrivateFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("delegation: %s does not exist: %w", path, errNoKeyring)
	}
	if err != nil {
		return nil, err
	}
	var kj keyringJSON
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&kj); err != nil {
		return nil, fmt.Errorf("delegation: %s is not a valid keyring file: %v", path, err)
	}
	if !validKid(kj.Active) {
		return nil, fmt.Errorf("delegation: %s: active kid %q is not a valid key id", path, kj.Active)
	}
	now := k.now()
	st := &keyState{byKid: make(map[string]*signingKey), file: fi}
	if st.active, err = k.loadKey(kj.Active); err != nil {
		return nil, err
	}
	st.byKid[kj.Active] = st.active
	for _, r := range kj.Retiring {
		if !validKid(r.Kid) || r.RetireAt.IsZero() {
			return nil, fmt.Errorf("delegation: %s: retiring entry %q has an invalid kid or no retire_at", path, r.Kid)
		}
		if _, dup := st.byKid[r.Kid]; dup || slices.Contains(st.expired, r.Kid) {
			return nil, fmt.Errorf("delegation: %s names key %s twice", path, r.Kid)
		}
		if !now.Before(r.RetireAt) {
			st.expired = append(st.expired, r.Kid)
			continue
		}
		sk, err := k.loadKey(r.Kid)
		if err != nil {
			return nil, err
		}
		sk.retireAt = r.RetireAt
		st.retiring = append(st.retiring, sk)
		st.byKid[r.Kid] = sk
		if st.nextRetire.IsZero() || r.RetireAt.Before(st.nextRetire) {
			st.nextRetire = r.RetireAt
		}
	}
	return st, nil
}

func (k *Keyring) loadKey(kid string) (*signingKey, error) {
	path := filepath.Join(k.dir, kid+keyFileExt)
	data, _, err := readPrivateFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("delegation: key %s is named in %s but %s is missing: %w", kid, keyringFile, path, errKeyVanished)
	}
	if err != nil {
		return nil, err
	}
	block, rest := pem.Decode(data)
	if block == nil || block.Type != pemType || len(bytes.TrimSpace(rest)) != 0 {
		return nil, fmt.Errorf("delegation: %s is not a single PEM %q block", path, pemType)
	}
	key, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("delegation: %s: %v", path, err)
	}
	priv, ok := key.(ed25519.PrivateKey)
	if !ok {
		return nil, fmt.Errorf("delegation: %s holds a %T, not an Ed25519 key", path, key)
	}
	pub := priv.Public().(ed25519.PublicKey)
	if got := kidOf(pub); got != kid {
		return nil, fmt.Errorf("delegation: %s holds key %s, not %s", path, got, kid)
	}
	return &signingKey{kid: kid, priv: priv, pub: pub}, nil
}

// readPrivateFile reads a regular file that only its owner may read.
func readPrivateFile(path string) ([]byte, os.FileInfo, error) {
	lfi, err := os.Lstat(path)
	if err != nil {
		return nil, nil, err
	}
	if !lfi.Mode().IsRegular() {
		return nil, nil, fmt.Errorf("delegation: %s is not a regular file (symlinks are refused)", path)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	if !os.SameFile(lfi, fi) {
		return nil, nil, fmt.Errorf("delegation: %s was replaced while being read: %w", path, errKeyVanished)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return nil, nil, fmt.Errorf("%w: %s has mode %04o, readable by group or others; it must be readable "+
			"by its owner only: run chmod 600 %s", ErrInsecureKeyFile, path, perm, path)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxKeyFileSize+1))
	if err != nil {
		return nil, nil, err
	}
	if len(data) > maxKeyFileSize {
		return nil, nil, fmt.Errorf("delegation: %s is larger than %d bytes", path, maxKeyFileSize)
	}
	return data, fi, nil
}

// create makes a first key, under the directory lock; if another process created the keyring first,
// it reads that one instead.
func (k *Keyring) create() (*keyState, error) {
	unlock, err := lockDir(k.dir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	st, err := k.read()
	if !errors.Is(err, errNoKeyring) {
		return st, err
	}
	sk, err := k.writeNewKey()
	if err != nil {
		return nil, err
	}
	return k.commit(keyringJSON{Active: sk.kid, Retiring: []retiringJSON{}})
}

// prune rewrites keyring.json without the retiring keys past their window, under the directory lock.
func (k *Keyring) prune() (*keyState, error) {
	unlock, err := lockDir(k.dir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	cur, err := k.read()
	if err != nil {
		return nil, err
	}
	if len(cur.expired) == 0 {
		return cur, nil
	}
	next := keyringJSON{Active: cur.active.kid, Retiring: []retiringJSON{}}
	for _, r := range cur.retiring {
		next.Retiring = append(next.Retiring, retiringJSON{Kid: r.kid, RetireAt: r.retireAt})
	}
	return k.commit(next)
}

// writeNewKey generates a key and writes its PEM. The caller holds the directory lock and commits a
// keyring.json naming it.
func (k *Keyring) writeNewKey() (*signingKey, error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("delegation: generate key: %w", err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return nil, fmt.Errorf("delegation: encode key: %w", err)
	}
	sk := &signingKey{kid: kidOf(pub), priv: priv, pub: pub}
	if err := writeFileAtomic(k.dir, sk.kid+keyFileExt, pem.EncodeToMemory(&pem.Block{Type: pemType, Bytes: der})); err != nil {
		return nil, err
	}
	return sk, nil
}

// commit writes keyring.json, removes every key file (and stale temp file) it no longer names, and
// returns the state as read back. The caller holds the directory lock, so no other writer's new key
// file can be mistaken for an orphan.
func (k *Keyring) commit(next keyringJSON) (*keyState, error) {
	data, err := json.MarshalIndent(next, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := writeFileAtomic(k.dir, keyringFile, append(data, '\n')); err != nil {
		return nil, err
	}
	keep := map[string]bool{next.Active + keyFileExt: true}
	for _, r := range next.Retiring {
		keep[r.Kid+keyFileExt] = true
	}
	entries, err := os.ReadDir(k.dir)
	if err != nil {
		return nil, err
	}
	for _, e := range entries {
		name := e.Name()
		orphanKey := strings.HasSuffix(name, keyFileExt) && validKid(strings.TrimSuffix(name, keyFileExt)) && !keep[name]
		staleTemp := strings.HasPrefix(name, ".") && strings.Contains(name, tempInfix)
		if orphanKey || staleTemp {
			if err := os.Remove(filepath.Join(k.dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("delegation: prune %s: %w", name, err)
			}
		}
	}
	return k.read()
}

const tempInfix = ".tmp-"

// writeFileAtomic writes dir/name with mode 0600 through a temporary file and a rename, then syncs
// the directory, so a crash leaves either the old or the new content.
func writeFileAtomic(dir, name string, data []byte) (err error) {
	f, err := os.CreateTemp(dir, "."+name+tempInfix+"*")
	if err != nil {
		return fmt.Errorf("delegation: write %s: %w", name, err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(tmp)
			err = fmt.Errorf("delegation: write %s: %w", filepath.Join(dir, name), err)
		}
	}()
	if err = f.Chmod(0o600); err != nil {
		return err
	}
	if _, err = f.Write(data); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(tmp, filepath.Join(dir, name)); err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
