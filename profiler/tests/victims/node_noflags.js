// node_noflags: a Node.js event loop, started with NO flags, that stalls on a
// known schedule in four user functions and writes down, with
// process.hrtime.bigint() (CLOCK_MONOTONIC on Linux: libuv's uv_hrtime),
// exactly when each stall happened. The root integration tests
// (profiler/tests/record_native.rs, record_container.rs) compare stallprof's
// stalls, named from V8's memory, with this log.
//
// Usage: node node_noflags.js LOG_PATH [FIFO_PATH [gc]]
// (FIFO_PATH defaults to LOG_PATH.fifo, made with mkfifo)
//
// The loop runs a 10 ms setInterval heartbeat. After ~1.5 s (startup,
// calibration), every ~400 ms a setTimeout callback blocks the loop in one
// of these functions, whose names and definition lines the tests look for:
//
//   deriveKey()    crypto.pbkdf2Sync (OpenSSL, C++ under a V8 API call), on-CPU
//   parseBig()     JSON.parse of a prebuilt string (V8's JsonParser), on-CPU
//   matchEvil()    /(a+)+$/ on 'aaa…ab': catastrophic backtracking in Irregexp code
//   readSlowPipe() fs.readFileSync of FIFO_PATH, whose writer (a child node
//                  process started just before) writes a byte every 10 ms:
//                  off-CPU in open/read
//
// With `gc`, the schedule is instead `churn()` four times: it allocates
// objects kept alive across calls, so V8 scavenges and mark-compacts
// inside it.
//
// Each culprit reads the clock itself, first and last thing in its body (see
// node_loop.js: a GC the call causes then lands inside the logged call).
//
// Log: JSON lines, each one synchronous write(2):
//   {"kind":"ready","pid":P,"tid":P,"mono_ns":NOW}
//   {"kind":K,"func":F,"seq":N,"tid":P,"work":N,"start_ns":..,"end_ns":..}
//   {"kind":"done"}
'use strict';

const crypto = require('crypto');
const fs = require('fs');
const { spawn } = require('child_process');

const TICK_MS = 10;
const GAP_MS = 400;
// Long enough for stallprof to have read V8's metadata (its own thread,
// started when the loop is found) before the first stall: a fresh-clone
// run on the fallback probes had it 51 ms into the first stall at 700 ms,
// so that stall's first half had no JavaScript frames
// (js_frames_v8_pending), as documented, and missed its culprit.
const STARTUP_MS = 1500;
const TARGET_MS = 110;
const LINGER_MS = 3000;

const [logPath, fifoArg, mode] = process.argv.slice(2);
if (!logPath) {
  process.stderr.write('usage: node node_noflags.js LOG_PATH [FIFO_PATH [gc]]\n');
  process.exit(2);
}
// Without FIFO_PATH (the bench's `VICTIM_CMD LOG`): LOG_PATH.fifo, made
// below by an asynchronous mkfifo before the schedule starts. (Not
// execFileSync: a synchronous spawn waits in an epoll loop of its own, which
// a profiler attached from exec can take for the event loop.)
const fifoPath = fifoArg || `${logPath}.fifo`;
const SCHEDULE =
  mode === 'gc'
    ? ['gc', 'gc', 'gc', 'gc']
    : ['pbkdf2', 'json', 'regex', 'pipe', 'pbkdf2', 'json', 'regex', 'pipe'];
const FUNC = { pbkdf2: 'deriveKey', json: 'parseBig', regex: 'matchEvil', pipe: 'readSlowPipe', gc: 'churn' };

const logFd = fs.openSync(logPath, 'w');
function log(obj) {
  fs.writeSync(logFd, JSON.stringify(obj) + '\n');
}
function recordHead(obj) {
  return JSON.stringify(obj).slice(0, -1);
}
function logTimes(head, times) {
  fs.writeSync(logFd, `${head},"start_ns":${times.start},"end_ns":${times.end}}\n`);
}

const now = () => process.hrtime.bigint();

// ---- the culprits --------------------------------------------------------------

function deriveKey(iterations, times) {
  times.start = now();
  crypto.pbkdf2Sync('correct horse battery staple', 'salt-of-the-earth', iterations, 64, 'sha512');
  times.end = now();
}

function parseBig(text, times) {
  times.start = now();
  JSON.parse(text);
  times.end = now();
}

function matchEvil(n, times) {
  times.start = now();
  /(a+)+$/.test('a'.repeat(n) + 'b');
  times.end = now();
}

function readSlowPipe(path, times) {
  times.start = now();
  fs.readFileSync(path);
  times.end = now();
}

let kept = [];
function churn(items, times) {
  times.start = now();
  const batch = [];
  for (let i = 0; i < items; i++) {
    batch.push({ id: i, name: 'item-' + i, tags: [i, i + 1, i + 2] });
  }
  kept.push(batch);
  if (kept.length > 3) kept.shift();
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

// CPU time, not wall time: the agent attaches while this calibrates, and
// on a small machine a wall-clock probe that shares the CPU with it
// overestimates the cost, so the calls planned from it come out too short.
function msOf(fn) {
  const c = process.cpuUsage();
  fn();
  const d = process.cpuUsage(c);
  return (d.user + d.system) / 1000;
}

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

  // Each extra 'a' doubles the backtracking: find n at ~5-10 ms, then scale.
  let n = 14;
  let t = 0;
  while (n < 40) {
    const k = n;
    t = Infinity;
    // Through matchEvil itself: V8 tiers a regexp up from its bytecode
    // interpreter to native code per literal, after its first runs.
    for (let i = 0; i < 3; i++) t = Math.min(t, msOf(() => matchEvil(k, {})));
    if (t >= 5) break;
    n++;
  }
  let regexN = n + Math.max(0, Math.round(Math.log2(TARGET_MS / t)));
  // Check the estimate on the real size (one run each, doubling per step)
  // and step towards TARGET_MS: tiering and noise make the scaling rough.
  for (let i = 0; i < 4; i++) {
    const k = regexN;
    const ms = msOf(() => matchEvil(k, {}));
    if (ms < TARGET_MS / 1.5) regexN++;
    else if (ms > TARGET_MS * 1.5) regexN--;
    else break;
  }

  const probeChurn = 20000;
  best = Infinity;
  for (let i = 0; i < 3; i++) best = Math.min(best, msOf(() => churn(probeChurn, {})));
  kept = [];
  const churnItems = Math.max(10000, Math.round((probeChurn * TARGET_MS) / best));
  return { iterations, items, regexN, churnItems };
}

// ---- the slow writer -----------------------------------------------------------

// A child node process: opens the FIFO for writing (blocking until the
// reader opens it), writes a byte every 10 ms, then closes it.
const WRITER = `
const fs = require('fs');
const fd = fs.openSync(process.argv[1], 'w');
let n = 0;
const t = setInterval(() => {
  fs.writeSync(fd, 'x');
  if (++n >= ${Math.round(TARGET_MS / 10)}) { clearInterval(t); fs.closeSync(fd); }
}, 10);
`;
function startWriter() {
  const child = spawn(process.execPath, ['-e', WRITER, fifoPath], { stdio: 'ignore' });
  child.on('error', (e) => log({ kind: 'writer_error', error: String(e) }));
}

// ---- the loop ------------------------------------------------------------------

fs.writeSync(logFd, `{"kind":"ready","pid":${process.pid},"tid":${process.pid},"mono_ns":${now()}}\n`);
const { iterations, items, regexN, churnItems } = calibrate();
const bigText = mode === 'gc' ? '' : makeJson(items);

const heartbeat = setInterval(() => {}, TICK_MS);
let seq = 0;

function step() {
  if (seq === SCHEDULE.length) {
    setTimeout(() => {
      log({ kind: 'done' });
      fs.closeSync(logFd);
      // Stay alive (idle, nothing allocated: nothing moves) a while:
      // JavaScript frames are named from this process's memory, and an
      // agent that fell behind on a loaded machine still reads them.
      setTimeout(() => clearInterval(heartbeat), LINGER_MS);
    }, GAP_MS);
    return;
  }
  const kind = SCHEDULE[seq];
  const work = { pbkdf2: iterations, json: bigText.length, regex: regexN, pipe: 0, gc: churnItems }[kind];
  const head = recordHead({ kind, func: FUNC[kind], seq, tid: process.pid, work });
  const times = { start: 0n, end: 0n };
  switch (kind) {
    case 'pbkdf2':
      deriveKey(iterations, times);
      break;
    case 'json':
      parseBig(bigText, times);
      break;
    case 'regex':
      matchEvil(regexN, times);
      break;
    case 'pipe':
      readSlowPipe(fifoPath, times);
      break;
    default:
      churn(churnItems, times);
  }
  logTimes(head, times);
  seq++;
  // The writer for the next pipe read starts well before it, in a loop
  // iteration of its own (forking it takes milliseconds).
  if (SCHEDULE[seq] === 'pipe') setTimeout(startWriter, GAP_MS / 2);
  setTimeout(step, GAP_MS);
}

function start() {
  if (SCHEDULE[0] === 'pipe') startWriter();
  setTimeout(step, STARTUP_MS);
}
if (fifoArg || fs.existsSync(fifoPath)) {
  start();
} else {
  spawn('mkfifo', [fifoPath], { stdio: 'ignore' }).on('exit', (code) => {
    if (code !== 0) {
      process.stderr.write(`mkfifo ${fifoPath} failed (${code})\n`);
      process.exit(2);
    }
    start();
  });
}
