// node_loop: a Node.js event loop that stalls on a known schedule and writes
// down, with process.hrtime.bigint() (CLOCK_MONOTONIC on Linux: libuv's
// uv_hrtime), exactly when each stall happened. The root integration tests
// (profiler/tests/record_native.rs) compare stallprof's stalls with this log.
//
// Usage: node --perf-basic-prof node_loop.js LOG_PATH
//
// The loop runs a 10 ms setInterval heartbeat. After ~700 ms (startup: building
// the JSON text, calibrating), every ~400 ms a setTimeout callback blocks the
// loop in one of two functions whose names the tests look for in the stacks:
//
//   deriveKey()  crypto.pbkdf2Sync (OpenSSL PBKDF2-HMAC-SHA512 in C++), ~110 ms
//   parseBig()   JSON.parse of a prebuilt ~MB string (V8's JsonParser), ~110 ms
//
// The work per call is calibrated at startup with short runs (well below any
// stall threshold), so each call lasts ~TARGET_MS on this machine.
//
// Each culprit reads the clock itself, first and last thing in its body, and
// the step builds its log record's fixed part before the call. Why: a parse
// promotes ~MBs into V8's old space, which can start incremental marking
// mid-parse; V8 then finishes it with a mark-compact (tens of ms) at the
// next JS stack check after JSON.parse returns ("finalize incremental
// marking via stack guard"), i.e. on entering the next JS function. When
// that was the step's own `end = now()`, after parseBig had returned, the
// pause ran on a stack without parseBig: a GC caused by the parse, counted
// against it (once 86% of the stall on parseBig's stacks against the test's
// 90%). Read inside parseBig, the clock call is where the pause lands, under
// parseBig's frame and within the logged call; nothing is left between
// the culprit's return and the step's end but one write(2) and a setTimeout.
//
// Log: JSON lines, each one synchronous write(2):
//   {"kind":"ready","pid":P,"tid":P,"mono_ns":NOW}
//   {"kind":"pbkdf2"|"json","func":"deriveKey"|"parseBig","seq":N,"tid":P,
//    "start_ns":..,"end_ns":..,"work":N}
//   {"kind":"done"}
// tid is the main (loop) thread's, which on Linux equals the pid.
'use strict';

const crypto = require('crypto');
const fs = require('fs');

const TICK_MS = 10;
const GAP_MS = 400; // long enough for a scavenge of the previous parse to finish first
const STARTUP_MS = 700;
const TARGET_MS = 110;
const SCHEDULE = ['pbkdf2', 'json', 'pbkdf2', 'json', 'pbkdf2', 'json', 'pbkdf2', 'json'];

const logPath = process.argv[2];
if (!logPath) {
  process.stderr.write('usage: node --perf-basic-prof node_loop.js LOG_PATH\n');
  process.exit(2);
}
const logFd = fs.openSync(logPath, 'w');
function log(obj) {
  fs.writeSync(logFd, JSON.stringify(obj) + '\n');
}
// JSON.stringify cannot write a bigint; nanosecond timestamps are spliced in
// as exact decimal numbers by hand, after `head`: the record without its
// closing brace, built before the call.
function recordHead(obj) {
  return JSON.stringify(obj).slice(0, -1);
}
function logTimes(head, times) {
  fs.writeSync(logFd, `${head},"start_ns":${times.start},"end_ns":${times.end}}\n`);
}

const now = () => process.hrtime.bigint();

// ---- the two culprits --------------------------------------------------------
// Each writes its own start/end into `times` (see the header: the GC a call
// causes must land inside it, not in the bookkeeping after it).

function deriveKey(iterations, times) {
  times.start = now();
  crypto.pbkdf2Sync('correct horse battery staple', 'salt-of-the-earth', iterations, 64, 'sha512');
  times.end = now();
}

let bigText = '';
function parseBig(text, times) {
  times.start = now();
  JSON.parse(text);
  times.end = now();
}

// ---- calibration ---------------------------------------------------------------

function makeJson(items) {
  const rows = [];
  for (let i = 0; i < items; i++) {
    rows.push({ id: i, name: 'item-' + i, tags: ['alpha', 'beta', 'gamma'], price: i * 1.25, ok: i % 3 === 0 });
  }
  return JSON.stringify(rows);
}

function msOf(fn) {
  const t = now();
  fn();
  return Number(now() - t) / 1e6;
}

// Best of a few short runs (each ~10 ms), scaled to TARGET_MS.
function calibrate() {
  const probeIter = 10000;
  let best = Infinity;
  for (let i = 0; i < 3; i++) best = Math.min(best, msOf(() => crypto.pbkdf2Sync('x', 'y', probeIter, 64, 'sha512')));
  const iterations = Math.max(1000, Math.round((probeIter * TARGET_MS) / best));

  const probeItems = 4000;
  const probeText = makeJson(probeItems);
  best = Infinity;
  for (let i = 0; i < 3; i++) best = Math.min(best, msOf(() => JSON.parse(probeText)));
  const items = Math.max(1000, Math.round((probeItems * TARGET_MS) / best));
  return { iterations, items };
}

// ---- the loop ------------------------------------------------------------------

fs.writeSync(logFd, `{"kind":"ready","pid":${process.pid},"tid":${process.pid},"mono_ns":${now()}}\n`);
const { iterations, items } = calibrate();
bigText = makeJson(items);

const heartbeat = setInterval(() => {}, TICK_MS);
let seq = 0;

function step() {
  if (seq === SCHEDULE.length) {
    setTimeout(() => {
      clearInterval(heartbeat);
      log({ kind: 'done' });
      fs.closeSync(logFd);
    }, GAP_MS);
    return;
  }
  const kind = SCHEDULE[seq];
  const pbkdf2 = kind === 'pbkdf2';
  const func = pbkdf2 ? 'deriveKey' : 'parseBig';
  const head = recordHead({ kind, func, seq, tid: process.pid, work: pbkdf2 ? iterations : bigText.length });
  const times = { start: 0n, end: 0n };
  if (pbkdf2) {
    deriveKey(iterations, times);
  } else {
    parseBig(bigText, times);
  }
  logTimes(head, times);
  seq++;
  setTimeout(step, GAP_MS);
}

setTimeout(step, STARTUP_MS);
