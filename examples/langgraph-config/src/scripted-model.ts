// A chat model that needs no network and no API key, so the example graph runs anywhere (and in
// CI): the user message carries the tool calls as JSON, and the model replays them.
//
//   {"tool_calls": [{"name": "write_file", "args": {"file_path": "/workspace/a.txt", "content": "hi"}}]}
//   {"steps": [[...first round of calls...], [...second round...]]}
//
// After the last round it answers with the tool results, one per line. Any other message gets a
// short help text. It is stateless (everything it needs is in the conversation), so concurrent
// runs and subagents (`task`) work. Set SBX_AGENT_MODEL to use a real model instead.

import type { BaseMessage } from "@langchain/core/messages";
import { AIMessage } from "@langchain/core/messages";
import { BaseChatModel } from "@langchain/core/language_models/chat_models";
import type { ChatResult } from "@langchain/core/outputs";
import { randomUUID } from "node:crypto";

interface ScriptedCall {
  name: string;
  args: Record<string, unknown>;
}

export const SCRIPTED_MODEL_HELP =
  'This graph runs a scripted model (no LLM configured). Send a message like {"tool_calls": [{"name": "ls", "args": {"path": "/workspace"}}]} ' +
  'or {"steps": [[...], [...]]} to replay tool calls, or set SBX_AGENT_MODEL (e.g. "anthropic:claude-sonnet-4-6") to use a real model.';

function textOf(m: BaseMessage): string {
  return typeof m.content === "string" ? m.content : m.content.map((c) => ("text" in c && typeof c.text === "string" ? c.text : "")).join("");
}

function parseSteps(text: string): ScriptedCall[][] | undefined {
  let v: unknown;
  try {
    v = JSON.parse(text);
  } catch {
    return undefined;
  }
  if (typeof v !== "object" || v === null) return undefined;
  const o = v as { tool_calls?: unknown; steps?: unknown };
  const steps = Array.isArray(o.steps) ? o.steps : Array.isArray(o.tool_calls) ? [o.tool_calls] : undefined;
  if (!steps) return undefined;
  return steps.map((step) =>
    (Array.isArray(step) ? step : []).map((c) => ({ name: String(c?.name ?? ""), args: (c?.args ?? {}) as Record<string, unknown> })),
  );
}

/** Replays the tool calls a user message scripts. See the module comment. */
export class ScriptedChatModel extends BaseChatModel {
  constructor() {
    super({});
  }

  _llmType(): string {
    return "sbx-scripted";
  }

  // The script names the tools; binding them changes nothing.
  override bindTools(): this {
    return this;
  }

  async _generate(messages: BaseMessage[]): Promise<ChatResult> {
    const reply = (message: AIMessage): ChatResult => ({ generations: [{ text: textOf(message), message }] });
    let human = -1;
    for (let i = messages.length - 1; i >= 0; i--) {
      if (messages[i]!.getType() === "human") {
        human = i;
        break;
      }
    }
    if (human < 0) return reply(new AIMessage(SCRIPTED_MODEL_HELP));
    const steps = parseSteps(textOf(messages[human]!));
    if (!steps) return reply(new AIMessage(SCRIPTED_MODEL_HELP));
    const after = messages.slice(human + 1);
    const done = after.filter((m) => m.getType() === "ai").length;
    if (done < steps.length) {
      return reply(
        new AIMessage({
          content: "",
          tool_calls: steps[done]!.map((c) => ({ id: `call_${randomUUID()}`, name: c.name, args: c.args, type: "tool_call" as const })),
        }),
      );
    }
    const results = after.filter((m) => m.getType() === "tool").map((m) => `${m.name ?? "tool"}: ${textOf(m)}`);
    return reply(new AIMessage(results.join("\n") || "done"));
  }
}
