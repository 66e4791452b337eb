// node_timers: a Node loop serving STREAMS streams on a fixed chunk schedule
// (each a setInterval of PERIOD ms, started staggered over one period), held
// up by planned blocking sections, as in the field report's streaming
// gateway ("40 clients hold open token streams, each expecting a chunk every
// 20 ms"). The Node twin of py_timers.py, logged the same way, for
// profiler/tests/record_held_up.rs.
//
// Each stream's next chunk is one Timeout in Node's timer list of PERIOD ms.
// A repeating timer is due PERIOD ms after its previous callback began (Node
// restarts it from the loop clock read just before calling it), so a chunk's
// due time is its stream's previous callback's start + PERIOD, on the
// victim's own clock (process.hrtime.bigint(): CLOCK_MONOTONIC), and its
// lateness is when its callback began less that. When a blocking section
// holds the loop, the chunks due during it run late, each once.
//
// Usage: node node_timers.js LOG_PATH [--streams N] [--period-ms N]
//
// Timeline: ~700 ms of streaming, then the 12 blocks below, each from a
// setTimeout callback (a timer pass: the stack holds processTimers) and
// followed by ~250 ms of streaming; one block runs with every stream stopped
// (clearInterval: no timer pending); ~200 ms, exit 0.
//
// Blocks:
//   sleep  Atomics.wait (the thread blocks in futex) of 120, 300, 150, 90, 200, 100 ms
//   burn   a JavaScript loop reading the clock, 80, 200, 100, 120, 150 ms
//   idle   Atomics.wait of 120 ms while every stream is stopped: no timer is due
//
// Log (JSON lines; times are process.hrtime.bigint() ns):
//   {"kind":"ready","pid":P,"tid":P,"node":"v20.x","loop":"node","streams":N,"period_ns":..}
//   {"kind":"block","how":"sleep"|"burn"|"idle","planned_ms":..,"start_ns":..,"end_ns":..}
//   {"kind":"chunk","stream":I,"due_ns":..,"at_ns":..,"timer":true}  (after the run)
//   {"kind":"done"}
// tid is the main (loop) thread's, which on Linux equals the pid.
'use strict';

const fs = require('fs');

function arg(name, dflt) {
  const i = process.argv.indexOf(name);
  return i < 0 ? dflt : Number(process.argv[i + 1]);
}

const logPath = process.argv[2];
if (!logPath) {
  process.stderr.write('usage: node node_timers.js LOG_PATH [--streams N] [--period-ms N]\n');
  process.exit(2);
}
const STREAMS = arg('--streams', 40);
const PERIOD_MS = arg('--period-ms', 20);
const PERIOD_NS = BigInt(PERIOD_MS) * 1000000n;

// As py_timers.py: eleven blocks that delay chunks and the stopped one.
const BLOCKS = [
  ['sleep', 120],
  ['burn', 80],
  ['sleep', 300],
  ['burn', 200],
  ['idle', 120],
  ['sleep', 150],
  ['burn', 100],
  ['sleep', 90],
  ['burn', 120],
  ['sleep', 200],
  ['burn', 150],
  ['sleep', 100],
];

const logFd = fs.openSync(logPath, 'w');
// Nanosecond times are bigints, written as exact decimals.
function log(fields) {
  const parts = Object.entries(fields).map(
    ([k, v]) => `${JSON.stringify(k)}:${typeof v === 'bigint' ? v.toString() : JSON.stringify(v)}`,
  );
  fs.writeSync(logFd, `{${parts.join(',')}}\n`);
}

const now = () => process.hrtime.bigint();
const waiter = new Int32Array(new SharedArrayBuffer(4));

function sleep(ms) {
  Atomics.wait(waiter, 0, 0, ms);
}

function burn(ms) {
  const end = now() + BigInt(ms) * 1000000n;
  let n = 0;
  while (now() < end) n++;
  return n;
}

const chunks = []; // [stream, due, at]
let streams = [];

function startStreams() {
  const t0 = now();
  streams = [];
  for (let i = 0; i < STREAMS; i++) {
    const s = { timer: null, last: 0n, starter: null };
    // Staggered over one period, so chunks come due all the time.
    s.starter = setTimeout(() => {
      s.starter = null;
      s.last = now();
      s.timer = setInterval(() => {
        const at = now();
        chunks.push([i, s.last + PERIOD_NS, at]);
        s.last = at;
      }, PERIOD_MS);
    }, Math.floor((PERIOD_MS * i) / STREAMS));
    streams.push(s);
  }
  return t0;
}

function stopStreams() {
  for (const s of streams) {
    if (s.starter) clearTimeout(s.starter);
    if (s.timer) clearInterval(s.timer);
  }
  streams = [];
}

log({
  kind: 'ready',
  pid: process.pid,
  tid: process.pid,
  node: process.version,
  loop: 'node',
  streams: STREAMS,
  period_ns: PERIOD_NS,
});
startStreams();

let next = 0;
function step() {
  if (next >= BLOCKS.length) {
    stopStreams();
    setTimeout(finish, 200);
    return;
  }
  const [how, ms] = BLOCKS[next++];
  if (how === 'idle' && streams.length > 0) {
    // Stop every stream, let the loop go quiet, then block.
    stopStreams();
    next--;
    BLOCKS[next] = ['idle-now', ms];
    setTimeout(step, 4 * PERIOD_MS);
    return;
  }
  const t0 = now();
  if (how === 'burn') burn(ms);
  else sleep(ms);
  const t1 = now();
  log({ kind: 'block', how: how === 'idle-now' ? 'idle' : how, planned_ms: ms, start_ns: t0, end_ns: t1 });
  if (streams.length === 0) startStreams();
  setTimeout(step, 250);
}

function finish() {
  for (const [i, due, at] of chunks) {
    log({ kind: 'chunk', stream: i, due_ns: due, at_ns: at, timer: true });
  }
  log({ kind: 'done' });
  fs.closeSync(logFd);
}

setTimeout(step, 700);
