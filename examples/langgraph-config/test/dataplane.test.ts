// The dataplane client against a real broker: multiplexing, binary frames, cancellation, reconnects
// and the broker's final close codes.

import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { DataplaneClient } from "../src/dataplane.js";
import { DataplaneError } from "../src/errors.js";
import type { SandboxBlock } from "../src/runconfig.js";
import { startBroker, type Broker, type Sandbox } from "./helpers/broker.js";

let broker: Broker;
let sb: Sandbox;
let block: SandboxBlock;
const clients: DataplaneClient[] = [];

function client(b: SandboxBlock = block): DataplaneClient {
  const c = new DataplaneClient({ url: b.dataplane_url, credential: b.credential, sandboxId: b.sandbox_id });
  clients.push(c);
  return c;
}

async function rejectsWith(p: Promise<unknown>, code: string): Promise<DataplaneError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof DataplaneError, `not a DataplaneError: ${e}`);
    assert.equal(e.code, code, e.message);
    return e;
  }
  assert.fail(`expected ${code}`);
}

describe("dataplane client", { timeout: 120_000 }, () => {
  before(async () => {
    broker = await startBroker();
    sb = await broker.create("dp");
    block = await broker.block("dp", "--expires", "10m");
  });
  after(async () => {
    for (const c of clients) c.close();
    await broker?.stop();
  });

  it("greets with the token's scopes and limits", async () => {
    const c = client();
    const hello = await c.connect();
    assert.equal(hello.sandbox_id, sb.id);
    assert.equal(hello.workspace, "/workspace");
    assert.deepEqual(hello.scopes, ["fs:read", "fs:write", "exec"]);
    assert.ok(hello.expires_at);
    assert.equal(hello.limits.max_inflight, 64);
    assert.equal((await c.ping()).constructor, Object);
  });

  it("multiplexes more requests than max_inflight on one connection", async () => {
    const c = client();
    await c.write({ path: "mux.txt", content: "a\nb\nc\n" });
    const reads = await Promise.all(Array.from({ length: 150 }, (_, i) => c.read({ path: "mux.txt", line_offset: i % 3, line_limit: 1 })));
    reads.forEach((r, i) => assert.equal(r.content, `${"abc"[i % 3]}\n`));
  });

  it("moves bytes both ways in binary frames, larger than one chunk", async () => {
    const c = client();
    const bytes = Buffer.alloc(2_500_000);
    for (let i = 0; i < bytes.length; i++) bytes[i] = (i * 7919) & 0xff;
    const w = await c.upload("bin/blob.dat", bytes);
    assert.equal(w.size, bytes.length);
    assert.ok((await readFile(join(broker.workspace(sb.id), "bin", "blob.dat"))).equals(bytes));
    assert.ok((await c.download("bin/blob.dat")).equals(bytes));
  });

  it("takes answers far bigger than max_frame_bytes (a read of 3 MiB of control bytes)", async () => {
    const c = client();
    // Valid UTF-8 that JSON escapes sixfold: the answer is one ~18 MiB text frame.
    await c.upload("ctrl.bin", Buffer.alloc(3 << 20, 1));
    const pending = c.ping(); // another request sharing the connection
    const r = await c.read({ path: "ctrl.bin" });
    assert.equal(r.encoding, "utf-8");
    assert.equal(r.content.length, 3 << 20);
    assert.equal(r.content, "\u0001".repeat(3 << 20));
    await pending;
    await c.ping();
  });

  it("streams exec output as stdout frames", async () => {
    const c = client();
    const chunks: string[] = [];
    const r = await c.exec({ command: "echo one; echo two >&2; exit 4" }, { onStdout: (b) => chunks.push(b.toString()) });
    assert.equal(r.exit_code, 4);
    assert.equal(r.output, undefined);
    assert.equal(chunks.join(""), "one\ntwo\n");
  });

  it("refuses a request bigger than a frame without losing the connection", async () => {
    const c = client();
    await c.ping();
    await rejectsWith(c.write({ path: "huge.txt", content: "x".repeat(1_200_000) }), "payload_too_large");
    await c.ping(); // same connection, still fine
  });

  it("cancels a request when its signal aborts", async () => {
    const c = client();
    const ac = new AbortController();
    const started = Date.now();
    const p = c.exec({ command: "sleep 30" }, { signal: ac.signal });
    setTimeout(() => ac.abort(), 300);
    await rejectsWith(p, "cancelled");
    assert.ok(Date.now() - started < 5_000);
    await c.ping(); // the connection is fine and the slot was given back
  });

  it("reconnects after the connection breaks, retrying a read once", async () => {
    const c = client();
    await c.write({ path: "again.txt", content: "still here\n" });
    const inflight = c.exec({ command: "sleep 5" });
    inflight.catch(() => undefined);
    // Drop the socket under the requests in flight, as a network failure would.
    (c as unknown as { conn: { ws: { terminate(): void } } }).conn.ws.terminate();
    await rejectsWith(inflight, "unreachable"); // exec is never retried
    const r = await c.read({ path: "again.txt" });
    assert.equal(r.content, "still here\n");
    assert.equal(c.ended, undefined);
  });

  it("fails refused handshakes with the broker's code, without retrying", async () => {
    await rejectsWith(client({ ...block, credential: "not-a-token" }).ping(), "token_malformed");
    const other = await broker.create("dp-other");
    const wrong = client({ ...block, dataplane_url: block.dataplane_url.replace(sb.id, other.id) });
    // Another sandbox of the org answers as a missing one would: a token learns nothing of it.
    await rejectsWith(wrong.ping(), "not_found");
  });

  it("ends for good when the owner revokes the token (close 4001)", async () => {
    await broker.create("dp-revoke");
    const b = await broker.block("dp-revoke");
    const c = client(b);
    await c.ping();
    const slow = c.exec({ command: "sleep 10" });
    slow.catch(() => undefined); // it rejects while the revoke runs; checked below
    let ended: DataplaneError | undefined;
    c.onEnded = (e) => (ended = e);
    await broker.sbctl("revoke", "dp-revoke", "--all");
    const e = await rejectsWith(slow, "token_revoked");
    assert.match(e.message, /revoked/);
    assert.equal(ended?.code, "token_revoked");
    await rejectsWith(c.ping(), "token_revoked"); // no reconnect
    const fresh = client(b); // a new client with the same token is refused at the handshake
    const refused = await rejectsWith(fresh.ping(), "token_revoked");
    assert.equal(refused.status, 401);
  });

  it("ends for good when the sandbox stops (close 4002)", async () => {
    await broker.create("dp-stop");
    const c = client(await broker.block("dp-stop"));
    await c.ping();
    await broker.sbctl("stop", "dp-stop");
    const deadline = Date.now() + 10_000;
    while (!c.ended && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
    assert.equal(c.ended?.code, "sandbox_not_running");
    await rejectsWith(c.ping(), "sandbox_not_running");
  });
});
