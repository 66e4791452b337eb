// express victim: an express 5 service, installed from npm at pinned
// versions (package.json + package-lock.json here; `cargo xtask test`
// runs `npm ci` into target/express-victim), started with no Node flags:
// `node app.js LOG_PATH`. An ES module (package.json "type": "module")
// importing CommonJS (express, bcryptjs) and ESM (js-yaml) packages.
//
// Its handlers block the loop, each in a different way:
//
//   POST /signup        hashPassword:   bcryptjs.hashSync -- pure-JS CPU in a
//                                       library's hot code (optimized by V8)
//   POST /config        parseConfig:    js-yaml's load of a large document --
//                                       pure-JS CPU over many library functions
//   GET  /api/report/:period
//                       compressReport: zlib.gzipSync -- sync native code
//                                       under node:zlib's JavaScript
//   GET  /api/lock      waitForLock:    Atomics.wait on a SharedArrayBuffer --
//                                       off-CPU (a futex) on the loop thread
//
// The last two are served by a router mounted on /api, the first by a
// route with a parameter: a route's template (req.baseUrl +
// req.route.path) is not the path requested.
//
// Each handler reads process.hrtime.bigint() (CLOCK_MONOTONIC on Linux)
// first and last thing in its body, around its blocking call and its reply
// (a GC the call's garbage causes in res.json then lands inside the logged
// interval), and logs it: the ground truth the test
// (profiler/tests/record_express.rs) compares stallprof's stalls with.
//
// Timeline: calibrate (~0.5 s of CPU, so each call takes ~TARGET_MS on this
// machine), listen on 127.0.0.1 (a port of its own), then a client (a child
// node process, client.js) sends one warm-up request and ROUNDS x the four
// requests, one at a time, GAP_MS apart; when it exits the server logs "done", idles LINGER_MS (the
// agent still reads JavaScript names from this process's memory) and exits.
//
// Log: JSON lines, each one synchronous write(2):
//   {"kind":"ready","pid":P,"tid":P,"port":N,"node":"v20..."}
//   {"kind":"cpu"|"sleep","func":F,"seq":N,"tid":P,"path":"/api/report/daily",
//    "method":"GET","route":"/api/report/:period",
//    "start_ns":..,"end_ns":..,"cpu_ns":..}
//   {"kind":"done"}
// cpu_ns is the process's CPU time over the call (process.cpuUsage).

import fs from 'node:fs';
import zlib from 'node:zlib';
import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import express from 'express';
import bcrypt from 'bcryptjs';
import * as yaml from 'js-yaml';

const TARGET_MS = 110;
const GAP_MS = 300;
const ROUNDS = 3;
const LINGER_MS = 3000;

const logPath = process.argv[2];
if (!logPath) {
  process.stderr.write('usage: node app.js LOG_PATH\n');
  process.exit(2);
}
const logFd = fs.openSync(logPath, 'w');
const log = (obj) => fs.writeSync(logFd, JSON.stringify(obj) + '\n');
const now = () => process.hrtime.bigint();

let seq = 0;
// The request as the handler served it: the path requested, and the
// route express matched (what stallprof should say).
function record(kind, func, req, start, end, cpu) {
  const d = process.cpuUsage(cpu);
  const route = req.baseUrl + req.route.path;
  fs.writeSync(
    logFd,
    `{"kind":"${kind}","func":"${func}","seq":${seq++},"tid":${process.pid},` +
      `"path":"${req.originalUrl}","method":"${req.method}","route":"${route}",` +
      `"start_ns":${start},"end_ns":${end},"cpu_ns":${(d.user + d.system) * 1000}}\n`
  );
}

// ---- the work, sized by calibrate() --------------------------------------------

function makeYaml(services) {
  const out = ['services:'];
  for (let i = 0; i < services; i++) {
    out.push(
      `  - name: svc-${i}`,
      `    image: "registry.local/team/svc-${i}:1.${i % 17}.${i % 5}"`,
      `    replicas: ${1 + (i % 4)}`,
      `    env: { LOG_LEVEL: info, REGION: eu-west-${i % 3}, FEATURE_${i}: true }`,
      `    ports: [${8000 + i}, ${9000 + i}]`,
      '    health:',
      `      path: /healthz/${i}`,
      `      interval: ${5 + (i % 10)}s`
    );
  }
  return out.join('\n') + '\n';
}

function makeReport(kib) {
  const words = ['alpha', 'beta', 'gamma', 'delta', 'latency', 'p99', 'error', 'ok'];
  const parts = [];
  let n = 0;
  let x = 12345;
  while (n < kib * 1024) {
    x = (x * 1103515245 + 12345) & 0x7fffffff;
    const line = `${x % 100000} ${words[x % 8]} ${(x >> 3) % 9999} ${words[(x >> 7) % 8]}\n`;
    parts.push(line);
    n += line.length;
  }
  return Buffer.from(parts.join(''));
}

// CPU time, not wall time (an agent attaching competes for the CPU).
function msOf(fn) {
  const c = process.cpuUsage();
  fn();
  const d = process.cpuUsage(c);
  return (d.user + d.system) / 1000;
}

function calibrate() {
  // bcrypt: 2^rounds; the smallest cost taking >= 8 ms, hashed `times` times.
  let rounds = 4;
  let one = 0;
  for (; rounds < 14; rounds++) {
    const salt = bcrypt.genSaltSync(rounds);
    one = Infinity;
    for (let i = 0; i < 2; i++) one = Math.min(one, msOf(() => bcrypt.hashSync('probe', salt)));
    if (one >= 8) break;
  }
  // The first hashes at a cost run before V8 has optimized bcryptjs: more
  // at the chosen cost, the best of them (with the best of 2 alone a
  // fresh-clone run's hashPassword took 37 ms of its plan).
  const salt = bcrypt.genSaltSync(rounds);
  for (let i = 0; i < 4; i++) one = Math.min(one, msOf(() => bcrypt.hashSync('probe', salt)));
  const hashes = Math.max(1, Math.round(TARGET_MS / one));

  // js-yaml speeds up ~2x once V8 optimizes it: the best of several runs.
  const probe = makeYaml(300);
  let best = Infinity;
  for (let i = 0; i < 10; i++) best = Math.min(best, msOf(() => yaml.load(probe)));
  let services = Math.max(300, Math.round((300 * TARGET_MS) / best));
  // A larger document costs more than in proportion (its garbage): once
  // more at the planned size, the best of 4 (V8 keeps optimizing js-yaml: with
  // the best of 2 one call in a fresh-clone run took 38 ms of a planned 110).
  const full = makeYaml(services);
  best = Infinity;
  for (let i = 0; i < 4; i++) best = Math.min(best, msOf(() => yaml.load(full)));
  services = Math.max(300, Math.round((services * TARGET_MS) / best));

  const sample = makeReport(256);
  best = Infinity;
  for (let i = 0; i < 3; i++) best = Math.min(best, msOf(() => zlib.gzipSync(sample, { level: 9 })));
  const kib = Math.max(256, Math.round((256 * TARGET_MS) / best));
  return { salt: bcrypt.genSaltSync(rounds), hashes, config: makeYaml(services), report: makeReport(kib) };
}

const work = calibrate();
const lock = new Int32Array(new SharedArrayBuffer(4));

// ---- the handlers --------------------------------------------------------------

function hashPassword(req, res) {
  const password = req.body?.password ?? 'correct horse battery staple';
  const cpu = process.cpuUsage();
  const start = now();
  let hash = '';
  for (let i = 0; i < work.hashes; i++) hash = bcrypt.hashSync(password, work.salt);
  res.json({ hash });
  const end = now();
  record('cpu', 'hashPassword', req, start, end, cpu);
}

function parseConfig(req, res) {
  const cpu = process.cpuUsage();
  const start = now();
  const doc = yaml.load(work.config);
  res.json({ services: doc.services.length });
  const end = now();
  record('cpu', 'parseConfig', req, start, end, cpu);
}

function compressReport(req, res) {
  const cpu = process.cpuUsage();
  const start = now();
  const gz = zlib.gzipSync(work.report, { level: 9 });
  res.json({ bytes: gz.length });
  const end = now();
  record('cpu', 'compressReport', req, start, end, cpu);
}

function waitForLock(req, res) {
  const cpu = process.cpuUsage();
  const start = now();
  // Nobody notifies: the wait times out, the loop thread asleep in a futex.
  Atomics.wait(lock, 0, 0, TARGET_MS);
  res.json({ waited: true });
  const end = now();
  record('sleep', 'waitForLock', req, start, end, cpu);
}

const app = express();
app.use(express.json());
app.post('/signup', hashPassword);
app.post('/config', parseConfig);
const api = express.Router();
api.get('/report/:period', compressReport);
api.get('/lock', waitForLock);
app.use('/api', api);
// What a deployment's warm-up request reaches before traffic: a JSON body
// through express.json() and a JSON reply. The first of each loads code
// lazily from disk (body-parser has iconv-lite load its encoding tables; the
// first Date header has ICU load its time zone data): from a cold page cache
// on a fresh CI machine that took ~100 ms of reads, in the first /signup's
// stall, whose culprit then was the loading, not the handler. Not logged.
app.post('/warmup', (req, res) => res.json({ ok: req.body?.ok === true }));

const server = app.listen(0, '127.0.0.1', () => {
  const { port } = server.address();
  log({ kind: 'ready', pid: process.pid, tid: process.pid, port, node: process.version });
  const client = fileURLToPath(new URL('./client.js', import.meta.url));
  const child = spawn(process.execPath, [client, String(port), String(ROUNDS), String(GAP_MS)], {
    stdio: ['ignore', 'ignore', 'inherit'],
  });
  child.on('exit', (code) => {
    log(code === 0 ? { kind: 'done' } : { kind: 'error', what: `client exited ${code}` });
    setTimeout(() => {
      server.close();
      server.closeAllConnections?.();
      fs.closeSync(logFd);
    }, LINGER_MS);
  });
});
