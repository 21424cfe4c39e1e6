// Package usage is how sbctl and broker refuse a wrong command line: an unknown command, help
// topic or flag, wrong arguments. Each is an *Error, which both binaries exit 2 on, with a line
// that names the command's --help and, when one is close, the command or flag that was probably
// meant. It knows nothing of what the commands do.
package usage

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// Error is a usage error: the command line is wrong, and nothing was done.
type Error struct{ msg string }

func (e *Error) Error() string { return e.msg }

// Errorf makes a usage error.
func Errorf(format string, args ...any) error { return &Error{fmt.Sprintf(format, args...)} }

// Is reports whether err is a usage error.
func Is(err error) bool {
	var ue *Error
	return errors.As(err, &ue)
}

// Guard makes every mistake cobra itself catches under root a usage error that says what to do:
// flag errors, argument counts, an unknown subcommand of a command that only groups others, and
// `help TOPIC` for no command (cobra answers those last two with help and exit 0). The root's own
// arguments are left to the root's Args.
func Guard(root *cobra.Command) {
	root.SuggestionsMinimumDistance = 2
	root.SetFlagErrorFunc(flagError)
	root.InitDefaultCompletionCmd() // now, so that the walk below guards it too
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		switch {
		case c != root && c.HasSubCommands() && !c.Runnable():
			c.Args = cobra.ArbitraryArgs
			c.RunE = func(cmd *cobra.Command, args []string) error {
				if len(args) == 0 {
					return cmd.Help()
				}
				return Errorf("unknown command %q for %q%s; see %s --help", args[0], cmd.CommandPath(), DidYouMean(cmd, args[0]), cmd.CommandPath())
			}
		case c.Args != nil:
			check := c.Args
			c.Args = func(cmd *cobra.Command, args []string) error {
				err := check(cmd, args)
				if err == nil || Is(err) {
					return err
				}
				return Errorf("%v; see %s --help", err, cmd.CommandPath())
			}
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
	guardHelpTopics(root)
}

// DidYouMean names the subcommands of parent close to name, or its flag of that name ("broker
// version": --version), as " (did you mean x?)", or is "".
func DidYouMean(parent *cobra.Command, name string) string {
	parent.SuggestionsMinimumDistance = parent.Root().SuggestionsMinimumDistance
	s := parent.SuggestionsFor(name)
	if f := parent.Flags().Lookup(name); f != nil && name != "help" {
		s = append(s, "--"+f.Name)
	}
	if len(s) > 0 {
		return " (did you mean " + strings.Join(s, " or ") + "?)"
	}
	return ""
}

// guardHelpTopics makes "help TOPIC" a usage error when TOPIC is no command: cobra's own help
// command shows the root's help for it and exits 0.
func guardHelpTopics(root *cobra.Command) {
	root.InitDefaultHelpCmd()
	help, _, err := root.Find([]string{"help"})
	if err != nil || help == root {
		return
	}
	show := help.Run
	help.Run = nil
	help.RunE = func(c *cobra.Command, args []string) error {
		if _, rest, err := root.Find(args); err != nil || len(rest) > 0 {
			topic := strings.Join(args, " ")
			return Errorf("unknown help topic %q%s; see %s --help", topic, DidYouMean(root, args[0]), root.Name())
		}
		show(c, args)
		return nil
	}
}

// flagError makes cobra's flag errors usage errors that point at the command's help, with the
// flag the person probably meant when one is close to what they typed.
func flagError(cmd *cobra.Command, err error) error {
	msg := err.Error()
	if typed, ok := strings.CutPrefix(msg, "unknown flag: --"); ok {
		if near := nearestFlag(cmd, typed); near != "" {
			msg += " (did you mean --" + near + "?)"
		}
	}
	return Errorf("%s; see %s --help", msg, cmd.CommandPath())
}

// nearestFlag is the name of cmd's flag within two edits of typed, or "".
func nearestFlag(cmd *cobra.Command, typed string) string {
	best, bestDist := "", 3
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if d := editDistance(typed, f.Name); d < bestDist {
			best, bestDist = f.Name, d
		}
	})
	return best
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}
