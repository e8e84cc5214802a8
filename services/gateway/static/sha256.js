// SHA-256 (FIPS 180-4) of a text's UTF-8 bytes, for a page without
// crypto.subtle: browsers give it only to a secure context, and a page served
// over plain HTTP to another machine of the network is none. The page needs
// the digest to name its own queries (api.js, queryIdFor), not to keep
// secrets, so speed does not matter here: a key's digest is a few blocks.

// The first 32 bits of the fractional parts of the cube roots of the first 64 primes.
const ROUND = new Uint32Array([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
]);

// The first 32 bits of the fractional parts of the square roots of the first 8 primes.
const START = [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
  0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];

export function sha256Hex(text) {
  const words = paddedWords(new TextEncoder().encode(text));
  const state = new Uint32Array(START);
  const schedule = new Uint32Array(64);
  for (let at = 0; at < words.length; at += 16) compress(state, schedule, words, at);
  return Array.from(state, (word) => word.toString(16).padStart(8, "0")).join("");
}

// The message, a 1 bit, zeros, and its length in bits (64 bits, big-endian),
// to a whole number of 64-byte blocks, read as big-endian 32-bit words.
function paddedWords(bytes) {
  const length = Math.ceil((bytes.length + 9) / 64) * 64;
  const block = new Uint8Array(length);
  block.set(bytes);
  block[bytes.length] = 0x80;
  const view = new DataView(block.buffer);
  view.setUint32(length - 8, Math.floor(bytes.length / 0x20000000)); // bits / 2^32
  view.setUint32(length - 4, (bytes.length * 8) >>> 0);
  return Uint32Array.from({ length: length / 4 }, (_, i) => view.getUint32(i * 4));
}

const rotate = (x, n) => (x >>> n) | (x << (32 - n));

// One 64-byte block into the state. A Uint32Array keeps every sum modulo 2^32.
function compress(state, schedule, words, at) {
  const w = schedule;
  for (let t = 0; t < 16; t += 1) w[t] = words[at + t];
  for (let t = 16; t < 64; t += 1) {
    const s0 = rotate(w[t - 15], 7) ^ rotate(w[t - 15], 18) ^ (w[t - 15] >>> 3);
    const s1 = rotate(w[t - 2], 17) ^ rotate(w[t - 2], 19) ^ (w[t - 2] >>> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  let [a, b, c, d, e, f, g, h] = state;
  for (let t = 0; t < 64; t += 1) {
    const t1 = (h + (rotate(e, 6) ^ rotate(e, 11) ^ rotate(e, 25)) + ((e & f) ^ (~e & g))
      + ROUND[t] + w[t]) >>> 0;
    const t2 = ((rotate(a, 2) ^ rotate(a, 13) ^ rotate(a, 22)) + ((a & b) ^ (a & c) ^ (b & c))) >>> 0;
    [h, g, f, e, d, c, b, a] = [g, f, e, (d + t1) >>> 0, c, b, a, (t1 + t2) >>> 0];
  }
  [a, b, c, d, e, f, g, h].forEach((value, i) => { state[i] += value; });
}
