// A small saga runner for Node.js that emits the saga span contract
// (docs/semantic-conventions.md, contract version 1) with the official
// OpenTelemetry JS SDK, so the saga sidecar can follow its runs, alert on an
// unwind, serve the compensation stack and page when the process dies.
//
// The recipe (docs/other-languages.md):
// * one `service.instance.id` per process (the JS SDK sets none);
// * every successful write pushes the exact undo ({step, index, tool, args,
//   description}) and the run waits until the sidecar acknowledged the span
//   before the next step: `forceFlush()` on the provider, bounded;
// * on failure before the pivot: an `unwind` span (acknowledged), then the
//   undos in reverse, each successful one acknowledged; past the pivot the run
//   ends `stuck` and escalates;
// * a `saga.heartbeat` span every interval while a run is open, each flushed
//   at once, so a BatchSpanProcessor never holds heartbeats back;
// * the `run` span when the run ends, flushed;
// * a span the sidecar rejects (OTLP partial success) is a failed ack, never
//   a silent success, and the saga spans are never truncated by the SDK's
//   attribute limits.

import { randomUUID } from "node:crypto";
import { diag, DiagLogLevel, ROOT_CONTEXT, SpanStatusCode, trace } from "@opentelemetry/api";
import { ExportResultCode } from "@opentelemetry/core";
import { OTLPTraceExporter as GrpcExporter } from "@opentelemetry/exporter-trace-otlp-grpc";
import { OTLPTraceExporter as JsonExporter } from "@opentelemetry/exporter-trace-otlp-http";
import { OTLPTraceExporter as ProtoExporter } from "@opentelemetry/exporter-trace-otlp-proto";
import { defaultResource, resourceFromAttributes } from "@opentelemetry/resources";
import {
  BasicTracerProvider,
  BatchSpanProcessor,
  SimpleSpanProcessor,
} from "@opentelemetry/sdk-trace-base";

export const CONTRACT_VERSION = 1;
export const PROTOCOLS = ["http/protobuf", "http/json", "grpc"];
export const PROCESSORS = ["simple", "batch"];
const CLASSES = ["read", "convergent", "reversible", "compensable", "irreversible"];
// The SDK's default attribute count: far above the ~15 a saga span carries.
const SPAN_ATTRIBUTE_COUNT = 128;
// The JS SDK's standard limits that would cut or drop saga attributes.
const LIMIT_VARIABLES = [
  "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
  "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
  "OTEL_ATTRIBUTE_COUNT_LIMIT",
  "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
];

/** One JSON line on stderr: the agent's own log (telemetry problems never throw). */
export function log(event, fields = {}) {
  process.stderr.write(`${JSON.stringify({ event, ...fields })}\n`);
}

const MAX_MESSAGE = 500; // characters of a sidecar's message kept in a log line
const bounded = (text) => (text.length > MAX_MESSAGE ? `${text.slice(0, MAX_MESSAGE)}...` : text);

// The JS OTLP exporters resolve an export as SUCCESS when the receiver answers
// with a partial success (spans rejected) and say so only through `diag`, at
// WARN, with this message and the partialSuccess as JSON; diag logs nothing
// unless a logger is registered. The exporter handles the response and calls
// back in one synchronous step, so the partial success seen here belongs to
// the export whose callback runs next. A microtask clears it: one from another
// exporter in the process (which no AckingExporter takes) is not kept for a
// later export, unless that export's answer is handled in the same turn.
const PARTIAL_SUCCESS = "Received Partial Success response:";
let partialSuccess = null; // {rejected, message} until the exporter's callback takes it

/**
 * Take the exporter's partial-success diag message; false for any other.
 * diag has one logger per process: an app that registers its own calls this
 * from its `warn` (the example registers `SagaDiagLogger`).
 */
export function catchPartialSuccess(message, args) {
  if (message !== PARTIAL_SUCCESS) return false;
  let doc = {};
  try {
    doc = JSON.parse(String(args[0])) ?? {};
  } catch {
    // not JSON: counted as rejecting nothing
  }
  // int64 arrives as a number (protobuf) or, in OTLP/JSON, possibly as a string.
  const seen = {
    rejected: Number(doc.rejectedSpans ?? 0) || 0,
    message: String(doc.errorMessage ?? ""),
  };
  partialSuccess = seen;
  queueMicrotask(() => {
    if (partialSuccess === seen) partialSuccess = null;
  });
  return true;
}

/** A diag logger (WARN and above) that takes the partial success and drops the rest, as before. */
class SagaDiagLogger {
  warn(message, ...args) {
    catchPartialSuccess(message, args);
  }
  error() {}
  info() {}
  debug() {}
  verbose() {}
}

let diagRegistered = false;

// Failed spans kept for their acks: an ack that timed out never takes its own.
const MAX_FAILED_SPANS = 1024;

/**
 * Wraps an exporter to remember which spans were not acknowledged: a failed
 * export, or a partial success that rejected spans of the request (OTLP does
 * not say which: every span of it counts as failed).
 */
class AckingExporter {
  constructor(inner) {
    this.inner = inner;
    this.failed = new Map(); // span id -> {failure, name}; oldest first
  }
  export(spans, done) {
    this.inner.export(spans, (result) => {
      const partial = partialSuccess;
      partialSuccess = null;
      let failure = null;
      if (result.code !== ExportResultCode.SUCCESS) {
        const error = String(result.error?.message ?? result.error ?? "export failed");
        failure = { reason: "error", error };
      } else if (partial !== null && partial.rejected > 0) {
        // The sidecar refused spans of this request: it did not store them, so no ack.
        failure = {
          reason: "rejected",
          error: bounded(partial.message || `${partial.rejected} span(s) rejected`),
          rejected: partial.rejected,
        };
      }
      if (failure !== null) {
        for (const span of spans) {
          this.failed.set(span.spanContext().spanId, { failure, name: span.name });
          if (this.failed.size > MAX_FAILED_SPANS) {
            this.failed.delete(this.failed.keys().next().value);
          }
        }
      }
      done(result);
    });
  }
  /** The first failure among `spans` (forgotten once taken) and the names of the failed ones. */
  take(spans) {
    let failure = null;
    const names = [];
    for (const span of spans) {
      const id = span.spanContext().spanId;
      const found = this.failed.get(id);
      if (found === undefined) continue;
      this.failed.delete(id);
      failure ??= found.failure;
      names.push(found.name);
    }
    return failure === null ? null : { ...failure, spans: names.slice(0, 10) };
  }
  shutdown() {
    return this.inner.shutdown();
  }
  forceFlush() {
    return this.inner.forceFlush ? this.inner.forceFlush() : Promise.resolve();
  }
}

function exporterFor(protocol, endpoint) {
  const base = endpoint.replace(/\/+$/, "");
  if (protocol === "grpc") return new GrpcExporter({ url: base });
  if (protocol === "http/json") return new JsonExporter({ url: `${base}/v1/traces` });
  if (protocol === "http/protobuf") return new ProtoExporter({ url: `${base}/v1/traces` });
  throw new Error(`unknown OTLP protocol ${JSON.stringify(protocol)}: use one of ${PROTOCOLS.join(", ")}`);
}

/**
 * The process's telemetry: provider, tracer, acks and heartbeats.
 * `processor`: "simple" (each span sent as it ends) or "batch" (the SDK's
 * default, 5 s delay): both are safe because the runner flushes at every point
 * the contract orders.
 */
export class Telemetry {
  constructor({
    endpoint,
    protocol = "http/protobuf",
    processor = "simple",
    serviceName = "refund-agent-node",
    instanceId = randomUUID(),
    heartbeatIntervalS = 1.0,
    ackTimeoutMs = 500,
  }) {
    if (!PROCESSORS.includes(processor)) {
      throw new Error(`unknown span processor ${JSON.stringify(processor)}: use simple or batch`);
    }
    if (!(heartbeatIntervalS > 0)) {
      throw new Error(`heartbeat interval ${heartbeatIntervalS} must be > 0 seconds (default 1)`);
    }
    if (!diagRegistered) {
      // WARN: the level of the exporters' partial-success message.
      diag.setLogger(new SagaDiagLogger(), DiagLogLevel.WARN);
      diagRegistered = true;
    }
    this.exporter = new AckingExporter(exporterFor(protocol, endpoint));
    const spanProcessor =
      processor === "batch"
        ? new BatchSpanProcessor(this.exporter) // SDK defaults: 5 s delay, 512 per batch
        : new SimpleSpanProcessor(this.exporter);
    this.instanceId = instanceId;
    this.provider = new BasicTracerProvider({
      resource: defaultResource().merge(
        resourceFromAttributes({
          "service.name": serviceName,
          // The JS SDK sets no instance id: without one, two processes look like one
          // to the sidecar and a dead one is never noticed while the other lives.
          "service.instance.id": instanceId,
          "process.pid": process.pid,
        }),
      ),
      spanProcessors: [spanProcessor],
      // Saga spans are never cut: a truncated undo, stack or run id is rejected by the
      // sidecar (or names another run). Given here, these win over the environment's.
      spanLimits: {
        attributeValueLengthLimit: Infinity,
        attributeCountLimit: SPAN_ATTRIBUTE_COUNT,
      },
    });
    for (const name of LIMIT_VARIABLES) {
      if (process.env[name]) {
        log("saga.configure.warning", {
          variable: name,
          value: bounded(process.env[name]),
          why: "saga spans are never truncated: this provider sets its own span limits",
        });
      }
    }
    this.tracer = this.provider.getTracer("saga-otel-node-agent", "0.1.0");
    this.heartbeatIntervalS = heartbeatIntervalS;
    this.ackTimeoutMs = ackTimeoutMs;
    this.openRuns = new Set();
    this.heartbeats = 0;
    this.onHeartbeat = null;
    this.timer = null;
  }

  /**
   * Wait until every ended span was exported, at most ackTimeoutMs, and say
   * whether the sidecar took `spans`, the ones this ack stands for (another
   * span's failure fails that span's ack); a miss is logged, the run goes on.
   */
  async ack(what, spans) {
    let timer;
    const bound = new Promise((resolve) => {
      timer = setTimeout(() => resolve(false), this.ackTimeoutMs);
    });
    let failure = null;
    try {
      const flushed = await Promise.race([this.provider.forceFlush().then(() => true), bound]);
      failure = flushed
        ? this.exporter.take(spans)
        : { reason: "timeout", error: `no ack within ${this.ackTimeoutMs} ms` };
    } catch (err) {
      // A batch processor's flush fails with any failed batch, maybe before ours is done.
      failure = this.exporter.take(spans) ?? { reason: "error", error: String(err) };
    } finally {
      clearTimeout(timer);
    }
    if (failure !== null) log("saga.export.failed", { reason: failure.reason, what, ...failure });
    return failure === null;
  }

  openRun(runId) {
    this.openRuns.add(runId);
    if (this.timer === null) {
      this.beat(); // at once: the sidecar watches this instance from the first step
      this.timer = setInterval(() => this.beat(), this.heartbeatIntervalS * 1000);
    }
  }

  closeRun(runId) {
    this.openRuns.delete(runId);
    if (this.openRuns.size === 0 && this.timer !== null) {
      clearInterval(this.timer);
      this.timer = null;
    }
  }

  /** One heartbeat: its own trace root, flushed at once (never left in a batch). */
  beat() {
    const span = this.tracer.startSpan(
      "saga.heartbeat",
      {
        root: true,
        attributes: {
          "saga.contract.version": CONTRACT_VERSION,
          "saga.phase": "heartbeat",
          "saga.heartbeat.open_runs": [...this.openRuns].sort(),
          "saga.heartbeat.interval_s": this.heartbeatIntervalS,
        },
      },
      ROOT_CONTEXT,
    );
    span.end();
    this.heartbeats += 1;
    const n = this.heartbeats;
    this.ack("heartbeat", [span]).then((ok) => this.onHeartbeat?.(n, ok));
  }

  async shutdown() {
    if (this.timer !== null) clearInterval(this.timer);
    this.timer = null;
    try {
      await this.provider.shutdown();
    } catch (err) {
      log("saga.export.failed", { reason: "error", what: "shutdown", error: String(err) });
    }
  }
}

/**
 * A tool: `fn(args)` does the work; `cls` is its class; for reversible and
 * compensable tools `undo({args, result, snapshot})` returns
 * `{tool, args, description}`, the exact operation that undoes it, and
 * `snapshot(args)` reads what a reversible write overwrites.
 */
export function tool(name, cls, fn, { undo = null, snapshot = null } = {}) {
  if (!CLASSES.includes(cls)) throw new Error(`tool ${name}: class ${cls} is not one of ${CLASSES}`);
  return { name, cls, fn, undo, snapshot };
}

const errorType = (err) => err?.name || err?.constructor?.name || "Error";
const describe = (err) => `${errorType(err)}: ${err?.message ?? String(err)}`;

/** One run of a saga: call tools through it; `end(err)` unwinds or closes it. */
export class Run {
  constructor(telemetry, sagaName, tools) {
    this.tel = telemetry;
    this.saga = sagaName;
    this.tools = new Map(tools.map((t) => [t.name, t]));
    this.span = telemetry.tracer.startSpan(`saga.run ${sagaName}`, { root: true }, ROOT_CONTEXT);
    this.runId = this.span.spanContext().traceId; // the default run id: the trace id, 32 hex
    this.ctx = trace.setSpan(ROOT_CONTEXT, this.span);
    this.stack = []; // top last: {step, index, tool, args, description}
    this.done = [];
    this.undone = [];
    this.notUndone = [];
    this.pivot = null;
    this.nextIndex = 0;
    this.failedStep = null;
    this.status = null;
    this.unacked = []; // spans ended since the run's last ack
    this.span.setAttributes(this.identity("run"));
    telemetry.openRun(this.runId);
  }

  identity(phase) {
    return {
      "saga.run.id": this.runId,
      "saga.name": this.saga,
      "saga.contract.version": CONTRACT_VERSION,
      "saga.phase": phase,
    };
  }

  /** End a span of the run: its next ack stands for it. */
  finish(span) {
    span.end();
    this.unacked.push(span);
  }

  /** Wait for the sidecar's ack of every span the run ended since its last ack. */
  ack(what) {
    const spans = this.unacked;
    this.unacked = [];
    return this.tel.ack(what, spans);
  }

  child(name, attributes) {
    return this.tel.tracer.startSpan(name, { attributes }, this.ctx);
  }

  /**
   * Run one tool call as a `do` span. `callId` is the model's tool-call id
   * (`gen_ai.tool.call.id`), when the call came from a model.
   */
  async call(name, args, { callId = null } = {}) {
    const t = this.tools.get(name);
    if (t === undefined) throw new Error(`unknown tool ${name}: register it in the saga's tools`);
    const index = this.nextIndex++;
    const attrs = {
      ...this.identity("do"),
      "saga.step.name": name,
      "saga.step.index": index,
      "saga.step.class": t.cls,
      "saga.step.attempt": 1,
      "saga.step.pivot": t.cls === "irreversible",
      "gen_ai.operation.name": "execute_tool",
      "gen_ai.tool.name": name,
    };
    if (callId !== null) attrs["gen_ai.tool.call.id"] = callId;
    const span = this.child(`saga.do ${name}`, attrs);
    let result;
    try {
      const snapshot = t.snapshot ? await t.snapshot(args) : undefined;
      result = await t.fn(args);
      if (t.undo) {
        const u = t.undo({ args, result, snapshot });
        const comp = { step: name, index, tool: u.tool, args: u.args, description: u.description };
        this.stack.push(comp);
        span.setAttributes({
          "saga.compensation.tool": comp.tool,
          "saga.compensation.args": JSON.stringify(comp.args),
          "saga.compensation.description": comp.description,
        });
      }
      span.setStatus({ code: SpanStatusCode.OK });
    } catch (err) {
      this.failedStep = name;
      span.recordException(err);
      span.setAttribute("error.type", errorType(err));
      span.setStatus({ code: SpanStatusCode.ERROR, message: describe(err) });
      this.finish(span);
      throw err;
    }
    this.finish(span);
    this.done.push(name);
    if (t.cls === "irreversible") this.pivot = name;
    // Durability: the undo is at the sidecar before the next step starts.
    if (t.undo) await this.ack(`do ${name}`);
    return result;
  }

  /** End the run: `err` null closes it completed; otherwise unwind (or stuck past the pivot). */
  async end(err = null) {
    let escalation = null;
    if (err === null) {
      this.status = "completed";
    } else if (this.pivot !== null) {
      this.status = "stuck";
      this.notUndone = this.stack.map((c) => c.description);
      escalation = "stuck";
    } else {
      await this.unwind(err);
      this.status = this.notUndone.length ? "compensation_failed" : "compensated";
      if (this.notUndone.length) escalation = "compensation_failed";
    }
    const failedStep = err === null ? null : (this.failedStep ?? "(agent)");
    if (escalation !== null) this.escalate(escalation, failedStep, err);
    this.span.setAttribute("saga.run.status", this.status);
    if (failedStep !== null) this.span.setAttribute("saga.run.failed_step", failedStep);
    this.span.setStatus(
      this.status === "completed"
        ? { code: SpanStatusCode.OK }
        : { code: SpanStatusCode.ERROR, message: describe(err) },
    );
    this.finish(this.span);
    await this.ack("run");
    this.tel.closeRun(this.runId);
    return this.status;
  }

  async unwind(err) {
    const top = [...this.stack].reverse();
    const unwind = this.child(`saga.unwind ${this.saga}`, {
      ...this.identity("unwind"),
      "saga.unwind.reason": describe(err),
      "saga.run.failed_step": this.failedStep ?? "(agent)",
      "saga.stack": JSON.stringify(top),
    });
    this.finish(unwind); // zero duration: the instant unwinding begins
    await this.ack("unwind"); // the sidecar alerts before the first undo runs
    for (const comp of top) {
      if (await this.compensate(comp)) this.undone.push(comp.description);
      else this.notUndone.push(comp.description);
    }
  }

  async compensate(comp, attempts = 3) {
    const t = this.tools.get(comp.tool);
    for (let attempt = 1; attempt <= attempts; attempt++) {
      const span = this.child(`saga.compensate ${comp.step}`, {
        ...this.identity("compensate"),
        "saga.step.name": comp.step,
        "saga.step.index": comp.index,
        "saga.step.attempt": attempt,
        "saga.compensation.tool": comp.tool,
        "saga.compensation.args": JSON.stringify(comp.args),
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": comp.tool,
      });
      try {
        if (t === undefined) throw new Error(`unknown undo tool ${comp.tool}`);
        await t.fn(comp.args);
        span.setStatus({ code: SpanStatusCode.OK });
        this.finish(span);
        // A recovery elsewhere never repeats an undo the sidecar has seen done.
        await this.ack(`compensate ${comp.step}`);
        return true;
      } catch (e) {
        span.recordException(e);
        span.setAttribute("error.type", errorType(e));
        span.setStatus({ code: SpanStatusCode.ERROR, message: describe(e) });
        this.finish(span);
        if (attempt < attempts) await new Promise((r) => setTimeout(r, 50 * 2 ** attempt));
      }
    }
    return false;
  }

  escalate(reason, failedStep, err) {
    const card = {
      saga: this.saga,
      run_id: this.runId,
      reason,
      failed_step: failedStep,
      error: err === null ? null : describe(err),
      done: this.done,
      undone: this.undone,
      not_undone: this.notUndone,
      irreversible: this.pivot === null ? [] : [this.pivot],
      decide:
        reason === "stuck"
          ? [`finish or undo by hand: the run crossed its pivot (${this.pivot})`]
          : ["undo by hand what the stack still holds"],
    };
    const span = this.child(`saga.escalate ${this.saga}`, {
      ...this.identity("escalate"),
      "saga.escalation.reason": reason,
      "saga.escalation.card": JSON.stringify(card),
    });
    this.finish(span);
  }
}
