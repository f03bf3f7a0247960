// s3rver (the npm registry's S3 server, `make s3rver`: build/s3rver) for bench/objectstore.py, on
// loopback, keeping connections open as S3 does, behind a counter of what it serves: the requests
// it answers, the body bytes of its answers to object GETs, and the integral over time of the
// requests in flight (busy_s: its growth over a span of seconds is the mean number in flight),
// read at /__bench__/counts (as bench/s3server.py's for moto). Prints the port once it listens.
//
//     node bench/s3rver.js DIRECTORY BUCKET [PORT]
//
// Credentials: s3rver checks SigV4 signatures against its own key, S3RVER / S3RVER.
'use strict';

const http = require('http');
const path = require('path');

const S3rver = require(path.resolve(process.env.S3RVER_MODULES || 'build/s3rver/node_modules',
                                    's3rver'));

const [directory, bucket, port = '0'] = process.argv.slice(2);
const counts = { requests: 0, object_bytes: 0, busy_s: 0 };
let active = 0;
let since = process.hrtime.bigint();

function inFlight(change) {  // the integral of `active` up to now, then active += change
  const now = process.hrtime.bigint();
  counts.busy_s += active * Number(now - since) / 1e9;
  since = now;
  active += change;
}

async function main() {
  const app = new S3rver({ silent: true, directory, configureBuckets: [{ name: bucket }] });
  await app.configureBuckets();
  const handle = app.callback();
  const server = http.createServer((req, res) => {
    if (req.url === '/__bench__/counts') {
      inFlight(0);
      const body = JSON.stringify(counts);
      res.writeHead(200, { 'Content-Type': 'application/json',
                           'Content-Length': Buffer.byteLength(body) });
      res.end(body);
      return;
    }
    counts.requests += 1;
    inFlight(1);
    res.on('close', () => inFlight(-1));
    if (req.method === 'GET') {
      const key = req.url.split('?')[0].replace(/^\/+/, '');
      if (key.includes('/')) {  // a path-style /bucket/key: an object's bytes
        res.on('finish', () => {
          if (res.statusCode === 200 || res.statusCode === 206) {
            counts.object_bytes += Number(res.getHeader('content-length') || 0);
          }
        });
      }
    }
    handle(req, res);
  });
  server.keepAliveTimeout = 120000;  // as a store behind a load balancer: connections stay open
  server.headersTimeout = 121000;
  // its stdin is a pipe from the bench: it ends when the bench does, even when that is killed
  process.stdin.on('end', () => process.exit(0));
  process.stdin.resume();
  server.listen(Number(port), '127.0.0.1', () => {
    process.stdout.write(`${server.address().port}\n`);
  });
}

main().catch((err) => {
  process.stderr.write(`${err.stack || err}\n`);
  process.exit(1);
});
