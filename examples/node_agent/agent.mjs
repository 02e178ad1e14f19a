#!/usr/bin/env node
// A Node.js refund agent that the saga sidecar follows like a Python one.
//
//   node agent.mjs --endpoint http://127.0.0.1:4318                 # OTLP/proto
//   node agent.mjs --endpoint http://127.0.0.1:4318 --protocol http/json
//   node agent.mjs --endpoint http://127.0.0.1:4317 --protocol grpc --processor batch
//
// Options (each also read from the environment, standard names first):
//   --endpoint URL         OTEL_EXPORTER_OTLP_ENDPOINT: the sidecar's OTLP/HTTP base URL,
//                          or its gRPC address as http://host:port for --protocol grpc
//   --protocol P           OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL:
//                          http/protobuf (default), http/json or grpc
//   --processor P          SAGA_SPAN_PROCESSOR: simple (default) or batch
//   --heartbeat-interval S SAGA_HEARTBEAT_INTERVAL_S: seconds between heartbeats (default 1)
//   --ack-timeout-ms MS    SAGA_ACK_TIMEOUT_MS: bound on each wait for the sidecar (default 500)
//   --fail TOOL            that tool's call fails (send_reply: an unwind; close_ticket: stuck)
//   --undo-fail TOOL       that undo fails every attempt (compensation_failed)
//   --pause-after TOOL     stop after that call returned, print {"event": "paused", ...}
//                          and keep heartbeating until killed
//   --order ID             the order to refund (default 4921)
//
// It prints one JSON line per run: {"run_id": ..., "status": ..., "instance": ...}.
// Its tools act on an in-memory world; the telemetry is real.

import { randomBytes } from "node:crypto";
import { parseArgs } from "node:util";
import { log, Run, Telemetry, tool } from "./saga.mjs";

class ServiceDown extends Error {
  constructor(message) {
    super(message);
    this.name = "ServiceDown";
  }
}

function world(fail, undoFail) {
  const orders = new Map([[4921, { order_id: 4921, amount: 2500, ticket_id: "T-9104" }]]);
  const tickets = new Map([["T-9104", "open"]]);
  const credits = new Map();
  const check = (name) => {
    if (name === fail) throw new ServiceDown(`${name}: service unavailable (503)`);
  };
  const checkUndo = (name) => {
    if (name === undoFail) throw new ServiceDown(`${name}: service unavailable (503)`);
  };
  return [
    tool("get_order", "read", ({ order_id }) => {
      check("get_order");
      const order = orders.get(order_id);
      if (order === undefined) throw new Error(`no order ${order_id}`);
      return { ...order };
    }),
    tool(
      "issue_credit",
      "compensable",
      ({ order_id, amount }) => {
        check("issue_credit");
        const credit_id = `cr_${order_id}_${randomBytes(3).toString("hex")}`;
        credits.set(credit_id, { order_id, amount, reversed: false });
        return { credit_id };
      },
      {
        undo: ({ args, result }) => ({
          tool: "reverse_credit",
          args: { credit_id: result.credit_id },
          description: `reverse credit ${result.credit_id} (${args.amount} cents on order ${args.order_id})`,
        }),
      },
    ),
    tool("reverse_credit", "convergent", ({ credit_id }) => {
      checkUndo("reverse_credit");
      credits.get(credit_id).reversed = true;
      return { credit_id, reversed: true };
    }),
    tool(
      "set_ticket_status",
      "reversible",
      ({ ticket_id, status }) => {
        if (status !== "open") check("set_ticket_status");
        else checkUndo("set_ticket_status");
        tickets.set(ticket_id, status);
        return status;
      },
      {
        snapshot: ({ ticket_id }) => tickets.get(ticket_id),
        undo: ({ args, snapshot }) => ({
          tool: "set_ticket_status",
          args: { status: snapshot, ticket_id: args.ticket_id },
          description: `set ticket ${args.ticket_id} back to ${snapshot}`,
        }),
      },
    ),
    tool("send_reply", "irreversible", ({ ticket_id }) => {
      check("send_reply");
      return { ticket_id, sent: true };
    }),
    tool("close_ticket", "convergent", ({ ticket_id }) => {
      check("close_ticket");
      tickets.set(ticket_id, "closed");
      return "closed";
    }),
  ];
}

function options() {
  const env = process.env;
  const { values } = parseArgs({
    options: {
      endpoint: { type: "string", default: env.OTEL_EXPORTER_OTLP_ENDPOINT },
      protocol: {
        type: "string",
        default:
          env.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL || env.OTEL_EXPORTER_OTLP_PROTOCOL || "http/protobuf",
      },
      processor: { type: "string", default: env.SAGA_SPAN_PROCESSOR || "simple" },
      "heartbeat-interval": { type: "string", default: env.SAGA_HEARTBEAT_INTERVAL_S || "1" },
      "ack-timeout-ms": { type: "string", default: env.SAGA_ACK_TIMEOUT_MS || "500" },
      fail: { type: "string" },
      "undo-fail": { type: "string" },
      "pause-after": { type: "string" },
      order: { type: "string", default: "4921" },
    },
  });
  if (!values.endpoint) {
    throw new Error("no endpoint: pass --endpoint http://127.0.0.1:4318 or set OTEL_EXPORTER_OTLP_ENDPOINT");
  }
  return values;
}

async function main() {
  let opts;
  let telemetry;
  try {
    opts = options();
    telemetry = new Telemetry({
      endpoint: opts.endpoint,
      protocol: opts.protocol,
      processor: opts.processor,
      heartbeatIntervalS: Number(opts["heartbeat-interval"]),
      ackTimeoutMs: Number(opts["ack-timeout-ms"]),
    });
  } catch (err) {
    process.stderr.write(`node_agent: ${err.message}\n`);
    process.exit(2);
  }
  const say = (doc) => process.stdout.write(`${JSON.stringify(doc)}\n`);
  telemetry.onHeartbeat = (n, ok) => say({ event: "heartbeat", n, acked: ok });

  const run = new Run(telemetry, "refund", world(opts.fail, opts["undo-fail"]));
  // A model would pick these calls; each carries the model's tool-call id.
  const callId = () => `call_${randomBytes(12).toString("base64url")}`;
  const call = async (name, args) => {
    const result = await run.call(name, args, { callId: callId() });
    if (opts["pause-after"] === name) {
      say({ event: "paused", run_id: run.runId, after: name, instance: telemetry.instanceId });
      await new Promise(() => setInterval(() => {}, 1 << 30)); // heartbeats go on; the test kills us
    }
    return result;
  };
  let error = null;
  try {
    const orderId = Number(opts.order);
    const order = await call("get_order", { order_id: orderId });
    const credit = await call("issue_credit", { order_id: orderId, amount: order.amount });
    await call("set_ticket_status", { ticket_id: order.ticket_id, status: "refunded" });
    await call("send_reply", {
      ticket_id: order.ticket_id,
      body: `We credited ${order.amount} cents (${credit.credit_id}).`,
    });
    await call("close_ticket", { ticket_id: order.ticket_id });
  } catch (err) {
    error = err;
  }
  const status = await run.end(error);
  say({ run_id: run.runId, status, instance: telemetry.instanceId });
  await telemetry.shutdown();
}

main().catch((err) => {
  log("node_agent.crashed", { error: String(err?.stack ?? err) });
  process.exit(1);
});
