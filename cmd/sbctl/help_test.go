package main

import (
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// Every sbctl command's help has a usage line, says what it does, and shows an example, and each
// flag's value is shown as its type, not a `backquoted` word of its usage.
func TestEveryCommandsHelpTeaches(t *testing.T) {
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		if c.Hidden || c.Name() == "help" || c.Parent() != nil && c.Parent().Name() == "completion" {
			return
		}
		if c.Short == "" {
			t.Errorf("%s: no one-line description", c.CommandPath())
		}
		if c.Runnable() && c.Example == "" && c.Name() != "completion" {
			t.Errorf("%s: no example in its help", c.CommandPath())
		}
		c.Flags().VisitAll(func(f *pflag.Flag) {
			name, _ := pflag.UnquoteUsage(f)
			if name != "" && name != f.Value.Type() && !(f.Value.Type() == "stringSlice" && name == "strings") && !(f.Value.Type() == "stringArray" && name == "stringArray") {
				t.Errorf("%s --%s: help shows its value as %q, not its type %q", c.CommandPath(), f.Name, name, f.Value.Type())
			}
		})
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(rootCmd(&globals{}))
}
