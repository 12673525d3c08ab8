/**
 * The package as a user installs it: `npm pack` (prepack builds dist/), the tarball installed into
 * a scratch project, then imported under Node as ESM and type-checked by a consumer's tsc (a Node
 * project: with @types/node, as the client's TLS options take Buffers).
 */
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { after, before, describe, it } from "node:test";

const here = resolve(import.meta.dirname, "..");
const npm = process.platform === "win32" ? "npm.cmd" : "npm";

describe("the packed package", { timeout: 300_000 }, () => {
  let scratch = "";

  before(() => {
    scratch = mkdtempSync(join(tmpdir(), "gengate-client-pack-"));
    const out = execFileSync(npm, ["pack", "--json", "--pack-destination", scratch], { cwd: here, encoding: "utf8" });
    const [{ filename, files }] = JSON.parse(out) as [{ filename: string; files: { path: string }[] }];
    const paths = files.map((f) => f.path);
    assert.ok(paths.includes("dist/index.js") && paths.includes("dist/index.d.ts"), `packed: ${paths.join(", ")}`);
    writeFileSync(join(scratch, "package.json"), JSON.stringify({ name: "consumer", private: true, type: "module" }));
    execFileSync(npm, ["install", "--no-audit", "--no-fund", "--prefer-offline", join(scratch, filename), "zod@4", "@types/node@20"], {
      cwd: scratch,
      stdio: "pipe",
    });
  });

  after(() => rmSync(scratch, { recursive: true, force: true }));

  it("imports under Node as ESM", () => {
    const code = `import { GengateClient, VERSION, TruncatedOutputError, prompt } from "@gengate/client";
      console.log(JSON.stringify([typeof GengateClient, VERSION, new TruncatedOutputError("m", "t").name, prompt("tiny", "hi").model]));`;
    const out = execFileSync(process.execPath, ["--input-type=module", "-e", code], { cwd: scratch, encoding: "utf8" });
    const version = (JSON.parse(readFileSync(join(here, "package.json"), "utf8")) as { version: string }).version;
    assert.deepEqual(JSON.parse(out), ["function", version, "TruncatedOutputError", "tiny"]);
  });

  it("type-checks in a consumer's TypeScript project", () => {
    writeFileSync(
      join(scratch, "use.ts"),
      `import { GengateClient, prompt, type GenerateResponse } from "@gengate/client";
       export async function ask(client: GengateClient): Promise<string> {
         const response: GenerateResponse = await client.generate(prompt("tiny", "hi"));
         return response.generations[0]?.text ?? "";
       }
       // @ts-expect-error the model name is a string
       prompt(1, "hi");\n`,
    );
    writeFileSync(
      join(scratch, "tsconfig.json"),
      JSON.stringify({ compilerOptions: { module: "NodeNext", moduleResolution: "NodeNext", strict: true, noEmit: true, skipLibCheck: false, types: ["node"] }, files: ["use.ts"] }),
    );
    try {
      execFileSync(process.execPath, [join(here, "node_modules/typescript/bin/tsc"), "-p", scratch], { cwd: scratch, encoding: "utf8" });
    } catch (e) {
      assert.fail(`tsc in the consumer project: ${(e as { stdout?: string }).stdout ?? String(e)}`);
    }
  });
});
