// The broker's MCP front end driven by the official TypeScript MCP client
// (@modelcontextprotocol/sdk) over both transports: stdio (sbctl mcp) and Streamable HTTP
// (/v1/sandboxes/{id}/mcp). tests/mcp_test.go starts a real broker (real Redis, real sandboxes)
// and runs this file with SBX_BROKER_URL, SBX_API_KEY and SBCTL set.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const BROKER = process.env.SBX_BROKER_URL;
const KEY = process.env.SBX_API_KEY;
const SBCTL = process.env.SBCTL;
if (!BROKER || !KEY || !SBCTL) throw new Error("run through tests/mcp_test.go: SBX_BROKER_URL, SBX_API_KEY and SBCTL must be set");

const ALL = ["fs:read", "fs:write", "exec"];
const READ_TOOLS = ["glob", "grep", "ls", "read_file"];

async function rest(method, path, body) {
  const res = await fetch(BROKER + path, {
    method,
    headers: { Authorization: `Bearer ${KEY}`, "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  if (!res.ok) throw new Error(`${method} ${path}: ${res.status} ${text}`);
  return text ? JSON.parse(text) : {};
}

let seq = 0;
async function sandbox() {
  const r = await rest("POST", "/v1/sandboxes", { name: `mcp-${process.pid}-${++seq}` });
  return r.sandbox;
}
const mint = (sbx, scopes, extra = {}) => rest("POST", `/v1/sandboxes/${sbx.id}/delegations`, { scopes, ...extra });
const revoke = (sbx, jti) => rest("DELETE", `/v1/sandboxes/${sbx.id}/delegations/${jti}`);
const stop = (sbx) => rest("POST", `/v1/sandboxes/${sbx.id}/stop`);

// events returns the sandbox's recent events (the SSE stream without follow).
async function events(sbx) {
  const res = await fetch(`${BROKER}/v1/sandboxes/${sbx.id}/events?backlog=500&follow=false`, { headers: { Authorization: `Bearer ${KEY}` } });
  const text = await res.text();
  return text.split("\n").filter((l) => l.startsWith("data:")).map((l) => JSON.parse(l.slice(5)));
}

// eventually polls fn until it returns a truthy value or the deadline passes.
async function eventually(what, fn, ms = 15000) {
  const end = Date.now() + ms;
  let last;
  for (;;) {
    try {
      const v = await fn();
      if (v) return v;
    } catch (e) {
      last = e;
    }
    if (Date.now() > end) throw new Error(`${what}: not within ${ms} ms${last ? ` (last error: ${last.message})` : ""}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

async function httpClient(m) {
  const c = new Client({ name: "ts-test", version: "0.0.0" });
  const t = new StreamableHTTPClientTransport(new URL(m.sandbox.mcp_url), {
    requestInit: { headers: { Authorization: `Bearer ${m.token}` } },
  });
  await c.connect(t);
  return c;
}

// stdioClient starts sbctl mcp for sbx and connects to it. The returned stderr() reads what it said.
async function stdioClient(sbx, args = []) {
  const t = new StdioClientTransport({
    command: SBCTL,
    args: ["--broker", BROKER, "--api-key", KEY, "mcp", sbx.id, ...args],
    stderr: "pipe",
  });
  let err = "";
  t.stderr?.on("data", (d) => (err += d));
  const c = new Client({ name: "ts-test", version: "0.0.0" });
  await c.connect(t);
  return { c, t, stderr: () => err };
}

const names = async (c) => (await c.listTools()).tools.map((t) => t.name).sort();
const text = (r) => r.content.filter((x) => x.type === "text").map((x) => x.text).join("");

const transports = {
  http: async (sbx, scopes, extra) => ({ c: await httpClient(await mint(sbx, scopes, extra)) }),
  stdio: async (sbx, scopes, extra = {}) => {
    const args = ["--scope", scopes.join(",")];
    if (extra.allow_cmd) args.push("--allow-cmd", extra.allow_cmd.join(","));
    return stdioClient(sbx, args);
  },
};

for (const [kind, open] of Object.entries(transports)) {
  test(`${kind}: a token lists exactly the tools of its scopes`, async () => {
    const sbx = await sandbox();
    for (const [scopes, want] of [
      [["fs:read"], READ_TOOLS],
      [["fs:write"], ["edit_file", "write_file"]],
      [["exec"], ["execute"]],
      [["fs:read", "exec"], [...READ_TOOLS, "execute"].sort()],
      [ALL, ["edit_file", "execute", "glob", "grep", "ls", "read_file", "write_file"]],
    ]) {
      const { c } = await open(sbx, scopes);
      assert.deepEqual(await names(c), want, `scopes ${scopes}`);
      await c.close();
    }
  });

  test(`${kind}: every tool works and shows in the events under the token's jti`, async () => {
    const sbx = await sandbox();
    const { c } = await open(sbx, ALL);
    let r = await c.callTool({ name: "write_file", arguments: { file_path: "src/a.txt", content: "one\ntwo\nthree\ntwo\n" } });
    assert.equal(r.isError, undefined, text(r));
    assert.equal(r.structuredContent.path, "/workspace/src/a.txt");
    r = await c.callTool({ name: "read_file", arguments: { file_path: "src/a.txt", offset: 1, limit: 2 } });
    assert.equal(text(r), "two\nthree\n");
    assert.equal(r.structuredContent.total_lines, 4);
    r = await c.callTool({ name: "edit_file", arguments: { file_path: "src/a.txt", old_string: "two", new_string: "2" } });
    assert.equal(r.isError, true, "a repeated old_string without replace_all is refused");
    r = await c.callTool({ name: "edit_file", arguments: { file_path: "src/a.txt", old_string: "two", new_string: "2", replace_all: true } });
    assert.equal(r.structuredContent.occurrences, 2);
    r = await c.callTool({ name: "ls", arguments: { path: "src" } });
    assert.match(text(r), /\/workspace\/src\/a\.txt/);
    r = await c.callTool({ name: "glob", arguments: { pattern: "**/*.txt" } });
    assert.match(text(r), /\/workspace\/src\/a\.txt/);
    r = await c.callTool({ name: "grep", arguments: { pattern: "three" } });
    assert.match(text(r), /\/workspace\/src\/a\.txt:3:three/);
    r = await c.callTool({ name: "execute", arguments: { command: "cat src/a.txt; echo oops >&2; exit 3" } });
    assert.equal(r.structuredContent.exit_code, 3);
    assert.equal(r.structuredContent.stdout, "one\n2\nthree\n2\n");
    assert.equal(r.structuredContent.stderr, "oops\n");
    assert.match(text(r), /\[exit code 3\]/);
    r = await c.callTool({ name: "execute", arguments: { command: "sleep 5", timeout_ms: 200 } });
    assert.equal(r.structuredContent.reason, "timeout", JSON.stringify(r.structuredContent));
    r = await c.callTool({ name: "execute", arguments: { command: "head -c 2000000 /dev/zero | tr '\\0' x" } });
    assert.equal(r.structuredContent.truncated, true, "output past 1 MiB is truncated");
    const evs = await eventually("the calls' events", async () => {
      const e = await events(sbx);
      const w = e.find((x) => x.type === "file_written" && x.path === "/workspace/src/a.txt");
      const x = e.find((x) => x.type === "exec" && x.command?.startsWith("cat src/a.txt"));
      return w && x ? { w, x } : null;
    });
    assert.match(evs.w.actor, /^token:/);
    assert.equal(evs.x.actor, evs.w.actor, "one token acted");
    const jti = evs.w.actor.slice("token:".length);
    const connected = (await events(sbx)).find((x) => x.type === "connected" && x.jti === jti);
    assert.ok(connected, "the session's dataplane connection is the token's");
    await c.close();
  });

  test(`${kind}: refusals by scope and by the command allowlist`, async () => {
    const sbx = await sandbox();
    const { c } = await open(sbx, ["fs:read", "exec"], { allow_cmd: ["echo"] });
    assert.ok(!(await names(c)).includes("write_file"));
    await assert.rejects(c.callTool({ name: "write_file", arguments: { file_path: "x", content: "y" } }), /unknown tool|write_file/);
    const r = await c.callTool({ name: "execute", arguments: { command: "rm -rf /workspace" } });
    assert.equal(r.isError, true);
    assert.match(text(r), /^command_not_allowed: /);
    assert.equal(r.structuredContent.error.code, "command_not_allowed");
    const ok = await c.callTool({ name: "execute", arguments: { command: "echo hi" } });
    assert.equal(text(ok).split("\n")[0], "hi");
    await c.close();
  });

  test(`${kind}: concurrent calls on one session`, async () => {
    const sbx = await sandbox();
    const { c } = await open(sbx, ALL);
    const paths = Array.from({ length: 24 }, (_, i) => `c/f${i}.txt`);
    await Promise.all(paths.map((p) => c.callTool({ name: "write_file", arguments: { file_path: p, content: p } })));
    const reads = await Promise.all(paths.map((p) => c.callTool({ name: "read_file", arguments: { file_path: p } })));
    assert.deepEqual(reads.map(text), paths);
    await c.close();
  });

  test(`${kind}: progress while a command runs, and cancelling a call cancels its command`, async () => {
    const sbx = await sandbox();
    const { c } = await open(sbx, ALL);
    const progress = [];
    const r = await c.callTool({ name: "execute", arguments: { command: "sleep 1.5; echo done" } }, undefined, {
      onprogress: (p) => progress.push(p),
    });
    assert.match(text(r), /^done\n/);
    assert.ok(progress.length >= 1, "a progress notification during a 1.5 s command");
    const ac = new AbortController();
    const call = c.callTool({ name: "execute", arguments: { command: "touch started; sleep 30; touch finished" } }, undefined, { signal: ac.signal });
    await eventually("the command started", async () => text(await c.callTool({ name: "glob", arguments: { pattern: "started" } })).includes("started"));
    ac.abort();
    await assert.rejects(call);
    const ev = await eventually("the cancelled command's exec event", async () =>
      (await events(sbx)).find((x) => x.type === "exec" && x.command?.startsWith("touch started")),
    );
    assert.ok(ev.duration_ms < 30000, `the command ended when cancelled (${ev.duration_ms} ms)`);
    const g = await c.callTool({ name: "glob", arguments: { pattern: "finished" } });
    assert.ok(!text(g).includes("finished"));
    await c.close();
  });

  test(`${kind}: bad input gets a JSON-RPC error and changes nothing`, async () => {
    const sbx = await sandbox();
    const { c } = await open(sbx, ALL);
    for (const [name, args, want] of [
      ["write_file", { file_path: 7, content: "x" }, /file_path must be a string/],
      ["write_file", { file_path: "a", content: "x", mode: "create" }, /unknown field/],
      ["read_file", { file_path: "a", offset: "1" }, /offset must be an integer/],
      ["execute", { command: ["ls"] }, /command must be a string/],
      ["write_file", { file_path: "big", content: "x".repeat(1 << 20) }, /over this server's limit/],
      ["no_such_tool", {}, /unknown tool/],
    ]) {
      await assert.rejects(c.callTool({ name, arguments: args }), (e) => {
        assert.equal(e.code, -32602, `${name}: ${e.message}`);
        assert.match(e.message, want);
        return true;
      });
    }
    const ls = text(await c.callTool({ name: "ls", arguments: {} }));
    assert.ok(!ls.includes("/workspace/big") && !ls.includes("/workspace/a\n"), ls);
    await c.close();
  });
}

test("http: malformed JSON-RPC on a session is a JSON-RPC error", async () => {
  const sbx = await sandbox();
  const m = await mint(sbx, ALL);
  const c = await httpClient(m);
  const sid = c.transport.sessionId;
  assert.ok(sid);
  try {
  for (const [body, code] of [
    ["{not json", -32700],
    [JSON.stringify({ jsonrpc: "2.0", id: 9, method: "no/such/method" }), -32601],
  ]) {
    const res = await fetch(m.sandbox.mcp_url, {
      method: "POST",
      headers: {
        Authorization: `Bearer ${m.token}`,
        "Content-Type": "application/json",
        Accept: "application/json, text/event-stream",
        "Mcp-Session-Id": sid,
        "Mcp-Protocol-Version": "2025-06-18",
      },
      body,
    });
    const raw = await res.text();
    const msg = JSON.parse(raw.includes("data:") ? raw.split("\n").find((l) => l.startsWith("data:")).slice(5) : raw);
    assert.equal(msg.error?.code, code, `${body}: ${res.status} ${raw}`);
  }
  assert.deepEqual(await names(c), ["edit_file", "execute", "glob", "grep", "ls", "read_file", "write_file"], "the session goes on");
  } finally {
    await c.close();
  }
});

test("http: an API key, no credential and another sandbox's token are refused", async () => {
  const sbx = await sandbox();
  const other = await sandbox();
  const om = await mint(other, ALL);
  const url = (await mint(sbx, ALL)).sandbox.mcp_url;
  for (const [auth, status, code] of [
    [undefined, 401, "unauthenticated"],
    [`Bearer ${KEY}`, 403, "forbidden"],
    [`Bearer ${om.token}`, 404, "not_found"],
  ]) {
    const headers = { "Content-Type": "application/json", Accept: "application/json, text/event-stream" };
    if (auth) headers.Authorization = auth;
    const res = await fetch(url, {
      method: "POST",
      headers,
      body: JSON.stringify({ jsonrpc: "2.0", id: 1, method: "initialize", params: { protocolVersion: "2025-06-18", capabilities: {}, clientInfo: { name: "x", version: "1" } } }),
    });
    const body = await res.json();
    assert.equal(res.status, status);
    assert.equal(body.error.data.code, code);
    assert.equal(body.id, 1);
  }
});

test("http: a revoked token ends the session with a clear error, and opens no new one", async () => {
  const sbx = await sandbox();
  const m = await mint(sbx, ALL);
  const c = await httpClient(m);
  await c.callTool({ name: "ls", arguments: {} });
  await revoke(sbx, m.jti);
  await eventually("the session ended with token_revoked", async () => {
    try {
      await c.callTool({ name: "ls", arguments: {} });
      return false;
    } catch (e) {
      return /token_revoked/.test(e.message);
    }
  });
  await assert.rejects(httpClient(m), /token_revoked/);
  await c.close().catch(() => {});
});

test("http: an expired token ends the session with a clear error", async () => {
  const sbx = await sandbox();
  const m = await mint(sbx, ALL, { ttl_seconds: 2 });
  const c = await httpClient(m);
  await c.callTool({ name: "ls", arguments: {} });
  await eventually(
    "the session ended with token_expired",
    async () => {
      try {
        await c.callTool({ name: "ls", arguments: {} });
        return false;
      } catch (e) {
        return /token_expired/.test(e.message);
      }
    },
    20000,
  );
  await c.close().catch(() => {});
});

test("http: a sandbox stopped mid-session ends the session with not_running", async () => {
  const sbx = await sandbox();
  const c = await httpClient(await mint(sbx, ALL));
  await c.callTool({ name: "ls", arguments: {} });
  await stop(sbx);
  await eventually("the session ended with not_running", async () => {
    try {
      await c.callTool({ name: "ls", arguments: {} });
      return false;
    } catch (e) {
      return /not_running/.test(e.message);
    }
  });
  await c.close().catch(() => {});
});

// The stdio server's own token: revoked by its owner or its sandbox stopped, it exits saying why.
for (const [what, act, want] of [
  ["its token revoked", async (sbx) => {
    const d = await rest("GET", `/v1/sandboxes/${sbx.id}/delegations`);
    for (const x of d.items) if (!x.revoked) await revoke(sbx, x.jti);
  }, /revoked/],
  ["its sandbox stopped", (sbx) => stop(sbx), /stopped/],
]) {
  test(`stdio: sbctl mcp exits saying why when ${what}`, async () => {
    const sbx = await sandbox();
    const { c, t, stderr } = await stdioClient(sbx, []);
    await c.callTool({ name: "ls", arguments: {} });
    const exited = new Promise((resolve) => t.onclose = resolve);
    await act(sbx);
    await exited;
    assert.match(stderr(), want);
  });
}

test("stdio: sbctl mcp revokes its token when the client goes", async () => {
  const sbx = await sandbox();
  const { c } = await stdioClient(sbx, ["--scope", "fs:read"]);
  await c.callTool({ name: "ls", arguments: {} });
  await c.close();
  await eventually("every token revoked", async () => {
    const d = await rest("GET", `/v1/sandboxes/${sbx.id}/delegations`);
    return d.items.length > 0 && d.items.every((x) => x.revoked);
  });
});

test("stdio: malformed JSON-RPC on stdin is a JSON-RPC error", async () => {
  const sbx = await sandbox();
  const p = spawn(SBCTL, ["--broker", BROKER, "--api-key", KEY, "mcp", sbx.id], { stdio: ["pipe", "pipe", "pipe"] });
  let out = "";
  p.stdout.on("data", (d) => (out += d));
  const send = (m) => p.stdin.write((typeof m === "string" ? m : JSON.stringify(m)) + "\n");
  send({ jsonrpc: "2.0", id: 1, method: "initialize", params: { protocolVersion: "2025-06-18", capabilities: {}, clientInfo: { name: "x", version: "1" } } });
  await eventually("initialized", async () => out.includes('"id":1'));
  send({ jsonrpc: "2.0", method: "notifications/initialized" });
  send("{not json");
  send({ jsonrpc: "2.0", id: 2, method: "tools/call", params: { name: "write_file", arguments: { file_path: 1 } } });
  send({ jsonrpc: "2.0", id: 3, method: "no/such/method" });
  await eventually("answers to 2 and 3", async () => out.includes('"id":2') && out.includes('"id":3'));
  const msgs = out.trim().split("\n").map((l) => JSON.parse(l));
  assert.equal(msgs.find((m) => m.id === 2).error.code, -32602);
  assert.equal(msgs.find((m) => m.id === 3).error.code, -32601);
  assert.equal(msgs.find((m) => m.id === null)?.error.code, -32700, "a line that is not JSON is a parse error, and the session goes on");
  p.stdin.end();
  await new Promise((r) => p.on("exit", r));
});
