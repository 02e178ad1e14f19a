// A saga built on the Node example's saga.mjs whose undo breaks the contract:
// positional arguments (a JSON array) where the sidecar wants a JSON object,
// so the sidecar rejects the `do` span with an OTLP partial success.
//
//   node positional_undo.mjs ENDPOINT PROTOCOL PROCESSOR
//
// Prints {"run_id": ..., "status": ...}; the agent's log goes to stderr. The
// undo's second argument is long, so the sidecar's message is too.

import { Run, Telemetry, tool } from "../../examples/node_agent/saga.mjs";

const [endpoint, protocol, processor] = process.argv.slice(2);
const telemetry = new Telemetry({ endpoint, protocol, processor, ackTimeoutMs: 5000 });
const run = new Run(telemetry, "refund", [
  tool("issue_credit", "compensable", () => ({ credit_id: "cr_4921_a1b2c3" }), {
    undo: ({ result }) => ({
      tool: "reverse_credit",
      args: [result.credit_id, "duplicate charge ".repeat(120)],
      description: `reverse credit ${result.credit_id}`,
    }),
  }),
  tool("reverse_credit", "convergent", () => null),
]);
await run.call("issue_credit", { order_id: 4921 });
const status = await run.end();
process.stdout.write(`${JSON.stringify({ run_id: run.runId, status })}\n`);
await telemetry.shutdown();
