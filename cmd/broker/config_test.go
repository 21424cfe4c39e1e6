package main

import (
	"strings"
	"testing"
	"time"
)

// Every invalid setting is reported with its flag and environment variable, all at once.
func TestValidateNamesTheSetting(t *testing.T) {
	cmd := rootCmd()
	t.Setenv("SBX_LISTEN", "nonsense")
	t.Setenv("SBX_PROVIDER", "docker")
	cmd.SetArgs([]string{"--log-format", "xml", "--default-ttl", "48h", "--max-ttl", "24h", "--retention", "30s", "--redis-timeout", "0s", "--data-dir", t.TempDir()})
	err := cmd.Execute()
	if err == nil {
		t.Fatal("want a configuration error")
	}
	for _, want := range []string{"--listen (SBX_LISTEN)", "--provider (SBX_PROVIDER)", "--log-format (SBX_LOG_FORMAT)",
		"--default-ttl (SBX_DEFAULT_TTL)", "--retention (SBX_RETENTION)", "--redis-timeout (SBX_REDIS_TIMEOUT)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}

func TestEnvFallbackAndFlagPrecedence(t *testing.T) {
	cmd := rootCmd()
	t.Setenv("SBX_SWEEP_INTERVAL", "5s")
	t.Setenv("SBX_DEFAULT_TTL", "10m")
	if err := cmd.ParseFlags([]string{"--default-ttl", "20m"}); err != nil {
		t.Fatal(err)
	}
	if err := applyEnv(cmd); err != nil {
		t.Fatal(err)
	}
	sweep, _ := cmd.Flags().GetDuration("sweep-interval")
	ttl, _ := cmd.Flags().GetDuration("default-ttl")
	if sweep != 5*time.Second || ttl != 20*time.Minute {
		t.Fatalf("env fills unset flags, flags win: sweep %s ttl %s", sweep, ttl)
	}
	t.Setenv("SBX_MAX_TTL", "forever")
	if err := applyEnv(rootCmd()); err == nil || !strings.Contains(err.Error(), "SBX_MAX_TTL") {
		t.Fatalf("a bad env value must name the variable: %v", err)
	}
}
