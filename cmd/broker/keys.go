package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/sbxbroker/broker/cmd/internal/usage"
	"github.com/sbxbroker/broker/delegation"
	"github.com/sbxbroker/broker/store"
)

// keysCmd administers org API keys directly in Redis (no running broker needed; with the embedded
// default and a broker running, it uses that broker's Redis).
func keysCmd(c *config) *cobra.Command {
	keys := &cobra.Command{
		Use:   "keys",
		Short: "Manage org API keys (and the token signing keys)",
		Long: `API keys authenticate owners (sbctl, clients, agent servers doing introspection). A key is
shown once when created; the broker keeps only its SHA-256 hash.`,
		Example: `  broker keys create --org acme --name ci
  broker keys list
  broker keys revoke KEY_ID`,
	}
	keys.AddCommand(keysCreateCmd(c), keysListCmd(c), keysRevokeCmd(c), rotateSigningCmd(c), importSigningCmd(c))
	return keys
}

// withStore opens storage for an admin command, quietly.
func withStore(cmd *cobra.Command, c *config, fn func(*store.Store) error) error {
	if err := applyEnv(cmd); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	st, err := openStorage(cmd.Context(), c, log, false)
	if err != nil {
		return err
	}
	defer st.close()
	return fn(st.store)
}

func keysCreateCmd(c *config) *cobra.Command {
	var org, name, output string
	cmd := &cobra.Command{
		Use:   "create --org ORG --name NAME",
		Short: "Create an API key for an org (the org is created if new); the key is printed once",
		Example: `  broker keys create --org acme --name ci
  SBX_API_KEY=$(broker keys create --org acme --name laptop -o key) sbctl list`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if org == "" || name == "" {
				return usage.Errorf("--org and --name are required; see %s --help", cmd.CommandPath())
			}
			// Refused here, before withStore starts an embedded Redis in a data dir it may create.
			if !store.ValidOrg(org) {
				return usage.Errorf("invalid org name %q: use lowercase letters, digits and '-', at most 63", org)
			}
			if output != "text" && output != "json" && output != "key" {
				return usage.Errorf("-o must be text, json or key, not %q", output)
			}
			return withStore(cmd, c, func(s *store.Store) error {
				key, k, err := s.CreateAPIKey(cmd.Context(), org, name, time.Now())
				if err != nil {
					return err
				}
				switch output {
				case "key":
					fmt.Println(key)
				case "json":
					return json.NewEncoder(os.Stdout).Encode(map[string]string{"id": k.ID, "org": k.Org, "name": k.Name, "key": key})
				default:
					fmt.Printf("API key %s for org %s (%s):\n\n  %s\n\nIt is shown only now: store it (e.g. sbctl's config, or SBX_API_KEY).\n", k.ID, k.Org, k.Name, key)
				}
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&org, "org", "", "org the key belongs to (lowercase letters, digits, '-')")
	cmd.Flags().StringVar(&name, "name", "", "a label for the key (who or what uses it)")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text, json, or key (the bare key, for scripts)")
	return cmd
}

func keysListCmd(c *config) *cobra.Command {
	var org, output string
	cmd := &cobra.Command{
		Use:   "list [--org ORG]",
		Short: "List API keys (ids and metadata; keys themselves are never stored)",
		Example: `  broker keys list
  broker keys list --org acme -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "table" && output != "json" {
				return usage.Errorf("-o must be table or json, not %q", output)
			}
			return withStore(cmd, c, func(s *store.Store) error {
				keys, err := s.ListAPIKeys(cmd.Context(), org)
				if err != nil {
					return err
				}
				if output == "json" {
					type row struct {
						ID        string     `json:"id"`
						Org       string     `json:"org"`
						Name      string     `json:"name"`
						CreatedAt time.Time  `json:"created_at"`
						RevokedAt *time.Time `json:"revoked_at,omitempty"`
					}
					rows := make([]row, 0, len(keys))
					for _, k := range keys {
						r := row{ID: k.ID, Org: k.Org, Name: k.Name, CreatedAt: k.CreatedAt}
						if !k.RevokedAt.IsZero() {
							r.RevokedAt = &k.RevokedAt
						}
						rows = append(rows, r)
					}
					return json.NewEncoder(os.Stdout).Encode(rows)
				}
				tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tORG\tNAME\tCREATED\tSTATE")
				for _, k := range keys {
					state := "active"
					if !k.RevokedAt.IsZero() {
						state = "revoked " + k.RevokedAt.Format(time.RFC3339)
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", k.ID, k.Org, k.Name, k.CreatedAt.Format(time.RFC3339), state)
				}
				return tw.Flush()
			})
		},
	}
	cmd.Flags().StringVar(&org, "org", "", "only this org's keys")
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output: table or json")
	return cmd
}

func keysRevokeCmd(c *config) *cobra.Command {
	return &cobra.Command{
		Use:   "revoke KEY_ID",
		Short: "Revoke an API key by its id (see `broker keys list`)",
		Long: `Revokes an API key at once on every broker sharing the Redis: the key stops working, every
delegation token it minted becomes inactive, and the dataplane connections and event streams
opened with either are closed within a second. Tokens minted by the org's other keys are untouched.`,
		Example: `  broker keys list --org acme      # find the key's id
  broker keys revoke 7vsnz3r5uu74kqtu       # an ID from keys list`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withStore(cmd, c, func(s *store.Store) error {
				k, err := s.RevokeAPIKey(cmd.Context(), args[0], time.Now())
				if errors.Is(err, store.ErrNotFound) {
					return fmt.Errorf("no API key with id %q (see `broker keys list`)", args[0])
				}
				if err != nil {
					return err
				}
				fmt.Printf("revoked API key %s (org %s, %s) and every delegation token it minted\n", k.ID, k.Org, k.Name)
				return nil
			})
		},
	}
}

func rotateSigningCmd(c *config) *cobra.Command {
	var tokenMaxTTL time.Duration
	cmd := &cobra.Command{
		Use:   "rotate-signing",
		Short: "Make a new active key for signing delegation tokens; the old one keeps verifying until its tokens expire",
		Long: `Generates a new Ed25519 signing key and makes it active. The previous key stays in the JWKS and
keeps verifying the tokens it signed until they have all expired, then it is dropped. A running
broker picks the new key up within 10 seconds.

How long tokens live is the brokers' --token-max-ttl, which each broker records in the signing-keys
directory when it starts (the longest one any broker sharing the keys served with): this command
uses that, or --token-max-ttl if it is longer.`,
		Example: `  broker keys rotate-signing
  broker keys rotate-signing --signing-keys /etc/sbx/signing --token-max-ttl 48h`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyEnv(cmd); err != nil {
				return err
			}
			window, err := rotationWindow(c.signingDir(), tokenMaxTTL, delegation.DefaultLeeway)
			if err != nil {
				return err
			}
			keys, err := delegation.LoadOrCreateKeyring(c.signingDir(), time.Now)
			if err != nil {
				return err
			}
			old, _ := keys.Signer()
			kid, err := keys.Rotate(window)
			if err != nil {
				return err
			}
			fmt.Printf("new signing key %s is active; %s keeps verifying until %s\n", kid, old, time.Now().Add(window).Format(time.RFC3339))
			return nil
		},
	}
	cmd.Flags().DurationVar(&tokenMaxTTL, "token-max-ttl", 0, "the longest token lifetime any broker sharing these keys uses, when longer than the one the brokers recorded")
	return cmd
}

func importSigningCmd(c *config) *cobra.Command {
	var from string
	cmd := &cobra.Command{
		Use:   "import-signing --from DIR",
		Short: "Copy token signing keys (e.g. a Kubernetes Secret volume) into the signing-keys directory",
		Long: `Copies a keyring (keyring.json and its KID.pem keys) from DIR into --signing-keys (default
<data-dir>/signing) as a private directory (0700, files 0600), then checks that it opens. A
Kubernetes Secret volume cannot be the signing-keys directory itself (read-only, symlinked files):
brokers sharing a Redis share their keys through one Secret, imported by each at start
(deploy/kubernetes runs this in an init container).`,
		Example: `  broker keys import-signing --from /etc/sbx-signing --signing-keys /run/sbx-signing/keys`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyEnv(cmd); err != nil {
				return err
			}
			if from == "" {
				return usage.Errorf("--from is required: the directory holding keyring.json and its keys")
			}
			kid, err := importSigning(from, c.signingDir())
			if err != nil {
				return err
			}
			fmt.Printf("signing keys imported into %s; active key %s\n", c.signingDir(), kid)
			return nil
		},
	}
	cmd.Flags().StringVar(&from, "from", "", "directory to copy the keyring from (e.g. a mounted Secret)")
	return cmd
}
