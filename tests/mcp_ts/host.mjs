// An MCP host on the official TypeScript SDK, as most hosts embed it: it starts the server
// its configuration names (an `mcpServers` entry, as the README shows it) over stdio, lists
// the tools (which arms the SDK's check of every result against the tool's outputSchema),
// then makes each call it reads, in order, printing one JSON line per call:
//   {"tool": ..., "result": {...}}  or  {"tool": ..., "thrown": "..."}  (the SDK refused it)
// and, for a call made with "progress": true, the notifications/progress it saw.
// Usage: node host.mjs CONFIG_JSON CALLS_JSON   (CALLS_JSON: [{"tool", "arguments"}...])
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const [config, calls] = process.argv.slice(2).map((text) => JSON.parse(text));
const server = config.mcpServers.subagentd;
const transport = new StdioClientTransport({
  command: server.command,
  args: server.args ?? [],
  env: server.env,
  stderr: "inherit",
});
const client = new Client({ name: "subagentd-ts-host", version: "1.0.0" });
await client.connect(transport);
const listed = await client.listTools();
console.log(JSON.stringify({ tools: listed.tools.map((tool) => tool.name) }));
for (const call of calls) {
  const progress = [];
  const options = call.progress ? { onprogress: (note) => progress.push(note) } : {};
  try {
    const result = await client.callTool(
      { name: call.tool, arguments: call.arguments },
      undefined,
      options,
    );
    console.log(JSON.stringify({ tool: call.tool, result, progress }));
  } catch (error) {
    console.log(JSON.stringify({ tool: call.tool, thrown: String(error), progress }));
  }
}
await client.close();
