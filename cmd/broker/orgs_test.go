package main

import (
	"errors"
	"os"
	"strings"
	"testing"
)

// Bad default limits are configuration errors that name the flag and its variable.
func TestLimitFlagsAreValidated(t *testing.T) {
	cmd := rootCmd()
	t.Setenv("SBX_ORG_RPS", "-1")
	cmd.SetArgs([]string{"--org-max-running", "-5", "--auth-failure-window", "10ms", "--data-dir", t.TempDir()})
	err := cmd.Execute()
	if err == nil {
		t.Fatal("want a configuration error")
	}
	for _, want := range []string{"--org-max-running (SBX_ORG_MAX_RUNNING)", "--org-rps (SBX_ORG_RPS)", "--auth-failure-window (SBX_AUTH_FAILURE_WINDOW)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}

// set-limits refuses what is not a number or "default" before reaching Redis.
func TestSetLimitsFlagValues(t *testing.T) {
	var l limitValue
	for _, bad := range []string{"-1", "x", "1e3", "2000000"} {
		if err := l.Set(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	if err := l.Set("default"); err != nil || !l.clear {
		t.Errorf("default: %v %+v", err, l)
	}
	if err := l.Set("0"); err != nil || l.clear || l.v != 0 || !l.set {
		t.Errorf("0: %v %+v", err, l)
	}
}

// keys create and list refuse a bad org name or -o before they touch the data dir: a mistyped
// command must not start an embedded Redis in a directory it creates.
func TestKeysRefuseBadInputBeforeTheStore(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"keys", "create", "--org", "Bad", "--name", "x"}, `invalid org name "Bad"`},
		{[]string{"keys", "create", "--org", "acme", "--name", "x", "-o", "yaml"}, "-o must be text, json or key"},
		{[]string{"keys", "list", "-o", "yaml"}, "-o must be table or json"},
	} {
		dataDir := t.TempDir() + "/data"
		cmd := rootCmd()
		cmd.SetArgs(append(tc.args, "--data-dir", dataDir))
		err := cmd.Execute()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error saying %q", tc.args, err, tc.want)
		}
		if _, err := os.Stat(dataDir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%v: the data dir was made (%v)", tc.args, err)
		}
	}
}

// A mistyped command is refused with the command it was probably meant to be.
func TestUnknownCommandSuggests(t *testing.T) {
	cmd := rootCmd()
	cmd.SetArgs([]string{"kyes", "list"})
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "Did you mean this?\n\tkeys") {
		t.Fatalf("%v, want an unknown command suggesting keys", err)
	}
}
