package client

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"sigs.k8s.io/yaml"
)

// Config is sbctl's config file: where the broker is and which key to use. The broker writes one on
// its first start on the embedded default, so sbctl works with no set-up.
type Config struct {
	Broker string `json:"broker"`
	APIKey string `json:"api_key"`
}

// ConfigPath is $SBCTL_CONFIG, else $XDG_CONFIG_HOME/sbctl/config.yaml, else ~/.config/sbctl/config.yaml.
func ConfigPath() string {
	if p := os.Getenv("SBCTL_CONFIG"); p != "" {
		return p
	}
	dir := os.Getenv("XDG_CONFIG_HOME")
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			home = "."
		}
		dir = filepath.Join(home, ".config")
	}
	return filepath.Join(dir, "sbctl", "config.yaml")
}

// LoadConfig reads a config file; a missing file is an empty config, not an error.
func LoadConfig(path string) (Config, error) {
	var c Config
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return c, nil
	}
	if err != nil {
		return c, err
	}
	if err := yaml.UnmarshalStrict(b, &c); err != nil {
		return c, fmt.Errorf("config file %s: %w", path, err)
	}
	return c, nil
}

// WriteConfig writes a config file readable by its owner only (it holds a key), atomically: a
// reader sees the old file or the whole new one, never a part, and a failed write leaves the old
// file as it was.
func WriteConfig(path string, c Config) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	b, err := yaml.Marshal(c)
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, ".config-*.tmp") // 0600
	if err != nil {
		return err
	}
	_, err = f.Write(append([]byte("# sbctl configuration (written by the broker on its first start)\n"), b...))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}
