// The example graph that `npm run dev` serves with `langgraph dev`: a deepagents agent whose file
// and shell tools run in the sandbox named by each run's config.configurable.sandbox block.
//
// The model is SBX_AGENT_MODEL when set (a "provider:model" string such as
// "anthropic:claude-sonnet-4-6"; install the provider package, e.g. @langchain/anthropic, and set
// its API key), otherwise a scripted model that replays tool calls from the user message, so the
// graph runs without any API key.

import { createDeepAgent } from "deepagents";
import { RunConfigSandbox, parseOrigins } from "./routing.js";
import { ScriptedChatModel } from "./scripted-model.js";

/**
 * The backend: each run reaches the sandbox its own block names. SBX_DATAPLANE_ORIGINS (a comma
 * list such as "ws://127.0.0.1:7070") limits which brokers the server connects to.
 */
export const backend = new RunConfigSandbox({
  allowedOrigins: parseOrigins(process.env.SBX_DATAPLANE_ORIGINS?.split(",") ?? [], "SBX_DATAPLANE_ORIGINS"),
});

const SYSTEM_PROMPT = `Your file tools and the execute tool work in a sandbox lent to this run by its owner.
File tools see its workspace as / (/notes.md is the file notes.md there); commands start in it, where
it is /workspace.
If a tool answers "Not allowed", do not retry it: the sandbox's owner decides what this run may do.`;

export const graph = createDeepAgent({
  model: process.env.SBX_AGENT_MODEL || new ScriptedChatModel(),
  backend,
  systemPrompt: SYSTEM_PROMPT,
});
