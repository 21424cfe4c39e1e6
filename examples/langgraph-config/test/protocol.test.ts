// The golden frames of protocol/testdata/frames.json, shared with the Go implementation: every
// frame decodes strictly (unknown keys refused) into our types and encodes back to the same JSON (key order aside) or
// the same bytes.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, it } from "node:test";
import {
  decodeClientFrame,
  decodeResult,
  decodeServerFrame,
  encodeBinaryFrame,
  encodeBodyFrame,
  encodeClientFrame,
  encodeResult,
  encodeServerFrame,
  parseBinaryFrame,
  parseBodyFrame,
  FrameKind,
  ProtocolError,
  readResultOf,
  writeBodyOf,
  resultKindOf,
  type ResultKind,
} from "../src/protocol.js";
import { sandboxBlockOf } from "../src/runconfig.js";
import { DataplaneError } from "../src/errors.js";
import { PKG_DIR, REPO_DIR } from "./helpers/broker.js";

/** Checks a block and returns it unchanged. */
function sampleBlockLike(b: unknown) {
  return sandboxBlockOf({ sandbox: b });
}

interface Golden {
  name: string;
  from: "client" | "server";
  op?: string;
  result?: ResultKind;
  text?: unknown;
  binary?: string;
  kind?: number;
  id?: number;
  payload_hex?: string;
  json?: unknown;
  body_hex?: string;
}

const file = JSON.parse(readFileSync(join(REPO_DIR, "protocol", "testdata", "frames.json"), "utf8")) as { frames: Golden[] };

describe("golden frames (protocol/testdata/frames.json)", () => {
  it("has frames of every kind", () => {
    assert.ok(file.frames.length >= 40);
    assert.ok(file.frames.some((f) => f.binary));
    assert.ok(file.frames.some((f) => f.from === "client" && f.text));
    assert.ok(file.frames.some((f) => f.from === "server" && f.text));
  });

  for (const f of file.frames) {
    it(f.name, () => {
      if (f.kind === FrameKind.RequestBody || f.kind === FrameKind.AnswerBody) {
        const bytes = Buffer.from(f.binary!, "hex");
        const parsed = parseBodyFrame(bytes);
        assert.equal(parsed.kind, f.kind);
        assert.equal(parsed.id, f.id);
        assert.equal(parsed.body.toString("hex"), f.body_hex);
        assert.deepEqual(JSON.parse(parsed.json), f.json);
        if (f.kind === FrameKind.RequestBody) {
          const frame = decodeClientFrame(parsed.json);
          assert.equal(frame.op, f.op);
          assert.equal(frame.id, f.id);
          assert.equal(encodeBodyFrame(f.kind, f.id!, encodeClientFrame(frame), parsed.body).toString("hex"), f.binary);
        } else {
          const frame = decodeServerFrame(parsed.json, true);
          assert.ok("result" in frame);
          const head = decodeResult("read", frame.result, true);
          assert.deepEqual(encodeResult("read", head), (f.json as { result: unknown }).result);
          assert.equal(encodeBodyFrame(f.kind, f.id!, encodeServerFrame(frame, "read"), parsed.body).toString("hex"), f.binary);
        }
        return;
      }
      if (f.binary !== undefined) {
        const bytes = Buffer.from(f.binary, "hex");
        const parsed = parseBinaryFrame(bytes);
        assert.equal(parsed.kind, f.kind);
        assert.equal(parsed.id, f.id);
        assert.equal(parsed.payload.toString("hex"), f.payload_hex);
        assert.equal(encodeBinaryFrame(parsed.kind, parsed.id, parsed.payload).toString("hex"), f.binary);
        return;
      }
      const text = JSON.stringify(f.text);
      if (f.from === "client") {
        const frame = decodeClientFrame(text);
        if (f.op) assert.equal(frame.op, f.op);
        assert.deepEqual(JSON.parse(encodeClientFrame(frame)), f.text);
        return;
      }
      const frame = decodeServerFrame(text, true);
      let kind: ResultKind | undefined;
      if ("result" in frame) {
        kind = f.result ?? "ping";
        const result = decodeResult(kind, frame.result, true);
        assert.deepEqual(encodeResult(kind, result), (f.text as { result: unknown }).result);
      }
      assert.deepEqual(JSON.parse(encodeServerFrame(frame, kind)), f.text);
    });
  }
});

describe("strict decoding", () => {
  it("refuses unknown keys, wrong types and missing fields", () => {
    assert.throws(() => decodeClientFrame('{"id":1,"op":"read","args":{"path":"a","bogus":1}}'), ProtocolError);
    assert.throws(() => decodeClientFrame('{"id":-1,"op":"ping"}'), ProtocolError);
    assert.throws(() => decodeClientFrame('{"id":4294967296,"op":"ping"}'), ProtocolError);
    assert.throws(() => decodeClientFrame('{"id":1,"op":"nope"}'), ProtocolError);
    assert.throws(() => decodeServerFrame('{"id":1,"result":{},"error":{"code":"x","message":"y"}}'), ProtocolError);
    assert.throws(() => decodeResult("read", { path: "/workspace/a" }), /missing field "size"/);
    assert.throws(() => decodeResult("read", { path: "/workspace/a", size: 1, content: "x" }, true), /unknown field "content"/);
    assert.throws(() => decodeResult("exec", { exit_code: 0, duration_ms: 1.5 }), ProtocolError);
    assert.throws(() => encodeClientFrame({ id: 1, op: "write", args: { path: "a", mdoe: "create" } as never }), /unknown field "mdoe"/);
    assert.throws(() => parseBinaryFrame(Buffer.from("0100", "hex")), ProtocolError);
    // A frame with a body whose JSON length passes its end.
    assert.throws(() => parseBodyFrame(Buffer.from("06000000010000ffff7b7d", "hex")), ProtocolError);
    assert.throws(() => parseBodyFrame(Buffer.from("0600000001", "hex")), ProtocolError);
  });

  it("carries content raw: writes split into head and body, reads made whole again", () => {
    assert.deepEqual(writeBodyOf({ path: "a", content: "héllo", mode: "create" }), { head: { path: "a", mode: "create" }, body: Buffer.from("héllo") });
    assert.deepEqual(writeBodyOf({ path: "a", content: "AAEC/w==", encoding: "base64" }).body, Buffer.from([0, 1, 2, 255]));
    assert.throws(() => writeBodyOf({ path: "a", content: "!!!", encoding: "base64" }), /not valid base64/);
    assert.throws(() => writeBodyOf({ path: "a", content: "x", encoding: "utf-16" as never }), /unknown encoding/);
    assert.deepEqual(readResultOf({ path: "/workspace/a", size: 3 }, Buffer.from("abc")), { path: "/workspace/a", size: 3, content: "abc", encoding: "utf-8" });
    assert.deepEqual(readResultOf({ path: "/workspace/b", size: 4 }, Buffer.from([0, 1, 2, 255])), { path: "/workspace/b", size: 4, content: "AAEC/w==", encoding: "base64" });
  });

  it("reads the broker's frames leniently: unknown keys are dropped, unless strict", () => {
    const hello = '{"id":0,"type":"hello","new":1,"hello":{"protocol":"sbx.dataplane.v2","sandbox_id":"sb_1","workspace":"/workspace","scopes":[],"region":"eu","limits":{"max_frame_bytes":1,"max_inflight":1,"max_chunk_bytes":1,"max_output_bytes":1,"max_new":2}}}';
    const f = decodeServerFrame(hello);
    assert.ok("hello" in f);
    assert.equal(f.hello.sandbox_id, "sb_1");
    assert.deepEqual(f.hello.limits, { max_frame_bytes: 1, max_inflight: 1, max_chunk_bytes: 1, max_output_bytes: 1 });
    assert.throws(() => decodeServerFrame(hello, true), /unknown field "new"/);
    const entry = { path: "/workspace/a", name: "a", type: "file", size: 1, mode: 420, mod_time: "t", owner: "x" };
    const { owner: _, ...known } = entry;
    assert.deepEqual(decodeResult("ls", { entries: [entry], cursor: "c" }), { entries: [known] });
    assert.throws(() => decodeResult("ls", { entries: [entry] }, true), /unknown field "owner"/);
    assert.deepEqual(decodeServerFrame('{"id":3,"error":{"code":"x","message":"y","hint":"z"}}'), { id: 3, error: { code: "x", message: "y" } });
    // Types and required fields stay checked.
    assert.throws(() => decodeResult("ls", { entries: [{ ...entry, size: "1" }] }), ProtocolError);
  });

  it("accepts null listings (a Go nil slice)", () => {
    assert.deepEqual(decodeResult("ls", { entries: null }), { entries: null });
    assert.deepEqual(decodeResult("grep", { matches: null }), { matches: null });
  });

  it("maps ops to result kinds", () => {
    assert.equal(resultKindOf("delete"), "path");
    assert.equal(resultKindOf("upload"), "write");
    assert.equal(resultKindOf("read"), "read");
  });
});

describe("run-config block (DESIGN §5.1)", () => {
  const good = { sandbox_id: "sb_1", credential: "tok", dataplane_url: "ws://127.0.0.1:7070/v1/sandboxes/sb_1/dataplane" };
  const err = (v: unknown) => {
    try {
      sandboxBlockOf(v);
    } catch (e) {
      assert.ok(e instanceof DataplaneError);
      assert.equal(e.code, "invalid_run_config");
      return e.message;
    }
    assert.fail("no error");
  };

  it("reads exactly the three keys and ignores extra ones", () => {
    assert.deepEqual(sandboxBlockOf({ sandbox: { ...good, extra: 1 }, thread_id: "t" }), good);
  });

  it("samples/ have the exact shape", () => {
    const sample = (name: string) => JSON.parse(readFileSync(join(PKG_DIR, "samples", name), "utf8"));
    const keys = ["credential", "dataplane_url", "sandbox_id"];
    const runConfig = sample("run-config.json");
    assert.deepEqual(Object.keys(runConfig), ["config"]);
    assert.deepEqual(Object.keys(runConfig.config), ["configurable"]);
    assert.deepEqual(Object.keys(runConfig.config.configurable), ["sandbox"]);
    assert.deepEqual(Object.keys(sandboxBlockOf(runConfig.config.configurable)).sort(), keys);
    assert.deepEqual(Object.keys(sample("sandbox-block.json")).sort(), keys);
    const request = sample("run-request.json");
    assert.equal(request.assistant_id, "agent");
    assert.deepEqual(request.config, { configurable: { sandbox: sampleBlockLike(request.config.configurable.sandbox) } });
    assert.ok(JSON.parse(request.input.messages[0].content).steps.length > 0, "the scripted model's message is JSON");
  });

  it("names what is missing or wrong", () => {
    assert.match(err(undefined), /no sandbox block \(configurable\.sandbox\); send one with every run/);
    assert.match(err({ thread_id: "t" }), /no sandbox block/);
    assert.match(err({ sandbox: "sb_1" }), /configurable\.sandbox must be an object/);
    assert.match(err({ sandbox: { ...good, credential: undefined } }), /configurable\.sandbox\.credential is missing/);
    assert.match(err({ sandbox: { sandbox_id: "sb_1", dataplane_url: good.dataplane_url } }), /credential is missing/);
    assert.match(err({ sandbox: { ...good, sandbox_id: "" } }), /sandbox_id must be a non-empty string/);
    assert.match(err({ sandbox: { ...good, credential: 42 } }), /credential must be a non-empty string/);
    assert.match(err({ sandbox: { ...good, dataplane_url: "http://h/x" } }), /must be a ws:\/\/ or wss:\/\/ URL/);
    for (const url of ["not a url s3cret", `${good.dataplane_url}?token=s3cret`, `${good.dataplane_url}#s3cret`, "ws://u:s3cret@127.0.0.1:7070/v1/sandboxes/sb_1/dataplane", "ws://s3cret@127.0.0.1:7070/x"]) {
      const m = err({ sandbox: { ...good, dataplane_url: url } });
      assert.match(m, /configurable\.sandbox\.dataplane_url (is not a URL|must not carry a query, fragment, user name or password)/, url);
      assert.doesNotMatch(m, /s3cret/, "the URL is never repeated");
    }
    assert.match(err([]), /configurable must be a JSON object/);
  });
});
