// Serve web/ on 127.0.0.1 for a person's browser: `node serve.js [PORT]` (default: a free port),
// then open the printed URL + generate.html (or demo.html). Files under web/ only, no listing.
import path from "node:path";
import { fileURLToPath } from "node:url";
import { serve } from "./tools/gpu.js";

const server = await serve(path.dirname(fileURLToPath(import.meta.url)), Number(process.argv[2] ?? 0));
console.log(`${server.url}generate.html`);
