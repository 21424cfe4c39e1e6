// The backend without a broker: the sentences a model reads, truncated reads, the id, and a pool
// that leaves busy clients alone.

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { BrokerSandbox, UNCONFIGURED_ID } from "../src/backend.js";
import { DataplaneClient } from "../src/dataplane.js";
import { DataplaneError, describeForModel } from "../src/errors.js";
import type { ReadArgs, ReadResult } from "../src/protocol.js";
import { RunConfigSandbox, SandboxPool, parseOrigins } from "../src/routing.js";

const url = "ws://127.0.0.1:9/v1/sandboxes/sb_1/dataplane"; // nothing listens on port 9

/** A client whose read answers with r. */
class ReadStub extends DataplaneClient {
  constructor(private readonly r: ReadResult) {
    super({ url, credential: "t", sandboxId: "sb_1" });
  }
  override read(_a: ReadArgs) {
    return Promise.resolve(this.r);
  }
}

describe("sentences for the model", () => {
  it("wrong_node: retrying cannot help, the owner sends a new run config", () => {
    const s = describeForModel(new DataplaneError("wrong_node", "sandbox sb_1 is hosted by broker b2", 409));
    assert.match(s, /hosted by another broker/);
    assert.match(s, /Retrying will not help; the sandbox's owner must send a new run config/);
    assert.doesNotMatch(s, /Try again/);
  });

  it("any refused credential at the handshake: not allowed, mint a new delegation", () => {
    for (const [code, status] of [["token_malformed", 401], ["token_bad_signature", 401], ["token_not_yet_valid", 401], ["token_bad_audience", 401], ["some_new_code", 401]] as const) {
      const s = describeForModel(new DataplaneError(code, "refused", status));
      assert.match(s, /^Not allowed: the broker refused this sandbox credential/, code);
      assert.match(s, /Retrying will not help; the sandbox's owner must mint a new delegation/, code);
    }
  });

  it("a closed client is unreachable (retryable), not a refused request", async () => {
    const c = new DataplaneClient({ url, credential: "t" });
    c.close();
    await assert.rejects(c.ping(), (e: DataplaneError) => e.code === "unreachable" && /client is closed/.test(e.message));
    const s = describeForModel(await c.ping().catch((e) => e));
    assert.match(s, /unreachable right now .* Try again shortly/);
  });

  it("file operations map refused credentials to permission_denied", async () => {
    const sb = BrokerSandbox.failing(new DataplaneError("token_bad_signature", "bad signature", 401));
    assert.deepEqual(await sb.downloadFiles(["/a"]), [{ path: "/a", content: null, error: "permission_denied" }]);
    assert.deepEqual(await sb.uploadFiles([["/a", new Uint8Array(1)]]), [{ path: "/a", error: "permission_denied" }]);
    assert.match((await sb.ls("/")).error!, /^Not allowed: the broker refused this sandbox credential/);
  });
});

describe("read", () => {
  const base = { path: "/workspace/big.txt", encoding: "utf-8", size: 100 } as const;

  it("a window the broker cut: the partial last line starts the next page, and the model is told", async () => {
    const sb = new BrokerSandbox(new ReadStub({ ...base, content: "one\ntwo\nthr", total_lines: 10, truncated: true }));
    const r = await sb.read("/big.txt", 0, 500);
    assert.equal(r.content, "one\ntwo\n[The broker cut this read at its size limit; read on from offset 2.]");
    assert.equal(r.endLine, 2);
    assert.equal(r.nextOffset, 2);
  });

  it("a single line longer than the cap: shown cut, and said so", async () => {
    const sb = new BrokerSandbox(new ReadStub({ ...base, content: "xxxx", total_lines: 3, truncated: true }));
    const r = await sb.read("/big.txt", 1, 500);
    assert.match(String(r.content), /^xxxx\n\[Line 2 is longer than the broker's read limit and was cut/);
    assert.equal(r.endLine, 2);
    assert.equal(r.nextOffset, 2);
  });

  it("a partial line count (the broker's scan cap) still offers the next page", async () => {
    const sb = new BrokerSandbox(new ReadStub({ ...base, content: "one\ntwo\n", total_lines: 2, total_lines_partial: true }));
    const r = await sb.read("/big.txt", 0, 2);
    assert.equal(r.endLine, 2);
    assert.equal(r.nextOffset, 2);
  });

  it("an uncut window is unchanged", async () => {
    const sb = new BrokerSandbox(new ReadStub({ ...base, content: "one\ntwo\n", total_lines: 3 }));
    const r = await sb.read("/big.txt", 0, 2);
    assert.deepEqual(r, { content: "one\ntwo", mimeType: "text/plain", totalLines: 3, startLine: 1, endLine: 2, nextOffset: 2 });
  });
});

describe("ids and the pool", () => {
  it("RunConfigSandbox.id reads the block without touching the pool", () => {
    const pool = new SandboxPool();
    try {
      const backend = new RunConfigSandbox({ pool, configurable: () => ({ sandbox: { sandbox_id: "sb_1", credential: "t", dataplane_url: url } }) });
      assert.equal(backend.id, "sb_1");
      assert.equal(pool.size, 0);
    } finally {
      pool.close();
    }
  });

  it("BrokerSandbox.id follows its client (the placeholder until known)", () => {
    assert.equal(new BrokerSandbox(new DataplaneClient({ url, credential: "t" })).id, UNCONFIGURED_ID);
    assert.equal(new BrokerSandbox(new DataplaneClient({ url, credential: "t", sandboxId: "sb_1" })).id, "sb_1");
  });

  it("the pool does not evict a client that is still dialling", async () => {
    const pool = new SandboxPool({ maxConnections: 1, dial: { reconnects: 2 } });
    try {
      const blk = (i: number) => ({ sandbox_id: `sb_${i}`, credential: "t", dataplane_url: url.replace("sb_1", `sb_${i}`) });
      const one = pool.get(blk(1));
      const ping = one.client.ping();
      assert.equal(one.client.inflight, 1);
      pool.get(blk(2));
      assert.equal(one.client.finished, false, "a busy client is kept");
      assert.equal(pool.size, 2);
      await assert.rejects(ping, (e: DataplaneError) => e.code === "unreachable");
      assert.equal(one.client.inflight, 0);
    } finally {
      pool.close();
    }
  });
});

describe("allowed origins", () => {
  it("must be ws:// or wss:// origins, and a bad one is named with its option", () => {
    assert.deepEqual(parseOrigins(["ws://127.0.0.1:7070", " wss://b.example.com/ ", ""], "X"), ["ws://127.0.0.1:7070", "wss://b.example.com"]);
    assert.throws(() => parseOrigins(["localhost:7070"], "SBX_DATAPLANE_ORIGINS"), /^Error: SBX_DATAPLANE_ORIGINS: "localhost:7070" is not a broker origin; give ws:\/\/ or wss:\/\/ origins/);
    assert.throws(() => parseOrigins(["127.0.0.1:7070"], "SBX_DATAPLANE_ORIGINS"), /SBX_DATAPLANE_ORIGINS/);
    assert.throws(() => new RunConfigSandbox({ allowedOrigins: ["https://broker.example.com"] }), /allowedOrigins: "https:\/\/broker\.example\.com" is not a broker origin/);
  });
});
