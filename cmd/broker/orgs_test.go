package main

import (
	"bytes"
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

// A wrong command line exits 2 with a line saying what to do, and touches no data dir: cobra's own
// answers (help for an unknown topic or subcommand, exit 0; its unknown-command and flag errors,
// exit 1) told a script nothing.
func TestUsageErrorsExit2(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"help", "nope"}, `unknown help topic "nope"; see broker --help`},
		{[]string{"help", "kyes"}, `(did you mean keys?)`},
		{[]string{"kyes"}, `unknown command "kyes" (did you mean keys?); see broker --help`},
		{[]string{"kyes", "list"}, `unknown command "kyes"`},
		{[]string{"version"}, `unknown command "version" (did you mean --version?)`},
		{[]string{"keys", "nope"}, `unknown command "nope" for "broker keys"; see broker keys --help`},
		{[]string{"keys", "lsit"}, `(did you mean list?)`},
		{[]string{"orgs", "nope"}, `see broker orgs --help`},
		{[]string{"keys", "list", "extra"}, `see broker keys list --help`},
		{[]string{"keys", "create"}, `--org and --name are required; see broker keys create --help`},
		{[]string{"keys", "create", "--org", "acme", "--name", "x", "-o", "yaml"}, "-o must be text, json or key"},
		{[]string{"--nope"}, "unknown flag: --nope (did you mean --node?); see broker --help"},
		{[]string{"--listn", ":1"}, "(did you mean --listen?)"},
		{[]string{"keys", "list", "--ogr", "x"}, "see broker keys list --help"},
	} {
		dataDir := t.TempDir() + "/data"
		var out, errb bytes.Buffer
		code := run(append(tc.args, "--data-dir", dataDir), &out, &errb)
		if code != 2 || !strings.Contains(errb.String(), tc.want) {
			t.Errorf("broker %v: exit %d %q; want exit 2 saying %q", tc.args, code, errb.String(), tc.want)
		}
		if _, err := os.Stat(dataDir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%v: the data dir was made (%v)", tc.args, err)
		}
	}
	for _, args := range [][]string{{"help"}, {"help", "keys"}, {"keys"}, {"keys", "--help"}, {"help", "keys", "create"}} {
		var out, errb bytes.Buffer
		if code := run(args, &out, &errb); code != 0 || !strings.Contains(out.String(), "Usage:") {
			t.Errorf("broker %v: exit %d %q, want its help", args, code, errb.String())
		}
	}
}
