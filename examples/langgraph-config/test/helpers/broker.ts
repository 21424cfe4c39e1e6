// A real broker for the tests: built from this repository, started as a child process on a free
// port with a temporary data dir and HOME (where it writes sbctl's config), stopped with SIGTERM.

import { execFile } from "node:child_process";
import { chmod, mkdir, mkdtemp, readFile, rm } from "node:fs/promises";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import type { SandboxBlock } from "../../src/runconfig.js";
import { startProc, type Proc } from "./procs.js";

const run = promisify(execFile);

/** This package's directory and the repository root. */
export const PKG_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
export const REPO_DIR = resolve(PKG_DIR, "../..");
const BIN_DIR = join(PKG_DIR, ".cache", "bin");

let built: Promise<void> | undefined;

/** Builds bin/broker and bin/sbctl into .cache/bin (incremental: quick when nothing changed). */
export function buildBinaries(): Promise<void> {
  built ??= (async () => {
    await mkdir(BIN_DIR, { recursive: true });
    for (const name of ["broker", "sbctl"]) {
      await run("go", ["build", "-o", join(BIN_DIR, name), `./cmd/${name}`], { cwd: REPO_DIR, maxBuffer: 16 << 20 });
    }
  })();
  return built;
}

/** A port nobody listens on right now. */
export function freePort(): Promise<number> {
  return new Promise((resolvePort, reject) => {
    const srv = createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const addr = srv.address();
      srv.close(() => (typeof addr === "object" && addr ? resolvePort(addr.port) : reject(new Error("no port"))));
    });
  });
}

/** Polls url until it answers 200. */
export async function waitHTTP(url: string, timeoutMs: number, proc?: Proc): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (proc && (proc.child.exitCode !== null || proc.child.signalCode !== null)) {
      throw new Error(`${url}: the process exited (${proc.child.exitCode ?? proc.child.signalCode})\n${proc.tail()}`);
    }
    try {
      const res = await fetch(url, { signal: AbortSignal.timeout(2000) });
      if (res.status === 200) return;
    } catch {
      // not up yet
    }
    if (Date.now() > deadline) throw new Error(`${url} not ready after ${timeoutMs} ms\n${proc?.tail() ?? ""}`);
    await new Promise((r) => setTimeout(r, 150));
  }
}

export interface Sandbox {
  id: string;
  name: string;
}

export interface Broker {
  url: string;
  dir: string;
  home: string;
  dataDir: string;
  apiKey: string;
  proc: Proc;
  /** Runs sbctl against this broker; resolves to its stdout. */
  sbctl(...args: string[]): Promise<string>;
  /** Creates (or reuses) a sandbox by name. */
  create(name: string): Promise<Sandbox>;
  /** The run-config block for a sandbox (sbctl run-config --format block, plus flags). */
  block(ref: string, ...flags: string[]): Promise<SandboxBlock>;
  /** Where a sandbox's files are on the host. */
  workspace(sandboxId: string): string;
  stop(): Promise<void>;
}

/** Starts a broker; stop() ends it and removes its files. */
export async function startBroker(): Promise<Broker> {
  await buildBinaries();
  const dir = await mkdtemp(join(tmpdir(), "sbx-lg-"));
  // Sandboxes run as uid 100000: the data dir and its parents must be searchable by it.
  await chmod(dir, 0o711);
  const home = join(dir, "home");
  const dataDir = join(dir, "data");
  await mkdir(home, { recursive: true, mode: 0o711 });
  await mkdir(dataDir, { recursive: true, mode: 0o711 });
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  const env: NodeJS.ProcessEnv = { ...process.env, HOME: home };
  // Nothing from the caller's sbctl setup may leak in.
  delete env.SBX_BROKER_URL;
  delete env.SBX_API_KEY;
  delete env.SBCTL_CONFIG;
  const proc = startProc(join(BIN_DIR, "broker"), ["--listen", `127.0.0.1:${port}`, "--data-dir", dataDir], join(dir, "broker.log"), { env });
  try {
    await waitHTTP(`${url}/readyz`, 30_000, proc);
  } catch (e) {
    await proc.stop();
    throw e;
  }
  const config = await readFile(join(home, ".config", "sbctl", "config.yaml"), "utf8");
  const apiKey = /^api_key:\s*(\S+)/m.exec(config)?.[1];
  if (!apiKey) throw new Error(`no api_key in sbctl's config:\n${config}`);

  const sbctl = async (...args: string[]) => {
    try {
      const { stdout } = await run(join(BIN_DIR, "sbctl"), args, { env, maxBuffer: 16 << 20 });
      return stdout;
    } catch (e) {
      const err = e as { stderr?: string; message: string };
      throw new Error(`sbctl ${args.join(" ")}: ${err.stderr || err.message}`);
    }
  };
  return {
    url,
    dir,
    home,
    dataDir,
    apiKey,
    proc,
    sbctl,
    async create(name) {
      await sbctl("create", name);
      const rec = JSON.parse(await sbctl("get", name, "-o", "json"));
      return { id: rec.id, name };
    },
    async block(ref, ...flags) {
      return JSON.parse(await sbctl("run-config", ref, "--format", "block", ...flags));
    },
    workspace(sandboxId) {
      return join(dataDir, "sandboxes", sandboxId, "workspace");
    },
    async stop() {
      await proc.stop();
      await unmountUnder(dir);
      await rm(dir, { recursive: true, force: true }).catch(() => undefined);
    },
  };
}

/**
 * Detaches every mount under dir, deepest first: namespace sandboxes' workspaces are mounted disk
 * images that a stopped broker leaves mounted (its next start reuses them), and one left behind
 * would hold its image and a loop device after the test removed the dir.
 */
async function unmountUnder(dir: string): Promise<void> {
  const info = await readFile("/proc/self/mountinfo", "utf8").catch(() => "");
  const points = info
    .split("\n")
    .map((line) => line.split(" ")[4])
    .filter((p): p is string => p !== undefined && p.startsWith(dir + "/"));
  for (const p of points.reverse()) {
    await run("umount", ["-l", p]).catch(() => undefined);
  }
}
