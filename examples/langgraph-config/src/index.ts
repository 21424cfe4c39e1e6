// A deepagents sandbox backend on the sbx broker's dataplane.
//
//   import { RunConfigSandbox } from "@sbxbroker/langgraph-config";
//   const agent = createDeepAgent({ model, backend: new RunConfigSandbox() });
//
// Each run then sends {"config": {"configurable": {"sandbox": {sandbox_id, credential,
// dataplane_url}}}} (sbctl run-config) and its tools work in that sandbox.

export { BrokerSandbox, WORKSPACE, EMPTY_CONTENT_WARNING, toSandboxPath, toAgentPath, credentialExpiry, expiredBlock, mimeTypeOf, isTextMimeType } from "./backend.js";
export type { BrokerSandboxOptions, PoolDialOptions } from "./backend.js";
export { RunConfigSandbox, SandboxPool, defaultPool, parseOrigins, UNCONFIGURED_ID } from "./routing.js";
export type { RunConfigSandboxOptions, SandboxPoolOptions } from "./routing.js";
export { DataplaneClient, Connection } from "./dataplane.js";
export type { DataplaneOptions, CallOptions, ExecStreamOptions } from "./dataplane.js";
export { DataplaneError, describeForModel } from "./errors.js";
export { sandboxBlockOf, newRunConfig, NO_SANDBOX_MESSAGE, SANDBOX_KEY } from "./runconfig.js";
export type { SandboxBlock, RunConfig } from "./runconfig.js";
export { ScriptedChatModel } from "./scripted-model.js";
export * as protocol from "./protocol.js";
