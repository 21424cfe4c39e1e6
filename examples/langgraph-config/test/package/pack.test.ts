// The package as a user gets it: `npm pack` builds a tarball of JavaScript and type declarations,
// which installs into a scratch project (the tarball, plus the npm registry for its dependencies)
// and works from plain Node, from a TypeScript project, and in a graph served by `langgraph dev`.
// It runs as npm run test:package (the end of npm test), in its own file with its own timeout:
// installing the scratch project takes minutes.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { promisify } from "node:util";
import { PKG_DIR, freePort, startBroker, waitHTTP, type Broker } from "../helpers/broker.js";
import { startProc, type Proc } from "../helpers/procs.js";

const run = promisify(execFile);

let broker: Broker;
let scratch: string;
let files: string[];
let dev: Proc | undefined;

/** Runs a command; on failure the error carries its output. */
async function sh(cmd: string, args: string[], cwd: string, env: NodeJS.ProcessEnv = process.env): Promise<string> {
  try {
    const { stdout } = await run(cmd, args, { cwd, env, maxBuffer: 64 << 20 });
    return stdout;
  } catch (e) {
    const err = e as { stdout?: string; stderr?: string; message: string };
    throw new Error(`${cmd} ${args.join(" ")}: ${err.message}\n${err.stdout ?? ""}\n${err.stderr ?? ""}`);
  }
}

before(async () => {
  broker = await startBroker();
  const packed = JSON.parse(await sh("npm", ["pack", "--json", "--pack-destination", broker.dir], PKG_DIR)) as Array<{
    filename: string;
    files: Array<{ path: string }>;
  }>;
  files = packed[0]!.files.map((f) => f.path);
  const devDeps = JSON.parse(await readFile(join(PKG_DIR, "package.json"), "utf8")).devDependencies as Record<string, string>;
  scratch = join(broker.dir, "scratch");
  await mkdir(scratch);
  await writeFile(join(scratch, "package.json"), JSON.stringify({ name: "scratch", private: true, type: "module" }));
  // The peer dependencies (deepagents, @langchain/*) come with it: npm installs peers.
  await sh(
    "npm",
    ["install", "--no-audit", "--no-fund", "--prefer-offline", join(broker.dir, packed[0]!.filename), `@langchain/langgraph-cli@${devDeps["@langchain/langgraph-cli"]}`],
    scratch,
  );
}, { timeout: 900_000 });

after(async () => {
  await dev?.stop(10_000);
  await broker?.stop();
});

describe("the npm package", { timeout: 900_000 }, () => {
  it("holds JavaScript and type declarations, not TypeScript sources or tests", () => {
    for (const f of ["package.json", "README.md", "dist/index.js", "dist/index.d.ts", "dist/backend.js", "dist/graph.js"]) {
      assert.ok(files.includes(f), `${f} is not in the tarball: ${files.join(", ")}`);
    }
    const stray = files.filter((f) => (f.endsWith(".ts") && !f.endsWith(".d.ts")) || f.startsWith("test/") || f.startsWith("src/"));
    assert.deepEqual(stray, []);
  });

  it("works from plain Node", async () => {
    await broker.create("pkg-node");
    const block = await broker.block("pkg-node", "--expires", "10m");
    await writeFile(
      join(scratch, "smoke.mjs"),
      `import { BrokerSandbox, sandboxBlockOf } from "@sbxbroker/langgraph-config";
const sb = BrokerSandbox.fromBlock(sandboxBlockOf({ sandbox: JSON.parse(process.env.BLOCK) }));
const w = await sb.write("/from-node.txt", "hello from plain node\\n");
const x = await sb.execute("cat from-node.txt");
sb.close();
console.log(JSON.stringify({ w, x }));
`,
    );
    const out = JSON.parse(await sh("node", ["smoke.mjs"], scratch, { ...process.env, BLOCK: JSON.stringify(block) }));
    assert.equal(out.w.error, undefined);
    assert.deepEqual(out.x, { output: "hello from plain node\n", exitCode: 0, truncated: false });
    assert.equal(await readFile(join(broker.workspace(block.sandbox_id), "from-node.txt"), "utf8"), "hello from plain node\n");
  });

  it("type-checks in a TypeScript project, with real types (not any)", async () => {
    await writeFile(
      join(scratch, "consumer.ts"),
      `import { createDeepAgent, type ExecuteResponse } from "deepagents";
import { BrokerSandbox, RunConfigSandbox, type SandboxBlock } from "@sbxbroker/langgraph-config";
import { graph } from "@sbxbroker/langgraph-config/graph";
declare const block: SandboxBlock;
const sb = BrokerSandbox.fromBlock(block);
export const r: Promise<ExecuteResponse> = sb.execute("true");
// @ts-expect-error execute takes a command string
sb.execute(1);
// @ts-expect-error a block has no such key
export const bad: SandboxBlock = { sandbox_id: "s", credential: "c", dataplane_url: "ws://h", nope: 1 };
export const agent = createDeepAgent({ backend: new RunConfigSandbox() });
export const g = graph;
`,
    );
    await writeFile(
      join(scratch, "tsconfig.json"),
      JSON.stringify({
        compilerOptions: { target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", strict: true, noEmit: true, skipLibCheck: true, types: [] },
        files: ["consumer.ts"],
      }),
    );
    await sh("node", [join(PKG_DIR, "node_modules", "typescript", "bin", "tsc"), "-p", "tsconfig.json"], scratch);
  });

  it("serves a graph under langgraph dev", async () => {
    await writeFile(
      join(scratch, "graph.mjs"),
      `import { createDeepAgent } from "deepagents";
import { RunConfigSandbox, ScriptedChatModel } from "@sbxbroker/langgraph-config";
export const graph = createDeepAgent({ model: new ScriptedChatModel(), backend: new RunConfigSandbox() });
`,
    );
    await writeFile(join(scratch, "langgraph.json"), JSON.stringify({ node_version: "20", graphs: { agent: "./graph.mjs:graph" }, env: {} }));
    const port = await freePort();
    const api = `http://127.0.0.1:${port}`;
    const env: NodeJS.ProcessEnv = { ...process.env, LANGGRAPH_CLI_NO_ANALYTICS: "1", BROWSER: "none", LANGSMITH_TRACING: "false", LANGCHAIN_TRACING_V2: "false" };
    delete env.SBX_AGENT_MODEL;
    dev = startProc(
      join(scratch, "node_modules", ".bin", "langgraphjs"),
      ["dev", "--no-browser", "--no-reload", "--host", "127.0.0.1", "--port", String(port), "--config", join(scratch, "langgraph.json")],
      join(broker.dir, "scratch-langgraph-dev.log"),
      { cwd: scratch, env },
    );
    await waitHTTP(`${api}/ok`, 120_000, dev);
    await broker.create("pkg-dev");
    const block = await broker.block("pkg-dev", "--expires", "10m");
    const script = { steps: [[{ name: "write_file", args: { file_path: "/dev.txt", content: "from langgraph dev\n" } }], [{ name: "execute", args: { command: "cat dev.txt" } }]] };
    const res = await fetch(`${api}/runs/wait`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ assistant_id: "agent", input: { messages: [{ role: "user", content: JSON.stringify(script) }] }, config: { configurable: { sandbox: block } } }),
    });
    const body = await res.text();
    assert.equal(res.status, 200, `${body}\n${dev.tail()}`);
    const tools = (JSON.parse(body).messages as Array<{ type: string; name?: string; content: unknown }>).filter((m) => m.type === "tool").map((m) => `${m.name}: ${m.content}`);
    assert.equal(tools.at(-1), "execute: from langgraph dev\n\n[Command succeeded with exit code 0]");
    assert.equal(await readFile(join(broker.workspace(block.sandbox_id), "dev.txt"), "utf8"), "from langgraph dev\n");
  });
});
