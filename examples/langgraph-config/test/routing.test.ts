// Routing without a broker: the pool's keys and eviction, the id deepagents sees, paths.

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { isSandboxBackend } from "deepagents";
import { toAgentPath, toSandboxPath } from "../src/backend.js";
import { RunConfigSandbox, SandboxPool, UNCONFIGURED_ID } from "../src/routing.js";

const blk = (i: number, cred = `c${i}`) => ({
  sandbox_id: `sb_${i}`,
  credential: cred,
  dataplane_url: `ws://127.0.0.1:9/v1/sandboxes/sb_${i}/dataplane`,
});

describe("SandboxPool", () => {
  it("keeps one backend per sandbox and credential, least recently used out first", () => {
    const pool = new SandboxPool({ maxConnections: 2 });
    try {
      const one = pool.get(blk(1));
      assert.equal(pool.get(blk(1)), one);
      assert.notEqual(pool.get(blk(1, "another token")), one); // a new credential is a new connection
      assert.equal(pool.size, 2);
      pool.get(blk(1)); // most recent now
      pool.get(blk(3)); // over the cap: the least recently used goes
      assert.equal(pool.size, 2);
      assert.equal(pool.get(blk(1)), one);
      assert.equal(one.client.finished, false);
    } finally {
      pool.close();
    }
  });

  it("replaces a backend that can never work again", () => {
    const pool = new SandboxPool();
    try {
      const one = pool.get(blk(1));
      one.close();
      assert.notEqual(pool.get(blk(1)), one);
    } finally {
      pool.close();
    }
  });
});

describe("RunConfigSandbox", () => {
  it("is a sandbox backend to deepagents, with or without a block", () => {
    const pool = new SandboxPool();
    try {
      let configurable: unknown = { sandbox: blk(7) };
      const backend = new RunConfigSandbox({ pool, configurable: () => configurable });
      assert.equal(backend.id, "sb_7");
      assert.ok(isSandboxBackend(backend));
      configurable = {};
      assert.equal(backend.id, UNCONFIGURED_ID); // execute stays visible, and answers why it cannot run
      assert.ok(isSandboxBackend(backend));
      assert.equal(new RunConfigSandbox({ pool }).id, UNCONFIGURED_ID); // outside a run
    } finally {
      pool.close();
    }
  });

  it("answers every operation with the block's problem", async () => {
    const backend = new RunConfigSandbox({ configurable: () => ({ sandbox: { sandbox_id: "sb_1" } }) });
    const want = /The sandbox is not configured for this run: malformed run config: configurable\.sandbox\.credential is missing/;
    assert.match((await backend.ls("/")).error!, want);
    assert.match((await backend.read("/a")).error!, want);
    assert.match((await backend.write("/a", "x")).error!, want);
    assert.match((await backend.edit("/a", "x", "y")).error!, want);
    assert.match((await backend.grep("x")).error!, want);
    assert.match((await backend.glob("*")).error!, want);
    assert.match((await backend.delete("/a")).error!, want);
    const ex = await backend.execute("true");
    assert.match(ex.output, want);
    assert.equal(ex.exitCode, null);
    assert.deepEqual(await backend.downloadFiles(["/a"]), [{ path: "/a", content: null, error: "permission_denied" }]);
  });
});

describe("paths", () => {
  it("keep the agent inside the workspace", () => {
    assert.equal(toSandboxPath(undefined), "/workspace");
    assert.equal(toSandboxPath("/"), "/workspace");
    assert.equal(toSandboxPath("/workspace"), "/workspace");
    assert.equal(toSandboxPath("/workspace/a/b.py"), "/workspace/a/b.py");
    assert.equal(toSandboxPath("/notes.md"), "/workspace/notes.md");
    assert.equal(toSandboxPath("/large_tool_results/x.txt"), "/workspace/large_tool_results/x.txt");
    assert.equal(toSandboxPath("/workspaces/x"), "/workspace/workspaces/x");
    assert.equal(toSandboxPath("src/a.py"), "src/a.py"); // the broker resolves it against /workspace
  });

  it("map back to the agent's view", () => {
    assert.equal(toAgentPath("/workspace"), "/");
    assert.equal(toAgentPath("/workspace/a/b.py"), "/a/b.py");
    assert.equal(toAgentPath("/workspaces/x"), "/workspaces/x");
    for (const p of ["/", "/notes.md", "/large_tool_results/x.txt", "/workspace/a"]) assert.equal(toAgentPath(toSandboxPath(p)), p.startsWith("/workspace/") ? "/a" : p);
  });
});
