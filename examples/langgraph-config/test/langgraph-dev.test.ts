// The example graph deployed with `langgraph dev` (langgraph.json, src/graph.ts): HTTP runs with
// different run-config blocks reach different sandboxes through one deployed graph.

import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join, relative, resolve } from "node:path";
import { after, before, describe, it } from "node:test";
import { Client } from "@langchain/langgraph-sdk";
import type { SandboxBlock } from "../src/runconfig.js";
import { PKG_DIR, freePort, startBroker, waitHTTP, type Broker, type Sandbox } from "./helpers/broker.js";
import { startProc, type Proc } from "./helpers/procs.js";

let broker: Broker;
let dev: Proc;
let api: string;

interface Message {
  type: string;
  content: unknown;
  name?: string;
}

async function post(path: string, body: unknown): Promise<any> {
  const res = await fetch(`${api}${path}`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  const text = await res.text();
  assert.equal(res.status, 200, `${path}: ${res.status} ${text}\n${dev.tail()}`);
  return JSON.parse(text);
}

/**
 * One run as a client sends it: the scripted model's tool calls as the message (one round, or
 * several rounds in order when given arrays), the block as config.
 */
async function runWait(threadId: string, calls: unknown[], sandbox?: SandboxBlock): Promise<Message[]> {
  const script = calls.every(Array.isArray) ? { steps: calls } : { tool_calls: calls };
  const body: Record<string, unknown> = {
    assistant_id: "agent",
    input: { messages: [{ role: "user", content: JSON.stringify(script) }] },
  };
  if (sandbox) body.config = { configurable: { sandbox } };
  const out = await post(`/threads/${threadId}/runs/wait`, body);
  return out.messages as Message[];
}

const text = (c: unknown): string =>
  Array.isArray(c) ? c.map((p) => (typeof p === "object" && p && "text" in p ? String(p.text) : "")).join("") : String(c);
const tools = (msgs: Message[]) => msgs.filter((m) => m.type === "tool").map((m) => `${m.name}: ${text(m.content)}`);
/** The answer of the last tool call (a thread's messages include its earlier runs'). */
const lastTool = (msgs: Message[]) => tools(msgs).at(-1) ?? "";

describe("langgraph dev serving the example graph", { timeout: 150_000 }, () => {
  let a: Sandbox;
  let b: Sandbox;

  before(async () => {
    broker = await startBroker();
    b = await broker.create("dev-b");
    // The committed langgraph.json, moved to a scratch dir so that the dev server's state
    // (.langgraph_api) stays out of the package; its graph path is made relative to it.
    const scratch = join(broker.dir, "langgraph");
    await mkdir(scratch);
    const config = JSON.parse(await readFile(join(PKG_DIR, "langgraph.json"), "utf8"));
    for (const [id, spec] of Object.entries(config.graphs as Record<string, string>)) {
      const [file, exportName] = spec.split(":");
      config.graphs[id] = `${relative(scratch, resolve(PKG_DIR, file!))}:${exportName}`;
    }
    await writeFile(join(scratch, "langgraph.json"), JSON.stringify(config));
    const port = await freePort();
    api = `http://127.0.0.1:${port}`;
    const env: NodeJS.ProcessEnv = {
      ...process.env,
      LANGGRAPH_CLI_NO_ANALYTICS: "1",
      BROWSER: "none",
      LANGSMITH_TRACING: "false",
      LANGCHAIN_TRACING_V2: "false",
    };
    delete env.SBX_AGENT_MODEL; // the scripted model: no API key, no network
    dev = startProc(
      join(PKG_DIR, "node_modules", ".bin", "langgraphjs"),
      ["dev", "--no-browser", "--no-reload", "--host", "127.0.0.1", "--port", String(port), "--config", join(scratch, "langgraph.json")],
      join(broker.dir, "langgraph-dev.log"),
      { cwd: scratch, env },
    );
    await waitHTTP(`${api}/ok`, 120_000, dev);
  });

  after(async () => {
    await dev?.stop(10_000);
    await broker?.stop();
  });

  it("two runs with two blocks reach two sandboxes through one deployed graph", async () => {
    const [ta, tb] = await Promise.all([post("/threads", {}), post("/threads", {})]);
    // As the README does: thread A's own sandbox (sbctl run-config --thread), and the named dev-b.
    const blockA = JSON.parse(await broker.sbctl("run-config", "--thread", ta.thread_id, "--format", "block", "--expires", "10m"));
    const blockB = await broker.block("dev-b");
    const threadSandbox = JSON.parse(await broker.sbctl("get", `thread-${ta.thread_id}`, "-o", "json"));
    assert.equal(threadSandbox.id, blockA.sandbox_id);
    assert.equal(threadSandbox.tags.thread_id, ta.thread_id);
    a = { id: blockA.sandbox_id, name: threadSandbox.name };
    const script = (who: string) => [
      [{ name: "write_file", args: { file_path: "/workspace/owner.txt", content: `${who}\n` } }],
      [{ name: "execute", args: { command: `echo ${who} ran here > ran.txt; cat owner.txt` } }],
    ];
    // Concurrently: the backend routes each tool call by its own run's block. Thread A's run goes
    // as plain HTTP (curl in the README), thread B's through the LangGraph SDK.
    const sdk = new Client({ apiUrl: api });
    const [ma, mb] = await Promise.all([
      runWait(ta.thread_id, script("alice"), blockA),
      sdk.runs
        .wait(tb.thread_id, "agent", {
          input: { messages: [{ role: "user", content: JSON.stringify({ steps: script("bob") }) }] },
          config: { configurable: { sandbox: blockB } },
        })
        .then((v) => (v as { messages: Message[] }).messages),
    ]);
    assert.deepEqual(tools(ma), ["write_file: Successfully wrote to '/workspace/owner.txt'", "execute: alice\n\n[Command succeeded with exit code 0]"]);
    assert.deepEqual(tools(mb), ["write_file: Successfully wrote to '/workspace/owner.txt'", "execute: bob\n\n[Command succeeded with exit code 0]"]);
    assert.equal(await readFile(join(broker.workspace(a.id), "owner.txt"), "utf8"), "alice\n");
    assert.equal(await readFile(join(broker.workspace(a.id), "ran.txt"), "utf8"), "alice ran here\n");
    assert.equal(await readFile(join(broker.workspace(b.id), "owner.txt"), "utf8"), "bob\n");
    assert.equal(await readFile(join(broker.workspace(b.id), "ran.txt"), "utf8"), "bob ran here\n");

    // A later run on thread A with a fresh block for sandbox B goes to B: the block of each run wins.
    const again = await runWait(ta.thread_id, [{ name: "read_file", args: { file_path: "/workspace/owner.txt" } }], await broker.block("dev-b"));
    assert.match(lastTool(again), /\nbob$/);
  });

  it("a run without a block inherits the thread's stored one (why blocks must be short-lived)", async () => {
    const t = await post("/threads", {});
    await runWait(t.thread_id, [{ name: "ls", args: {} }], await broker.block(a.name, "--expires", "5m"));
    const inherited = await runWait(t.thread_id, [{ name: "read_file", args: { file_path: "/workspace/owner.txt" } }]);
    assert.match(lastTool(inherited), /\nalice$/);
    // Revoking the owner's tokens ends that: the stored credential no longer works.
    await broker.sbctl("revoke", a.name, "--all");
    // Revocation reaches open connections within a second.
    let answer = "";
    for (let i = 0; i < 20 && !answer.includes("Not allowed"); i++) {
      if (i > 0) await new Promise((r) => setTimeout(r, 250));
      answer = lastTool(await runWait(t.thread_id, [{ name: "read_file", args: { file_path: "/workspace/owner.txt" } }]));
    }
    assert.match(answer, /Not allowed: the sandbox's owner revoked this credential/);
    assert.equal(existsSync(join(broker.workspace(a.id), "owner.txt")), true);
  });

  it("a run without any block gets tool errors that say what to send", async () => {
    const t = await post("/threads", {});
    const msgs = await runWait(t.thread_id, [{ name: "execute", args: { command: "true" } }]);
    assert.match(lastTool(msgs), /no sandbox block \(configurable\.sandbox\); send one with every run \(sbctl run-config\)/);
  });
});
