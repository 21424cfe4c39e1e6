package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/sbxbroker/broker/delegation"
)

// tokenTTLFile, in the signing-keys directory, records the longest --token-max-ttl a broker using
// these keys has served with. keys rotate-signing runs in another process, maybe with other flags
// or none: it reads this file to keep the old key verifying for as long as a token it signed can
// live. The value only grows, since tokens minted under a longer setting outlive a restart with a
// shorter one; remove the file once they have expired to let it shrink.
const tokenTTLFile = "token-max-ttl"

// recordTokenMaxTTL raises the recorded token lifetime to d if it is shorter.
func recordTokenMaxTTL(dir string, d time.Duration) error {
	if prev, err := recordedTokenMaxTTL(dir); err == nil && prev >= d {
		return nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, tokenTTLFile+".*.tmp")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	_, err = tmp.WriteString(d.String() + "\n")
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return os.Rename(tmp.Name(), filepath.Join(dir, tokenTTLFile))
}

// recordedTokenMaxTTL reads the recorded token lifetime; the error wraps os.ErrNotExist when no
// broker has recorded one.
func recordedTokenMaxTTL(dir string) (time.Duration, error) {
	path := filepath.Join(dir, tokenTTLFile)
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	d, err := time.ParseDuration(strings.TrimSpace(string(b)))
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("%s does not hold a duration: remove it, start the broker once, and retry", path)
	}
	return d, nil
}

// rotationWindow is how long the retiring key must keep verifying: the longest token lifetime, plus
// clock leeway and the brokers' reload interval. flagTTL is rotate-signing's --token-max-ttl (0
// when not given); the longer of it and the recorded value wins.
func rotationWindow(dir string, flagTTL, leeway time.Duration) (time.Duration, error) {
	recorded, err := recordedTokenMaxTTL(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return 0, err
	}
	longest := max(recorded, flagTTL)
	if longest <= 0 {
		return 0, fmt.Errorf("no broker has recorded its --token-max-ttl in %s yet, so how long the old key's tokens live is unknown: "+
			"start the broker once, or pass --token-max-ttl (SBX_TOKEN_MAX_TTL) with the longest value any broker sharing these keys uses", dir)
	}
	return longest + leeway + time.Minute, nil
}

// secretVolumeMarker is the symlink Kubernetes' atomic writer puts in every Secret, ConfigMap and
// projected volume: the files beside it are symlinks through it into a timestamped directory.
const secretVolumeMarker = "..data"

// checkSigningDir refuses, before the keyring is opened, a signing-keys directory that is a
// Kubernetes Secret volume: it is read-only, its files are symlinks and its directory is writable
// by all (0777, on a read-only mount), so the keyring would refuse it anyway, with advice (chmod)
// that cannot apply there. The way through is a private copy.
func checkSigningDir(dir string) error {
	if _, err := os.Lstat(filepath.Join(dir, secretVolumeMarker)); err != nil {
		return nil
	}
	return fmt.Errorf("--signing-keys (SBX_SIGNING_KEYS): %s is a Kubernetes Secret (or ConfigMap) volume: read-only, with symlinked files, which a keyring cannot be "+
		"(it must be a private 0700 directory the broker can write); copy it into one first with `broker keys import-signing --from %s` "+
		"(deploy/kubernetes does so in an init container) and point --signing-keys there", dir, dir)
}

// importSigning copies a keyring (keyring.json and its KID.pem keys) from src, which may be a
// Kubernetes Secret volume (symlinked, group-readable files), into the private directory dst
// (0700, files 0600), keys first and keyring.json last (the keyring's commit point), then opens it
// to check that it is whole. It answers the active key's id.
func importSigning(src, dst string) (string, error) {
	if _, err := os.Stat(filepath.Join(src, keyringJSON)); err != nil {
		return "", fmt.Errorf("--from %s holds no %s: create the keys with `broker keys rotate-signing --signing-keys DIR`, then the Secret from DIR (docs/operations.md, Running on Kubernetes)", src, keyringJSON)
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dst, 0o700); err != nil {
		return "", err
	}
	if err := os.Chmod(dst, 0o700); err != nil {
		return "", err
	}
	var names []string
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".pem") && !strings.HasPrefix(e.Name(), ".") {
			names = append(names, e.Name())
		}
	}
	names = append(names, keyringJSON) // last
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join(src, n)) // follows the volume's symlinks
		if err != nil {
			return "", err
		}
		if err := writePrivate(filepath.Join(dst, n), b); err != nil {
			return "", err
		}
	}
	keys, err := delegation.LoadOrCreateKeyring(dst, time.Now)
	if err != nil {
		return "", fmt.Errorf("the imported keyring in %s: %w", dst, err)
	}
	kid, _ := keys.Signer()
	return kid, nil
}

// keyringJSON is the keyring's index file (delegation's on-disk layout).
const keyringJSON = "keyring.json"

// writePrivate writes b to path (0600) through a temporary file and a rename.
func writePrivate(path string, b []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".import-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	_, err = tmp.Write(b)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
