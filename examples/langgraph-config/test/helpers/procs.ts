// Child processes the tests start (broker, langgraph dev), each in its own process group, so that
// stopping one ends everything it started (redis-server, the dev server's worker) and nothing
// outlives the test process, whatever way it ends.

import { spawn, type ChildProcess, type SpawnOptions } from "node:child_process";
import { createWriteStream, readFileSync } from "node:fs";

export interface Proc {
  child: ChildProcess;
  pid: number;
  logPath: string;
  exited: Promise<number | null>;
  /** The log's last lines (for failure messages). */
  tail(lines?: number): string;
  /** SIGTERM to the process, wait (up to graceMs), then SIGKILL whatever is left of its group. */
  stop(graceMs?: number): Promise<void>;
}

const live = new Set<Proc>();

function killGroup(pid: number, signal: NodeJS.Signals): void {
  try {
    process.kill(-pid, signal);
  } catch {
    // the group is gone
  }
}

// Last resort: the test process is exiting (an uncaught error, a signal, a timeout).
process.on("exit", () => {
  for (const p of live) killGroup(p.pid, "SIGKILL");
});
for (const sig of ["SIGINT", "SIGTERM", "SIGHUP"] as const) {
  process.once(sig, () => {
    for (const p of live) killGroup(p.pid, "SIGKILL");
    process.exit(130);
  });
}

/** Starts cmd in a new process group with its output in logPath. */
export function startProc(cmd: string, args: string[], logPath: string, opts: SpawnOptions = {}): Proc {
  const log = createWriteStream(logPath);
  const child = spawn(cmd, args, { ...opts, detached: true, stdio: ["ignore", "pipe", "pipe"] });
  child.stdout?.pipe(log, { end: false });
  child.stderr?.pipe(log, { end: false });
  if (child.pid === undefined) throw new Error(`could not start ${cmd}`);
  const pid = child.pid;
  const exited = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)));
  const p: Proc = {
    child,
    pid,
    logPath,
    exited,
    tail(lines = 40) {
      try {
        return readFileSync(logPath, "utf8").split("\n").slice(-lines).join("\n");
      } catch {
        return "";
      }
    },
    async stop(graceMs = 15_000) {
      if (child.exitCode === null && child.signalCode === null) {
        try {
          process.kill(pid, "SIGTERM");
        } catch {
          // already gone
        }
        const timer = new Promise<"timeout">((r) => setTimeout(() => r("timeout"), graceMs).unref());
        await Promise.race([exited, timer]);
      }
      killGroup(pid, "SIGKILL"); // leftovers of the group (children that did not exit with it)
      await exited;
      live.delete(p);
      log.end();
    },
  };
  live.add(p);
  child.once("exit", () => {
    // Reap the rest of the group when the leader dies on its own.
    killGroup(pid, "SIGKILL");
  });
  return p;
}
