// Validates custom resources (a JSON array on stdin) against their operators' schemas, the way
// `kubectl apply` does with its default strict field validation; prints a JSON array of errors.
//
// Two passes, both over models generated from the operators' own CRDs (kubernetes-models):
// 1. the JSON-schema validators: types, patterns, enums, required fields;
// 2. the TypeScript interfaces: a field the CRD does not declare (a typo the API server would
//    refuse; the JSON schemas, like the CRDs, allow unknown fields and would let it through).
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import ts from "typescript";

const HERE = dirname(fileURLToPath(import.meta.url));
const MODELS = {
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
  "keda.sh/v1alpha1": "@kubernetes-models/keda/keda.sh/v1alpha1",
};

function modelPath(doc) {
  const group = MODELS[doc.apiVersion];
  return group && `${group}/${doc.kind}`;
}

async function schemaErrors(docs) {
  const errors = [];
  for (const doc of docs) {
    const path = modelPath(doc);
    if (!path) {
      errors.push(`${doc.apiVersion} ${doc.kind}: no schema for this kind`);
      continue;
    }
    const Model = (await import(path))[doc.kind];
    try {
      new Model(doc).validate();
    } catch (error) {
      errors.push(`${doc.kind} ${doc.metadata?.name}: ${error.message}`);
    }
  }
  return errors;
}

function unknownFieldErrors(docs) {
  // One document a line, typed by its interface: the compiler's excess-property check names
  // every field the interface (and so the CRD) lacks, at any depth.
  const lines = docs.flatMap((doc, i) => [
    `import type { I${doc.kind} as T${i} } from "${modelPath(doc)}";`,
    `export const doc${i}: T${i} = ${JSON.stringify(doc)};`,
  ]);
  const folder = mkdtempSync(join(HERE, ".check-"));
  try {
    const file = join(folder, "docs.ts");
    writeFileSync(file, lines.join("\n"));
    const program = ts.createProgram([file], {
      noEmit: true,
      strict: true,
      skipLibCheck: true,
      module: ts.ModuleKind.NodeNext,
      moduleResolution: ts.ModuleResolutionKind.NodeNext,
    });
    return ts.getPreEmitDiagnostics(program).map((diagnostic) => {
      const message = ts.flattenDiagnosticMessageText(diagnostic.messageText, " ");
      if (!diagnostic.file) return message;
      const { line } = diagnostic.file.getLineAndCharacterOfPosition(diagnostic.start);
      const doc = docs[Math.floor(line / 2)];
      return `${doc.kind} ${doc.metadata?.name}: ${message}`;
    });
  } finally {
    rmSync(folder, { recursive: true, force: true });
  }
}

const docs = JSON.parse(readFileSync(0, "utf8"));
const errors = await schemaErrors(docs);
if (errors.length === 0) errors.push(...unknownFieldErrors(docs));
process.stdout.write(JSON.stringify(errors));
