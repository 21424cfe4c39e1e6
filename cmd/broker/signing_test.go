package main

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sbxbroker/broker/delegation"
)

// rotate-signing's window comes from what the brokers recorded, not from its own default: a broker
// minting 7-day tokens must not see its old key dropped after a day.
func TestRotationWindowUsesTheBrokersTokenMaxTTL(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "signing")
	if _, err := rotationWindow(dir, 0, 0); err == nil || !strings.Contains(err.Error(), "--token-max-ttl") {
		t.Fatalf("nothing recorded, no flag: want an error naming --token-max-ttl, got %v", err)
	}
	if w, err := rotationWindow(dir, time.Hour, 0); err != nil || w != time.Hour+time.Minute {
		t.Fatalf("flag only: %s %v", w, err)
	}
	for _, d := range []time.Duration{7 * 24 * time.Hour, time.Hour} { // a later, shorter setting does not shrink it
		if err := recordTokenMaxTTL(dir, d); err != nil {
			t.Fatal(err)
		}
	}
	if fi, err := os.Stat(filepath.Join(dir, tokenTTLFile)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("record: %v %v", fi, err)
	}
	if w, err := rotationWindow(dir, 0, 5*time.Second); err != nil || w != 7*24*time.Hour+5*time.Second+time.Minute {
		t.Fatalf("recorded 7d: %s %v", w, err)
	}
	if w, _ := rotationWindow(dir, 30*24*time.Hour, 0); w != 30*24*time.Hour+time.Minute {
		t.Fatalf("a longer flag wins: %s", w)
	}
	os.WriteFile(filepath.Join(dir, tokenTTLFile), []byte("forever\n"), 0o600)
	if _, err := rotationWindow(dir, time.Hour, 0); err == nil {
		t.Fatal("a corrupt record must be an error, not ignored")
	}
}

// --token-max-ttl belongs to serve and rotate-signing only.
func TestTokenMaxTTLFlagWhereItMeansSomething(t *testing.T) {
	t.Parallel()
	root := rootCmd()
	for path, want := range map[string]bool{"": true, "keys create": false, "keys list": false, "keys revoke": false, "keys rotate-signing": true} {
		cmd, _, err := root.Find(strings.Fields(path))
		if err != nil {
			t.Fatal(err)
		}
		cmd.InitDefaultHelpFlag()
		if got := cmd.Flags().Lookup("token-max-ttl") != nil || cmd.InheritedFlags().Lookup("token-max-ttl") != nil; got != want {
			t.Errorf("broker %s: has --token-max-ttl %v, want %v", path, got, want)
		}
	}
}

// Every flag with an environment fallback names it in --help, --provider-reset included.
func TestHelpNamesEnvFallbacks(t *testing.T) {
	root := rootCmd()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs([]string{"--help"})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	for flag, env := range envOf {
		if !strings.Contains(out.String(), "(env "+env+")") {
			t.Errorf("--%s: help does not name %s", flag, env)
		}
	}
	for _, l := range strings.Split(out.String(), "\n") {
		if strings.Contains(l, "--retention") && strings.Contains(l, "(default") {
			t.Errorf("--retention states its default in words; pflag must not add another: %s", l)
		}
	}
	t.Setenv("SBX_PROVIDER_RESET", "true")
	cmd := rootCmd()
	if err := applyEnv(cmd); err != nil {
		t.Fatal(err)
	}
	if v, _ := cmd.Flags().GetBool("provider-reset"); !v {
		t.Error("SBX_PROVIDER_RESET=true did not set --provider-reset")
	}
}

// A wildcard --listen without --advertise-url would hand remote agents 127.0.0.1: say so.
func TestAdvertiseWarning(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		listen, advertise string
		warn              bool
	}{
		{"127.0.0.1:7070", "", false},
		{"10.0.0.5:7070", "", false},
		{"0.0.0.0:7070", "", true},
		{":7070", "", true},
		{"[::]:7070", "", true},
		{"0.0.0.0:7070", "http://broker.internal:7070", false},
	} {
		c := &config{Listen: tc.listen, AdvertiseURL: tc.advertise}
		w := c.advertiseWarning()
		if (w != "") != tc.warn || (tc.warn && !strings.Contains(w, "--advertise-url")) {
			t.Errorf("--listen %s --advertise-url %q: warning %q", tc.listen, tc.advertise, w)
		}
	}
}

// go-redis' messages come out as structured log lines (JSON with --log-format json).
func TestRedisLoggerIsStructured(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	redisLogger{slog.New(slog.NewJSONHandler(&buf, nil))}.Printf(t.Context(), "redis: discarding bad conn: %v\n", "EOF")
	var line map[string]any
	if err := json.Unmarshal(buf.Bytes(), &line); err != nil || line["msg"] != "redis: discarding bad conn: EOF" || line["component"] != "go-redis" {
		t.Fatalf("%q: %v", buf.String(), err)
	}
}

// secretVolume lays dir out as kubelet lays out a Secret volume: a 0777 directory whose files are
// symlinks through ..data into a timestamped directory of group-readable files.
func secretVolume(t *testing.T, dir string, files map[string][]byte) {
	t.Helper()
	ts := "..2026_11_27_06_00_00.000000001"
	if err := os.MkdirAll(filepath.Join(dir, ts), 0o755); err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o777)
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, ts, name), b, 0o440); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(filepath.Join(secretVolumeMarker, name), filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(ts, filepath.Join(dir, secretVolumeMarker)); err != nil {
		t.Fatal(err)
	}
}

// Brokers on Kubernetes share their signing keys through one Secret: a Secret volume cannot be the
// keyring (the broker refuses it at start, saying what to do), and import-signing copies it into a
// private directory that opens with the same active and retiring keys.
func TestImportSigningFromASecretVolume(t *testing.T) {
	t.Parallel()
	tmp := t.TempDir()
	orig, err := delegation.LoadOrCreateKeyring(filepath.Join(tmp, "orig"), time.Now)
	if err != nil {
		t.Fatal(err)
	}
	old, _ := orig.Signer()
	active, err := orig.Rotate(time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{}
	ents, _ := os.ReadDir(filepath.Join(tmp, "orig"))
	for _, e := range ents {
		if n := e.Name(); n == keyringJSON || strings.HasSuffix(n, ".pem") {
			files[n], _ = os.ReadFile(filepath.Join(tmp, "orig", n))
		}
	}
	vol := filepath.Join(tmp, "secret")
	secretVolume(t, vol, files)

	if err := checkSigningDir(vol); err == nil || !strings.Contains(err.Error(), "broker keys import-signing --from "+vol) {
		t.Fatalf("serving on a Secret volume: %v, want a refusal naming import-signing", err)
	}
	if err := checkSigningDir(filepath.Join(tmp, "orig")); err != nil {
		t.Fatalf("a private keyring: %v", err)
	}

	dst := filepath.Join(tmp, "private", "keys")
	kid, err := importSigning(vol, dst)
	if err != nil || kid != active {
		t.Fatalf("import: %q %v, want active key %s", kid, err, active)
	}
	if fi, err := os.Stat(dst); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("the imported keyring's directory: %v %v", fi, err)
	}
	for n := range files {
		if fi, err := os.Lstat(filepath.Join(dst, n)); err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm() != 0o600 {
			t.Errorf("imported %s: %v %v", n, fi, err)
		}
	}
	got, err := delegation.LoadOrCreateKeyring(dst, time.Now)
	if err != nil {
		t.Fatal(err)
	}
	if k, _ := got.Signer(); k != active {
		t.Errorf("imported active key %s, want %s", k, active)
	}
	if _, ok := got.PublicKey(old, time.Now()); !ok {
		t.Errorf("the retiring key %s does not verify after the import", old)
	}

	// A directory with no keyring is refused, and nothing is made.
	empty := filepath.Join(tmp, "empty")
	os.Mkdir(empty, 0o700)
	nowhere := filepath.Join(tmp, "nowhere")
	if _, err := importSigning(empty, nowhere); err == nil || !strings.Contains(err.Error(), "rotate-signing") {
		t.Errorf("importing from a directory without a keyring: %v", err)
	}
	if _, err := os.Stat(nowhere); !os.IsNotExist(err) {
		t.Errorf("a refused import made %s: %v", nowhere, err)
	}
}
