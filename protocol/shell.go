package protocol

// The shell operation: an interactive program on a terminal inside the sandbox (docs/dataplane.md,
// "shell"). Keystrokes go to it as binary frames of kind FrameData with the shell's request id (a
// frame of kind FrameEnd closes its input), what it writes to the terminal comes back as frames of
// kind FrameStdout (a FrameEnd types the terminal's end-of-file character), a resize request changes the window, and the answer (an ExecResult) comes when
// the program exits.
const (
	OpShell = "shell"
	// OpResize changes a shell's window: {"id": <the shell's id>, "op": "resize", "args":
	// {"rows": R, "cols": C}}. Like cancel it is never answered; a bad one is answered with id 0.
	OpResize = "resize"
)

// ShellMaxWindow bounds a terminal's rows and columns: a window larger than this is not a screen.
const ShellMaxWindow = 2000

// ShellArgs starts a shell. Argv is the program; empty means the sandbox user's login shell
// (bash, or /bin/sh where the sandbox has no bash).
type ShellArgs struct {
	Argv []string          `json:"argv,omitempty"`
	Cwd  string            `json:"cwd,omitempty"`
	Env  map[string]string `json:"env,omitempty"`
	// Term is the terminal type the program sees as TERM (default xterm-256color).
	Term string `json:"term,omitempty"`
	// Rows and Cols are the window at the start (both 0: 24 x 80).
	Rows int `json:"rows,omitempty"`
	Cols int `json:"cols,omitempty"`
}

// ResizeArgs is a shell's new window.
type ResizeArgs struct {
	Rows int `json:"rows"`
	Cols int `json:"cols"`
}

// ValidateWindow checks a window size: 1 to ShellMaxWindow rows and columns.
func ValidateWindow(rows, cols int) error {
	if rows < 1 || cols < 1 || rows > ShellMaxWindow || cols > ShellMaxWindow {
		return Errorf(CodeInvalidArgument, "a window of %d rows by %d columns: rows and cols must be 1 to %d", rows, cols, ShellMaxWindow)
	}
	return nil
}

// ValidateShell checks the parts of a shell request that do not depend on where it runs.
func ValidateShell(a ShellArgs) error {
	if a.Rows != 0 || a.Cols != 0 {
		if err := ValidateWindow(a.Rows, a.Cols); err != nil {
			return err
		}
	}
	if len(a.Term) > 64 {
		return Errorf(CodeInvalidArgument, "term is at most 64 characters")
	}
	for i := 0; i < len(a.Term); i++ {
		c := a.Term[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == '+') {
			return Errorf(CodeInvalidArgument, "term %q: a terminal type is letters, digits and - _ . +", a.Term)
		}
	}
	return nil
}

// Events of a shell (beside exec's): Command when it starts, then ExitCode, DurationMS and Reason
// when it ends, with the JTI of the token that ran it.
const (
	EventShellStarted = "shell_started"
	EventShellEnded   = "shell_ended"
)
