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

// WriteConfig writes a config file readable by its owner only (it holds a key).
func WriteConfig(path string, c Config) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	b, err := yaml.Marshal(c)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append([]byte("# sbctl configuration (written by the broker on its first start)\n"), b...), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
