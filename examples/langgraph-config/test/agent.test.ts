// Scripted deepagents runs (fakeModel: no network, no API key) whose tools work in the sandbox their
// run config names, against a real broker: checked on disk, through sbctl and the events stream.

import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { readFile } from "node:fs/promises";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { AIMessage, HumanMessage, ToolMessage, type BaseMessage } from "@langchain/core/messages";
import { fakeModel } from "@langchain/core/testing";
import { getConfig } from "@langchain/langgraph";
import { createDeepAgent } from "deepagents";
import { BrokerSandbox } from "../src/backend.js";
import { RunConfigSandbox, SandboxPool } from "../src/routing.js";
import { sandboxBlockOf, type SandboxBlock } from "../src/runconfig.js";
import { startBroker, type Broker, type Sandbox } from "./helpers/broker.js";
import { followEvents, type SandboxEvent } from "./helpers/events.js";

type Call = { name: string; args: Record<string, unknown>; id?: string };

let broker: Broker;
let pool: SandboxPool;

/** A fake model that makes these rounds of tool calls, then answers "done". */
function scripted(...rounds: Call[][]) {
  const model = fakeModel();
  let n = 0;
  for (const round of rounds) {
    model.respond(new AIMessage({ content: "", tool_calls: round.map((c) => ({ ...c, id: c.id ?? `call_${++n}`, type: "tool_call" as const })) }));
  }
  return model.respond(new AIMessage("done"));
}

/** Runs a deepagents agent on our backend with this run config; returns the messages. */
async function runAgent(model: ReturnType<typeof fakeModel>, configurable: Record<string, unknown>): Promise<BaseMessage[]> {
  const agent = createDeepAgent({ model, backend: new RunConfigSandbox({ pool }) });
  const res = await agent.invoke({ messages: [new HumanMessage("go")] }, { configurable });
  return res.messages as BaseMessage[];
}

/** The text of the ToolMessage answering tool call id. */
function toolText(messages: BaseMessage[], id: string): string {
  const m = messages.find((x) => ToolMessage.isInstance(x) && x.tool_call_id === id) as ToolMessage | undefined;
  assert.ok(m, `no ToolMessage for ${id}`);
  return typeof m.content === "string" ? m.content : m.content.map((c) => ("text" in c ? c.text : "")).join("");
}

function finalText(messages: BaseMessage[]): string {
  const last = messages.at(-1)!;
  assert.equal(last.getType(), "ai", "the run did not end with the model's answer");
  return String(last.content);
}

before(async () => {
  broker = await startBroker();
  pool = new SandboxPool();
});
after(async () => {
  pool?.close();
  await broker?.stop();
});

describe("deepagents runs through the dataplane", { timeout: 150_000 }, () => {
  let a: Sandbox;
  let b: Sandbox;
  let blockA: SandboxBlock;
  let blockB: SandboxBlock;

  before(async () => {
    a = await broker.create("agent-a");
    b = await broker.create("agent-b");
    blockA = await broker.block("agent-a", "--expires", "10m");
    blockB = await broker.block("agent-b", "--expires", "10m");
  });

  it("lands every tool call in the sandbox the run config names", async (t) => {
    const events = await followEvents(broker.url, broker.apiKey, a.id);
    const program = ["def main():", "    # TODO: greet", "    print('hello')", "", "main()", "# end"].join("\n") + "\n";
    const model = scripted(
      [
        { id: "w1", name: "write_file", args: { file_path: "/workspace/app/main.py", content: program } },
        { id: "w2", name: "write_file", args: { file_path: "/notes/todo.md", content: "- TODO: ship\n" } },
      ],
      [{ id: "r1", name: "read_file", args: { file_path: "/workspace/app/main.py", offset: 1, limit: 2 } }],
      [{ id: "e1", name: "edit_file", args: { file_path: "/workspace/app/main.py", old_string: "print('hello')", new_string: "print('hello, sandbox')" } }],
      [
        // Parallel calls: deepagents runs them at once on the one backend.
        { id: "l1", name: "ls", args: { path: "/workspace" } },
        { id: "g1", name: "glob", args: { pattern: "**/*.md" } },
        { id: "s1", name: "grep", args: { pattern: "TODO", path: "/workspace" } },
        { id: "s2", name: "grep", args: { pattern: "print(", glob: "*.py" } }, // literal, not a regex
      ],
      [
        { id: "x1", name: "execute", args: { command: "python3 app/main.py 2>/dev/null || sed -n 3p app/main.py" } },
        { id: "x2", name: "execute", args: { command: "echo about to fail; ls /nonexistent; exit 3" } },
      ],
      [{ id: "d1", name: "delete", args: { file_path: "/workspace/notes" } }],
    );
    const messages = await runAgent(model, { sandbox: blockA, thread_id: "t-1" });

    // What the model read.
    assert.equal(toolText(messages, "w1"), "Successfully wrote to '/workspace/app/main.py'");
    assert.equal(toolText(messages, "r1"), "@@ lines 2-3 of 6 | next offset 3 @@\n    # TODO: greet\n    print('hello')");
    assert.equal(toolText(messages, "e1"), "Successfully replaced 1 occurrence(s) in '/workspace/app/main.py'");
    assert.equal(toolText(messages, "l1"), "/workspace/app/ (directory)\n/workspace/notes/ (directory)");
    assert.equal(toolText(messages, "g1"), "/notes/todo.md"); // no path given: the agent's view
    assert.equal(toolText(messages, "s1"), "/workspace/app/main.py:\n  2:     # TODO: greet\n/workspace/notes/todo.md:\n  1: - TODO: ship");
    assert.equal(toolText(messages, "s2"), "/app/main.py:\n  3:     print('hello, sandbox')");
    assert.match(toolText(messages, "x1"), /hello, sandbox/);
    assert.match(toolText(messages, "x1"), /\[Command succeeded with exit code 0\]/);
    const failed = toolText(messages, "x2");
    assert.match(failed, /about to fail/);
    assert.match(failed, /nonexistent/); // stderr is in the output
    assert.match(failed, /\[Command failed with exit code 3\]/);
    assert.equal(toolText(messages, "d1"), "Deleted /workspace/notes");
    assert.equal(finalText(messages), "done"); // the failing command did not abort the run

    // What happened in the sandbox.
    const ws = broker.workspace(a.id);
    assert.equal(await readFile(join(ws, "app", "main.py"), "utf8"), program.replace("print('hello')", "print('hello, sandbox')"));
    assert.equal(existsSync(join(ws, "notes")), false);
    assert.equal(existsSync(join(broker.workspace(b.id), "app")), false, "nothing landed in the other sandbox");
    assert.equal(JSON.parse(await broker.sbctl("get", "agent-a", "-o", "json")).status, "running");

    // And in its event stream.
    if (!events.available) {
      t.diagnostic(`events stream not checked: ${events.reason}`);
      t.skip(`events stream not available: ${events.reason}`);
      return;
    }
    const complete = (ev: SandboxEvent[]) => {
      const has = (pred: (e: SandboxEvent) => boolean) => ev.some(pred);
      return (
        has((e) => e.type === "connected") &&
        has((e) => e.type === "file_written" && e.path === "/workspace/app/main.py") &&
        has((e) => e.type === "file_written" && e.path === "/workspace/notes/todo.md") &&
        has((e) => e.type === "exec" && e.exit_code === 3 && String(e.command).includes("exit 3")) &&
        has((e) => e.type === "exec" && e.exit_code === 0) &&
        has((e) => e.type === "file_deleted" && e.path === "/workspace/notes")
      );
    };
    try {
      const seen = await events.waitFor(complete);
      assert.ok(seen.every((e) => e.sandbox_id === a.id));
    } finally {
      events.close();
    }
    // The same through sbctl events -o json (one JSON object per line).
    const lines = (await broker.sbctl("events", "agent-a", "-o", "json", "--backlog", "500")).trim().split("\n");
    const logged = lines.map((l) => JSON.parse(l) as SandboxEvent);
    assert.ok(complete(logged), `sbctl events: ${lines.join("\n")}`);
    assert.ok(logged.every((e) => e.sandbox_id === a.id));
  });

  it("lands a run with another block in the other sandbox, on the same graph", async () => {
    const agent = createDeepAgent({
      model: scripted(
        [{ id: "w", name: "write_file", args: { file_path: "/workspace/which.txt", content: "B\n" } }],
        [{ id: "x", name: "execute", args: { command: "cat which.txt" } }],
      ),
      backend: new RunConfigSandbox({ pool }),
    });
    const res = await agent.invoke({ messages: [new HumanMessage("go")] }, { configurable: { sandbox: blockB } });
    assert.match(toolText(res.messages, "x"), /^B\n/);
    assert.equal(await readFile(join(broker.workspace(b.id), "which.txt"), "utf8"), "B\n");
    assert.equal(existsSync(join(broker.workspace(a.id), "which.txt")), false);
  });

  it("runs a subagent (task) in the same sandbox as its parent", async () => {
    const model = scripted(
      [{ id: "t1", name: "task", args: { description: "write sub.txt", subagent_type: "general-purpose" } }],
      // The subagent's own turns (same model, so the same queue):
      [{ id: "sw", name: "write_file", args: { file_path: "/workspace/sub.txt", content: "from the subagent\n" } }],
      [{ id: "sx", name: "execute", args: { command: "echo sub-exec > sub-exec.txt" } }],
    );
    // scripted() ends with "done": that is the subagent's answer; the parent needs one more.
    model.respond(new AIMessage("parent done"));
    const messages = await runAgent(model, { sandbox: blockB });
    assert.match(toolText(messages, "t1"), /done/);
    assert.equal(finalText(messages), "parent done");
    assert.equal(await readFile(join(broker.workspace(b.id), "sub.txt"), "utf8"), "from the subagent\n");
    assert.equal(await readFile(join(broker.workspace(b.id), "sub-exec.txt"), "utf8"), "sub-exec\n");
    assert.equal(existsSync(join(broker.workspace(a.id), "sub.txt")), false);
  });

  it("cancels a running command in the sandbox when the run is aborted", async () => {
    const agent = createDeepAgent({
      model: scripted([{ id: "s", name: "execute", args: { command: "sleep 30; echo finished > finished.txt" } }]),
      backend: new RunConfigSandbox({ pool }),
    });
    const ac = new AbortController();
    const run = agent.invoke({ messages: [new HumanMessage("go")] }, { configurable: { sandbox: blockB }, signal: ac.signal });
    // Abort once the command runs (its exec request is in flight on the pooled connection).
    const client = pool.get(blockB).client;
    const deadline = Date.now() + 10_000;
    while (client.inflight === 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    const started = Date.now();
    ac.abort();
    await assert.rejects(run, /abort/i);
    // The broker got the cancel: the command's process tree is gone long before its 30 s.
    const sleeping = () => client.exec({ command: "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 30' || true", combined: true });
    let count = "1";
    while (count !== "0" && Date.now() - started < 10_000) {
      count = ((await sleeping()).output ?? "").trim();
      if (count !== "0") await new Promise((r) => setTimeout(r, 100));
    }
    assert.equal(count, "0", "sleep 30 still runs in the sandbox");
    assert.ok(Date.now() - started < 10_000);
    assert.equal(existsSync(join(broker.workspace(b.id), "finished.txt")), false);
    // No events check here: the broker emits no exec event for a cancelled command (see the report).
  });

  it("shows the model the execute tool, and one connection serves a run's parallel calls", async () => {
    const seenTools: string[][] = [];
    const model = scripted(
      Array.from({ length: 8 }, (_, i) => ({ id: `p${i}`, name: "read_file", args: { file_path: "/workspace/which.txt" } })),
    );
    const bind = model.bindTools.bind(model);
    model.bindTools = (tools) => {
      seenTools.push(tools.map((t) => ("name" in t ? String(t.name) : "")));
      return bind(tools);
    };
    const before = pool.size;
    const messages = await runAgent(model, { sandbox: blockB });
    for (let i = 0; i < 8; i++) assert.match(toolText(messages, `p${i}`), /\nB$/);
    assert.ok(seenTools.length > 0);
    for (const name of ["ls", "read_file", "write_file", "edit_file", "delete", "glob", "grep", "execute", "task"]) {
      assert.ok(seenTools[0]!.includes(name), `the model was not offered ${name}: ${seenTools[0]}`);
    }
    assert.equal(pool.size, before, "the block's pooled connection was reused");
  });
});

describe("answers in the agent's paths", { timeout: 120_000 }, () => {
  it("a run that names files from / reads / back, never /workspace", async () => {
    const sb = await broker.create("paths");
    const block = await broker.block("paths", "--expires", "10m");
    const messages = await runAgent(
      scripted(
        [{ id: "w", name: "write_file", args: { file_path: "/src/a.py", content: "x = 1\n" } }],
        [
          { id: "l", name: "ls", args: { path: "/" } },
          { id: "l2", name: "ls", args: { path: "/src" } },
          { id: "g", name: "glob", args: { pattern: "**/*.py" } },
          { id: "s", name: "grep", args: { pattern: "x =" } },
          { id: "r", name: "read_file", args: { file_path: "/missing.py" } },
          { id: "e", name: "edit_file", args: { file_path: "/missing.py", old_string: "a", new_string: "b" } },
        ],
        [{ id: "d", name: "delete", args: { file_path: "/src" } }],
      ),
      { sandbox: block },
    );
    assert.equal(toolText(messages, "w"), "Successfully wrote to '/src/a.py'");
    assert.equal(toolText(messages, "l"), "/src/ (directory)");
    assert.equal(toolText(messages, "l2"), "/src/a.py (6 bytes)");
    assert.equal(toolText(messages, "g"), "/src/a.py");
    assert.equal(toolText(messages, "s"), "/src/a.py:\n  1: x = 1");
    for (const id of ["r", "e"]) {
      assert.match(toolText(messages, id), /\/missing\.py/, id);
      assert.doesNotMatch(toolText(messages, id), /\/workspace/, id);
    }
    assert.equal(toolText(messages, "d"), "Deleted /src");
    assert.equal(existsSync(join(broker.workspace(sb.id), "src")), false);
  });
});

describe("the factory wiring", { timeout: 120_000 }, () => {
  it("backend: () => BrokerSandbox.fromBlock(...) keeps one connection per sandbox", async () => {
    const sb = await broker.create("factory");
    const block = await broker.block("factory", "--expires", "10m");
    const events = await followEvents(broker.url, broker.apiKey, sb.id);
    const model = scripted(
      [{ id: "f1", name: "write_file", args: { file_path: "/f.txt", content: "one\n" } }],
      [{ id: "f2", name: "read_file", args: { file_path: "/f.txt" } }],
      [{ id: "f3", name: "ls", args: { path: "/" } }],
      [{ id: "f4", name: "execute", args: { command: "cat f.txt" } }],
      [{ id: "f5", name: "grep", args: { pattern: "one" } }],
      [{ id: "f6", name: "write_file", args: { file_path: "/last.txt", content: "six\n" } }],
    );
    // The wiring deepagents' docs show for a backend per run: a factory called at every tool call.
    const agent = createDeepAgent({ model, backend: () => BrokerSandbox.fromBlock(sandboxBlockOf(getConfig().configurable)) });
    const res = await agent.invoke({ messages: [new HumanMessage("go")] }, { configurable: { sandbox: block } });
    assert.match(toolText(res.messages, "f4"), /^one\n/);
    assert.match(toolText(res.messages, "f6"), /Successfully wrote/);
    try {
      // The last call's file_written comes after every connection's connected event.
      const seen = await events.waitFor((ev) => ev.some((e) => e.type === "file_written" && e.path === "/workspace/last.txt"));
      const connected = seen.filter((e) => e.type === "connected").length;
      assert.equal(connected, 1, `six tool calls opened ${connected} connections`);
    } finally {
      events.close();
    }
    assert.equal(BrokerSandbox.fromBlock(block), BrokerSandbox.fromBlock(block), "one backend per block");
  });
});

describe("refused runs: the model reads why, the run goes on", { timeout: 120_000 }, () => {
  const everyTool = (p: string): Call[] => [
    { id: "w", name: "write_file", args: { file_path: `/workspace/${p}.txt`, content: "x\n" } },
    { id: "r", name: "read_file", args: { file_path: "/workspace/seed.txt" } },
    { id: "x", name: "execute", args: { command: "echo hi" } },
    { id: "l", name: "ls", args: { path: "/workspace" } },
  ];

  it("a revoked token: every tool answers Not allowed", async () => {
    const sb = await broker.create("revoked");
    const block = await broker.block("revoked");
    // This run connects and works...
    const first = await runAgent(scripted([{ id: "w0", name: "write_file", args: { file_path: "/workspace/seed.txt", content: "seed\n" } }]), { sandbox: block });
    assert.match(toolText(first, "w0"), /Successfully wrote/);
    const neverConnected = await broker.block("revoked");
    const pooled = pool.get(block);
    assert.ok(pooled.client.hello, "the first run's connection is pooled");
    await broker.sbctl("revoke", "revoked", "--all");
    // ...until the broker closes its connection (4001 token_revoked) within a second.
    const deadline = Date.now() + 5_000;
    while (!pooled.client.finished && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
    assert.equal(pooled.client.ended?.code, "token_revoked");

    for (const b of [block, neverConnected]) {
      const messages = await runAgent(scripted(everyTool("after-revoke")), { sandbox: b });
      for (const id of ["w", "r", "x", "l"]) {
        assert.match(toolText(messages, id), /Not allowed: the sandbox's owner revoked this credential/, id);
      }
      assert.match(toolText(messages, "x"), /^Error: Not allowed/);
      assert.equal(finalText(messages), "done");
    }
    assert.equal(existsSync(join(broker.workspace(sb.id), "after-revoke.txt")), false);
  });

  it("a read-only token: reads work, writes and commands answer Not allowed", async () => {
    const sb = await broker.create("read-only");
    const owner = await broker.block("read-only");
    await runAgent(scripted([{ id: "w0", name: "write_file", args: { file_path: "/workspace/seed.txt", content: "seed\n" } }]), { sandbox: owner });
    const ro = await broker.block("read-only", "--scope", "fs:read");
    const messages = await runAgent(
      scripted([...everyTool("ro"), { id: "e", name: "edit_file", args: { file_path: "/workspace/seed.txt", old_string: "seed", new_string: "weed" } }]),
      { sandbox: ro },
    );
    assert.match(toolText(messages, "r"), /\nseed$/);
    assert.match(toolText(messages, "l"), /seed\.txt/);
    for (const id of ["w", "x", "e"]) {
      const text = toolText(messages, id);
      assert.match(text, /Not allowed: /, id);
      assert.match(text, /do not retry, ask the sandbox's owner for a run config with that scope/, id);
    }
    assert.equal(finalText(messages), "done");
    assert.equal(await readFile(join(broker.workspace(sb.id), "seed.txt"), "utf8"), "seed\n");
    assert.equal(existsSync(join(broker.workspace(sb.id), "ro.txt")), false);
  });

  it("a token without fs:write: a large command output is kept, and the answer says why it was not saved", async () => {
    const sb = await broker.create("no-write");
    const block = await broker.block("no-write", "--scope", "fs:read,exec");
    // About 170 000 characters: past deepagents' eviction threshold (20 000 tokens, 80 000 characters).
    const messages = await runAgent(scripted([{ id: "big", name: "execute", args: { command: "seq 1 30000" } }]), { sandbox: block });
    const text = toolText(messages, "big");
    assert.match(text, /could not be saved/);
    assert.match(text, /no fs:write scope/);
    assert.match(text, /\n1\n2\n3\n/);
    assert.match(text, /\n29999\n30000\n/);
    assert.equal(finalText(messages), "done");
    assert.equal(existsSync(join(broker.workspace(sb.id), "large_tool_results")), false);
  });

  it("a command allowlist: other commands answer Not allowed with the allowed programs", async () => {
    await broker.create("allowlist");
    const block = await broker.block("allowlist", "--allow-cmd", "echo,true");
    const messages = await runAgent(
      scripted([
        { id: "ok", name: "execute", args: { command: "echo allowed" } },
        { id: "no", name: "execute", args: { command: "echo a | cat" } },
      ]),
      { sandbox: block },
    );
    assert.match(toolText(messages, "ok"), /allowed\n/);
    assert.match(toolText(messages, "no"), /Not allowed: .*Allowed programs: echo, true/s);
    assert.equal(finalText(messages), "done");
  });

  it("an expired block: refused before dialling, the model is told to send a fresh one", async () => {
    const sb = await broker.create("expired");
    const events = await followEvents(broker.url, broker.apiKey, sb.id);
    const block = await broker.block("expired", "--expires", "1s");
    const exp = JSON.parse(Buffer.from(block.credential.split(".")[1]!, "base64url").toString()).exp as number;
    while (Date.now() <= exp * 1000) await new Promise((r) => setTimeout(r, 50)); // the token's own clock
    const before = pool.size;
    const messages = await runAgent(scripted(everyTool("expired")), { sandbox: block });
    for (const id of ["w", "r", "x", "l"]) {
      assert.match(toolText(messages, id), /Not allowed: this sandbox credential expired\. .*send a fresh run config/, id);
    }
    assert.equal(finalText(messages), "done");
    assert.equal(pool.size, before, "nothing was dialled for it");
    // A fresh block works at once; the expired one never reached the broker.
    const fresh = await runAgent(scripted([{ id: "l", name: "ls", args: {} }]), { sandbox: await broker.block("expired", "--expires", "5m") });
    assert.match(toolText(fresh, "l"), /^No files found in \/$/);
    try {
      const seen = await events.waitFor((ev) => ev.some((e) => e.type === "connected"));
      assert.equal(seen.filter((e) => e.type === "connected").length, 1, "only the fresh block connected");
    } finally {
      events.close();
    }
  });

  it("sbctl run-config mints a token that fits one run by default (30 min, not the broker's hour)", async () => {
    await broker.create("default-expiry");
    const block = await broker.block("default-expiry");
    const claims = JSON.parse(Buffer.from(block.credential.split(".")[1]!, "base64url").toString()) as { exp: number; iat: number };
    assert.equal(claims.exp - claims.iat, 30 * 60);
  });

  it("a missing or malformed block: every tool names the problem", async () => {
    const cases: Array<[Record<string, unknown>, RegExp]> = [
      [{}, /no sandbox block \(configurable\.sandbox\); send one with every run/],
      [{ sandbox: { sandbox_id: "sb_x", dataplane_url: "ws://127.0.0.1:1/v1/sandboxes/sb_x/dataplane" } }, /configurable\.sandbox\.credential is missing/],
      [{ sandbox: { sandbox_id: "sb_x", credential: "t", dataplane_url: "https://h/x" } }, /must be a ws:\/\/ or wss:\/\/ URL/],
    ];
    for (const [configurable, want] of cases) {
      const messages = await runAgent(scripted(everyTool("none")), configurable);
      for (const id of ["w", "r", "x", "l"]) assert.match(toolText(messages, id), want, `${id}: ${JSON.stringify(configurable)}`);
      assert.equal(finalText(messages), "done");
    }
  });

  it("a block naming a broker the server does not use: refused before dialling", async () => {
    await broker.create("origin");
    const block = await broker.block("origin");
    const backend = new RunConfigSandbox({ pool, allowedOrigins: ["wss://broker.example.com"] });
    const agent = createDeepAgent({ model: scripted([{ id: "l", name: "ls", args: {} }]), backend });
    const res = await agent.invoke({ messages: [new HumanMessage("go")] }, { configurable: { sandbox: block } });
    assert.match(toolText(res.messages, "l"), /is not a broker this agent server connects to \(allowed: wss:\/\/broker\.example\.com\)/);
    const allowed = new RunConfigSandbox({ pool, allowedOrigins: [new URL(block.dataplane_url).origin] });
    const ok = await createDeepAgent({ model: scripted([{ id: "l", name: "ls", args: {} }]), backend: allowed }).invoke(
      { messages: [new HumanMessage("go")] },
      { configurable: { sandbox: block } },
    );
    assert.match(toolText(ok.messages, "l"), /^No files found in \/$/);
  });

  it("an unreachable broker: try again shortly", async () => {
    const block = { sandbox_id: "sb_gone", credential: "t", dataplane_url: "ws://127.0.0.1:9/v1/sandboxes/sb_gone/dataplane" };
    const p = new SandboxPool({ dial: { reconnects: 1 } });
    try {
      const agent = createDeepAgent({ model: scripted([{ id: "l", name: "ls", args: {} }]), backend: new RunConfigSandbox({ pool: p }) });
      const res = await agent.invoke({ messages: [new HumanMessage("go")] }, { configurable: { sandbox: block } });
      assert.match(toolText(res.messages, "l"), /unreachable right now .* Try again shortly/);
    } finally {
      p.close();
    }
  });
});
