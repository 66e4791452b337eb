// A traced express victim: an express 5 service instrumented with
// OpenTelemetry the usual way for a CommonJS app — the SDK's tracer
// provider (its AsyncLocalStorage context manager) and the http and
// express instrumentations registered before express is loaded — started
// with no Node flags: `node traced.cjs LOG_PATH`. Packages pinned by
// package.json / package-lock.json here (installed by `cargo xtask test`).
//
// Its one handler, GET /digest/:n, blocks the loop in crypto.pbkdf2Sync
// (native CPU under node:crypto) inside the request's server span and the
// express instrumentation's wrapper of the handler. The handler reads
// process.hrtime.bigint() (CLOCK_MONOTONIC) first and last, and logs the
// span its own SDK says is active: the trace stallprof cannot read from
// a Node process, and must say so (tests/record_express.rs).
//
// Log: JSON lines, each one synchronous write(2):
//   {"kind":"ready","pid":P,"tid":P,"port":N}
//   {"kind":"cpu","func":"digest","seq":N,"tid":P,"path":"/digest/3",
//    "method":"GET","route":"/digest/:n","trace_id":"…","span_id":"…",
//    "start_ns":..,"end_ns":..,"cpu_ns":..}
//   {"kind":"done"}
'use strict';

const { NodeTracerProvider } = require('@opentelemetry/sdk-trace-node');
const { registerInstrumentations } = require('@opentelemetry/instrumentation');
const { HttpInstrumentation } = require('@opentelemetry/instrumentation-http');
const { ExpressInstrumentation } = require('@opentelemetry/instrumentation-express');

// Spans are made and ended; no exporter sends them anywhere.
new NodeTracerProvider().register();
registerInstrumentations({
  instrumentations: [new HttpInstrumentation(), new ExpressInstrumentation()],
});

const fs = require('node:fs');
const crypto = require('node:crypto');
const path = require('node:path');
const { spawn } = require('node:child_process');
const { trace } = require('@opentelemetry/api');
const express = require('express');

const TARGET_MS = 110;
const GAP_MS = 300;
const ROUNDS = 3;
const LINGER_MS = 3000;

const logPath = process.argv[2];
if (!logPath) {
  process.stderr.write('usage: node traced.cjs LOG_PATH\n');
  process.exit(2);
}
const logFd = fs.openSync(logPath, 'w');
const log = (obj) => fs.writeSync(logFd, JSON.stringify(obj) + '\n');
const now = () => process.hrtime.bigint();

// Iterations of pbkdf2 taking ~TARGET_MS of CPU here (the best of 3).
function calibrate() {
  const probe = 20000;
  let best = Infinity;
  for (let i = 0; i < 3; i++) {
    const c = process.cpuUsage();
    crypto.pbkdf2Sync('probe', 'salt', probe, 32, 'sha256');
    const d = process.cpuUsage(c);
    best = Math.min(best, (d.user + d.system) / 1000);
  }
  return Math.max(probe, Math.round((probe * TARGET_MS) / best));
}
const iterations = calibrate();

let seq = 0;
function digest(req, res) {
  const cpu = process.cpuUsage();
  const start = now();
  const key = crypto.pbkdf2Sync(`secret-${req.params.n}`, 'salt', iterations, 32, 'sha256');
  res.json({ key: key.toString('hex') });
  const end = now();
  const d = process.cpuUsage(cpu);
  const span = trace.getActiveSpan()?.spanContext();
  fs.writeSync(
    logFd,
    `{"kind":"cpu","func":"digest","seq":${seq++},"tid":${process.pid},` +
      `"path":"${req.originalUrl}","method":"${req.method}",` +
      `"route":"${req.baseUrl + req.route.path}",` +
      `"trace_id":"${span?.traceId ?? ''}","span_id":"${span?.spanId ?? ''}",` +
      `"start_ns":${start},"end_ns":${end},"cpu_ns":${(d.user + d.system) * 1000}}\n`
  );
}

const app = express();
app.use(express.json());
app.get('/digest/:n', digest);
app.post('/warmup', (req, res) => res.json({ ok: req.body?.ok === true }));

const server = app.listen(0, '127.0.0.1', () => {
  const { port } = server.address();
  log({ kind: 'ready', pid: process.pid, tid: process.pid, port });
  const client = path.join(__dirname, 'client.js');
  const child = spawn(
    process.execPath,
    [client, String(port), String(ROUNDS), String(GAP_MS), '/digest/1', '/digest/2'],
    { stdio: ['ignore', 'ignore', 'inherit'] }
  );
  child.on('exit', (code) => {
    log(code === 0 ? { kind: 'done' } : { kind: 'error', what: `client exited ${code}` });
    setTimeout(() => {
      server.close();
      server.closeAllConnections?.();
      fs.closeSync(logFd);
    }, LINGER_MS);
  });
});
