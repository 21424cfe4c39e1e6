package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
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
