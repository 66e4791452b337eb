// node_cluster: a `cluster` primary forking worker processes, each an http
// server whose handlers block its event loop, and a worker that dies is
// forked again (as a supervisor does).
//
// Usage: node node_cluster.js LOG_PATH PORT [--workers N]
//
//   GET /hash?ms=N&seq=S   hashPassword: crypto.pbkdf2Sync rounds on the
//                          loop until N ms have passed (on-CPU; one round
//                          at least)
//   GET /nap?ms=N&seq=S    nap: Atomics.wait on a SharedArrayBuffer for N ms
//                          (the thread sleeps in the kernel: off-CPU)
//
// Every process appends to the one log (O_APPEND, one write per line),
// each line JSON, the shape of tests/victims/py_service.py's:
//
//   {"kind":"primary","pid":P}                    the primary is up
//   {"kind":"ready","pid":P,"ppid":Q,"tid":T}     a worker listens
//   {"kind":"begin","seq":S,"pid":P}              a handler begins request S
//   {"kind":"cpu"|"sleep","func":"hashPassword"|"nap","seq":S,"ms":N,
//    "pid":P,"tid":T,"start_ns":..,"end_ns":..,"cpu_ns":..}
//
// start_ns/end_ns are process.hrtime.bigint() (CLOCK_MONOTONIC) around the
// blocking section; cpu_ns is the main thread's run time over it, from
// /proc/self/task/TID/schedstat (the kernel's sum_exec_runtime: Node 20
// has no per-thread CPU clock of its own); tid is the main thread's, which
// is the process's pid.
'use strict';

const cluster = require('cluster');
const crypto = require('crypto');
const fs = require('fs');
const http = require('http');

const LOG = process.argv[2];
const PORT = Number(process.argv[3]);
const wi = process.argv.indexOf('--workers');
const WORKERS = wi > 0 ? Number(process.argv[wi + 1]) : 2;

function log(rec) {
  const fd = fs.openSync(LOG, 'a');
  try {
    fs.writeSync(fd, JSON.stringify(rec) + '\n');
  } finally {
    fs.closeSync(fd);
  }
}

if (cluster.isPrimary) {
  log({ kind: 'primary', pid: process.pid });
  for (let i = 0; i < WORKERS; i++) cluster.fork();
  cluster.on('exit', () => {
    if (!stopping) cluster.fork();
  });
  let stopping = false;
  const stop = () => {
    stopping = true;
    for (const id in cluster.workers) cluster.workers[id].process.kill('SIGTERM');
    process.exit(0);
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
} else {
  const tid = process.pid;
  const schedstat = `/proc/self/task/${tid}/schedstat`;
  const runNs = () => BigInt(fs.readFileSync(schedstat, 'utf8').split(' ')[0]);
  const napCell = new Int32Array(new SharedArrayBuffer(4));

  const section = (kind, func, seq, ms, start, cpu0) => {
    const end = process.hrtime.bigint();
    const cpu = runNs() - cpu0;
    log({
      kind, func, seq, ms, pid: process.pid, tid,
      start_ns: Number(start), end_ns: Number(end), cpu_ns: Number(cpu),
    });
  };

  function hashPassword(ms, seq) {
    log({ kind: 'begin', seq, pid: process.pid });
    const start = process.hrtime.bigint();
    const cpu0 = runNs();
    const until = start + BigInt(ms) * 1000000n;
    let digest;
    do { // one round at least: ms=0 warms the handler up
      digest = crypto.pbkdf2Sync('correct horse', 'battery staple', 2000, 32, 'sha256');
    } while (process.hrtime.bigint() < until);
    section('cpu', 'hashPassword', seq, ms, start, cpu0);
    return digest.toString('hex');
  }

  function nap(ms, seq) {
    log({ kind: 'begin', seq, pid: process.pid });
    const start = process.hrtime.bigint();
    const cpu0 = runNs();
    Atomics.wait(napCell, 0, 0, ms);
    section('sleep', 'nap', seq, ms, start, cpu0);
    return ms;
  }

  const server = http.createServer((req, res) => {
    const url = new URL(req.url, 'http://localhost');
    const ms = Number(url.searchParams.get('ms') || 60);
    const seq = Number(url.searchParams.get('seq') || 0);
    let body;
    if (url.pathname === '/hash') body = { digest: hashPassword(ms, seq), pid: process.pid };
    else if (url.pathname === '/nap') body = { slept_ms: nap(ms, seq), pid: process.pid };
    else {
      res.writeHead(404);
      res.end();
      return;
    }
    res.writeHead(200, { 'Content-Type': 'application/json', Connection: 'close' });
    res.end(JSON.stringify(body));
  });
  server.listen(PORT, '127.0.0.1', () => {
    log({ kind: 'ready', pid: process.pid, ppid: process.ppid, tid });
  });
}
