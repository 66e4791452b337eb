// The express victim's client (a child process of app.js): POST /warmup,
// then ROUNDS times POST /signup, POST /config, GET /api/report/daily, GET
// /api/lock, one at a time, GAP_MS apart; or, given PATHs, GET each of
// them in turn, ROUNDS times. Exits 0 when every answer was 200.
//
// Usage: node client.js PORT ROUNDS GAP_MS [PATH...]

import http from 'node:http';

const [port, rounds, gap] = process.argv.slice(2, 5).map(Number);
const paths = process.argv.slice(5);
const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function request(method, path, body) {
  return new Promise((resolve, reject) => {
    const data = body === undefined ? undefined : JSON.stringify(body);
    const req = http.request(
      {
        host: '127.0.0.1',
        port,
        method,
        path,
        agent,
        headers: data ? { 'content-type': 'application/json', 'content-length': Buffer.byteLength(data) } : {},
      },
      (res) => {
        res.resume();
        res.on('end', () =>
          res.statusCode === 200 ? resolve() : reject(new Error(`${method} ${path}: ${res.statusCode}`))
        );
      }
    );
    req.on('error', reject);
    req.end(data);
  });
}

// The first ones after the server's calibration, once it idles.
await sleep(gap);
await request('POST', '/warmup', { ok: true });
await sleep(gap);
for (let i = 0; i < rounds && paths.length > 0; i++) {
  for (const path of paths) {
    await request('GET', path);
    await sleep(gap);
  }
}
for (let i = 0; i < rounds && paths.length === 0; i++) {
  await request('POST', '/signup', { user: `user-${i}`, password: `hunter${i}-correct-horse` });
  await sleep(gap);
  await request('POST', '/config', { name: `deploy-${i}` });
  await sleep(gap);
  await request('GET', '/api/report/daily');
  await sleep(gap);
  await request('GET', '/api/lock');
  await sleep(gap);
}
agent.destroy();
